"""`redrafter chat` in a real pseudo-terminal: two turns, /reset, Ctrl-C, /quit."""

import json
import sys
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")

import numpy as np  # noqa: E402
from gguf_fixtures import bpe_vocab, layer_tensors, write_gguf  # noqa: E402
from tiny_models import tiny_drafter  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from redrafter_mlx.conversion.gguf import convert_gguf

    root = tmp_path_factory.mktemp("pty")
    gguf = root / "tiny.gguf"
    write_gguf(gguf, "qwen2", layer_tensors("qwen2", np.random.default_rng(1)), "gpt2")
    model = convert_gguf(gguf, root / "llm")
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    drafter = root / "drafter"
    tiny_drafter(hidden, len(bpe_vocab()[0]), seed=3).save_pretrained(drafter)
    return model, drafter, root


def test_chat_in_a_terminal(tiny):
    model, drafter, home = tiny
    redrafter = Path(sys.executable).parent / "redrafter"
    child = pexpect.spawn(
        str(redrafter),
        ["chat", "--model", str(model), "--drafter", str(drafter), "-m", "30"],
        env={"REDRAFTER_HOME": str(home), "PATH": "/usr/bin:/bin", "TERM": "dumb"},
        encoding="utf-8",
        timeout=120,
        dimensions=(40, 200),
    )
    child.expect(">>> ")
    child.sendline("the cat")
    child.expect(r"tokens/step.*vs AR")
    child.expect(">>> ")
    child.sendline("def f(x):")
    child.expect("tokens/step")
    child.expect(">>> ")
    child.sendline("/reset")
    child.expect("conversation cleared")
    child.expect(">>> ")
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_the_reply_and_keeps_the_session(tiny):
    model, drafter, home = tiny
    redrafter = Path(sys.executable).parent / "redrafter"
    child = pexpect.spawn(
        str(redrafter),
        ["chat", "--model", str(model), "--drafter", str(drafter), "-m", "10000"],
        env={"REDRAFTER_HOME": str(home), "PATH": "/usr/bin:/bin", "TERM": "dumb"},
        encoding="utf-8",
        timeout=120,
        dimensions=(40, 200),
    )
    child.expect(">>> ")
    child.sendline("the cat")
    # Past the terminal's echo of the line: Ctrl-C sent while the line is still being read
    # raced the reply (which this tiny model ends with EOS after 92 tokens).
    child.expect_exact("the cat\r\n")
    child.expect(r"\S")  # the reply has started streaming
    child.sendintr()
    child.expect(r"\(stopped\)")
    child.expect(">>> ")
    child.sendline("/stats")
    child.expect("replies")
    child.expect(">>> ")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
