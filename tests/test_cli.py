"""The `redrafter` command line, driven through Typer's CliRunner."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from redrafter_mlx.prompt_lookup import DEFAULT_MIN_NGRAM

import mlx.core as mx
import numpy as np
import pytest
from gguf_fixtures import HIDDEN, bpe_vocab, layer_tensors, write_gguf
from mlx.utils import tree_flatten
from redrafter_cli.main import app
from tiny_models import tiny_drafter
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen.gguf"
    write_gguf(path, "qwen2", layer_tensors("qwen2", np.random.default_rng(1)), "gpt2")
    return path


@pytest.fixture(scope="module")
def tiny_llm_dir(tiny_gguf, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("llm") / "tiny"
    r = invoke("convert", "llm", tiny_gguf, dst)
    assert r.exit_code == 0, r.output
    return dst


def write_apple_drafter(folder: Path, vocab: int, hidden: int = HIDDEN, seed: int = 0) -> Path:
    """A random drafter in Apple's format: HF-style config.json + model.safetensors."""
    drafter = tiny_drafter(hidden, vocab, seed=seed)
    folder.mkdir(parents=True)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(drafter.parameters())))
    config = {
        "architectures": ["Drafter"],
        "model_type": "recurrent_drafting_drafter",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "exit_dim": 2 * hidden,
        "num_draft_layers": 2,
        "rnn": True,
        "num_lookback_tokens": 1,
        "torch_dtype": "float32",
        "transformers_version": "4.40.0",
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


VOCAB = len(bpe_vocab()[0])


def test_help_lists_every_command():
    r = invoke("--help")
    assert r.exit_code == 0
    for cmd in ("generate", "fetch", "models", "convert"):
        assert cmd in r.output


def test_models_lists_the_registry():
    r = invoke("models")
    assert r.exit_code == 0, r.output
    assert "qwen2.5-coder" in r.output and "gemma-3-270m" in r.output


def test_converted_apple_drafter_and_gguf_llm_run_together(tiny_llm_dir, tmp_path):
    apple = write_apple_drafter(tmp_path / "apple", VOCAB)
    drafter = tmp_path / "drafter"
    r = invoke("convert", "drafter", apple, drafter, "--dtype", "float32", "--llm", tiny_llm_dir)
    assert r.exit_code == 0, r.output
    common = ("--model", tiny_llm_dir, "--prompt", "the cat", "--max-tokens", "24", "--json")
    plain = invoke("generate", *common, "--no-draft")
    assert plain.exit_code == 0, plain.output
    spec = invoke("generate", *common, "--drafter", drafter, "--beam-width", "3")
    assert spec.exit_code == 0, spec.output
    a, b = json.loads(plain.output), json.loads(spec.output)
    assert b["token_ids"] == a["token_ids"] and b["num_tokens"] == len(a["token_ids"]) > 0
    assert b["settings"]["beam_width"] == 3 and b["steps"] >= 1
    assert b["settings"]["lookup"] == DEFAULT_MIN_NGRAM and a["settings"]["lookup"] == 0
    off = json.loads(invoke("generate", *common, "--drafter", drafter, "--lookup", "0").output)
    assert off["token_ids"] == a["token_ids"] and off["settings"]["lookup"] == 0
    pruned = invoke("generate", *common, "--drafter", drafter, "--beam-width", "3", "--prune")
    assert pruned.exit_code == 0, pruned.output
    c = json.loads(pruned.output)
    assert c["token_ids"] == a["token_ids"] and c["settings"]["prune"] is True


def test_convert_llm_refuses_existing_destination(tiny_gguf, tiny_llm_dir):
    r = invoke("convert", "llm", tiny_gguf, tiny_llm_dir)
    assert r.exit_code == 1
    assert "exists; pass --force" in r.output and "Traceback" not in r.output


def test_convert_llm_truncated_gguf_is_one_line(tiny_gguf, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(tiny_gguf.read_bytes()[:5000])
    r = invoke("convert", "llm", bad, tmp_path / "out")
    assert r.exit_code == 1 and "bad.gguf" in r.output
    assert len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "out").exists()


def test_convert_drafter_llm_mismatch(tiny_llm_dir, tmp_path):
    apple = write_apple_drafter(tmp_path / "apple", VOCAB + 1)
    r = invoke("convert", "drafter", apple, tmp_path / "d", "--llm", tiny_llm_dir)
    assert r.exit_code == 1 and "vocab" in r.output
    assert not (tmp_path / "d").exists()


def test_convert_missing_source(tmp_path):
    r = invoke("convert", "drafter", tmp_path / "nope", tmp_path / "d")
    assert r.exit_code == 1 and "nope" in r.output
    r = invoke("convert", "llm", tmp_path / "nope.gguf", tmp_path / "l")
    assert r.exit_code == 1 and "nope.gguf" in r.output


def test_generate_errors_are_one_line(tiny_llm_dir, tmp_path):
    r = invoke("generate", "--model", tmp_path / "missing", "--prompt", "x")
    assert r.exit_code == 1 and "no such model folder" in r.output
    r = invoke("generate", "--model", tiny_llm_dir, "--prompt", "x")
    assert r.exit_code == 1 and "no trained drafter" in r.output
    wrong = write_apple_drafter(tmp_path / "apple", VOCAB, hidden=HIDDEN // 2)
    ours = tmp_path / "ours"
    assert invoke("convert", "drafter", wrong, ours).exit_code == 0
    r = invoke("generate", "--model", tiny_llm_dir, "--drafter", ours, "--prompt", "x")
    assert r.exit_code == 1 and "hidden_size" in r.output and "Traceback" not in r.output


@pytest.mark.real_model
def test_fetch_converts_once_then_reuses(tmp_path, monkeypatch):
    monkeypatch.setenv("REDRAFTER_HOME", str(tmp_path))
    r = invoke("fetch", "gemma-3-270m")
    if r.exit_code != 0 and "not installed" in r.output:
        pytest.skip(r.output.strip())
    assert r.exit_code == 0, r.output
    assert (tmp_path / "models" / "gemma-3-270m" / "config.json").is_file()
    again = invoke("fetch", "gemma-3-270m")
    assert again.exit_code == 0 and "already there" in again.output
    r = invoke("fetch", "no-such-model")
    assert r.exit_code == 1 and "unknown model" in r.output


def test_convert_llm_from_hf_folder_quantized(tiny_llm_dir, tmp_path):
    """An HF-layout folder goes through mlx-lm's converter (here with 8-bit quantization)."""
    dst = tmp_path / "q8"
    r = invoke("convert", "llm", tiny_llm_dir, dst, "-q", "--q-bits", "8", "--q-group-size", "32")
    assert r.exit_code == 0, r.output
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization"]["bits"] == 8 and config["quantization"]["group_size"] == 32
    r = invoke("generate", "--model", dst, "--no-draft", "--prompt", "the cat", "-m", "5", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["num_tokens"] == 5
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left


def train_args(tiny_llm_dir: Path, out: Path, work: Path) -> tuple:
    return (
        "train",
        "--model",
        tiny_llm_dir,
        "--out",
        out,
        "--work-dir",
        work,
        "--num-prompts",
        "10",
        "--held-out",
        "2",
        "--max-new-tokens",
        "12",
        "--gen-batch",
        "4",
        "--draft-vocab",
        "64",
        "--window",
        "16",
        "--batch-rows",
        "4",
        "--checkpoint-every",
        "3",
        "--dtype",
        "float32",
    )


def test_train_smoke_run_then_generate(tiny_llm_dir, tmp_path):
    """`redrafter train` end to end on a tiny model: data, vocab, steps, resume, eval."""
    out, work = tmp_path / "drafter", tmp_path / "work"
    args = train_args(tiny_llm_dir, out, work)
    r = invoke(*args, "--max-steps", "3")
    assert r.exit_code == 0, r.output
    # Not a terminal: plain progress lines for a log file instead of the bars.
    assert "answered" in r.output and "prompts" in r.output and "step 3:" in r.output
    report = json.loads((out / "report.json").read_text())
    assert report["train_steps"] == 3 and report["draft_vocab_size"] == 64
    assert len(report["heldout_accuracy_by_horizon"]) == 5
    assert (work / "data" / "generations.jsonl").is_file()
    # Resume: continues from step 3 with the cached data instead of starting over.
    r = invoke(*args, "--max-steps", "5", "--resume")
    assert r.exit_code == 0, r.output
    assert json.loads((out / "report.json").read_text())["train_steps"] == 5
    config = json.loads((out / "config.json").read_text())
    assert len(config["draft_vocab"]) == 64
    common = ("--model", tiny_llm_dir, "--prompt", "the cat", "-m", "12", "--json")
    plain = json.loads(invoke("generate", *common, "--no-draft").output)
    spec = invoke("generate", *common, "--drafter", out)
    assert spec.exit_code == 0, spec.output
    assert json.loads(spec.output)["token_ids"] == plain["token_ids"]
    # --final-vocab: the trained head shrunk to its 32 most frequent tokens, still lossless.
    small = tmp_path / "small"
    shrunk = tuple(small if a == out else a for a in args)
    r = invoke(*shrunk, "--max-steps", "5", "--resume", "--final-vocab", "32")
    assert r.exit_code == 0, r.output
    assert len(json.loads((small / "config.json").read_text())["draft_vocab"]) == 32
    assert json.loads((small / "report.json").read_text())["draft_vocab_size"] == 32
    spec = invoke("generate", *common, "--drafter", small)
    assert spec.exit_code == 0, spec.output
    assert json.loads(spec.output)["token_ids"] == plain["token_ids"]


def load_bench(name: str):
    """A script of bench/ as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_init_drafter_continues_a_trained_drafter(tiny_llm_dir, tmp_path):
    """`--init-drafter` starts from the given drafter's weights and keeps its vocabulary."""
    first, work = tmp_path / "first", tmp_path / "work"
    r = invoke(*train_args(tiny_llm_dir, first, work), "--max-steps", "3")
    assert r.exit_code == 0, r.output
    # Zero further steps: the written drafter is the one it started from, although the
    # vocabulary the data would choose (--draft-vocab 32) differs.
    again = tmp_path / "again"
    args = (*train_args(tiny_llm_dir, again, work), "--draft-vocab", "32")
    r = invoke(*args, "--init-drafter", first, "--max-steps", "0")
    assert r.exit_code == 0, r.output
    assert "continuing" in r.output

    def load(folder: Path) -> dict:
        return mx.load(str(folder / "model.safetensors"))

    def config(folder: Path) -> dict:
        return json.loads((folder / "config.json").read_text())

    before, after = load(first), load(again)
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_array_equal(np.array(after[k]), np.array(before[k]))
    assert config(again)["draft_vocab"] == config(first)["draft_vocab"]
    # Further steps move it from there.
    more = tmp_path / "more"
    r = invoke(*train_args(tiny_llm_dir, more, work), "--init-drafter", first, "--max-steps", "2")
    assert r.exit_code == 0, r.output
    moved = load(more)
    assert any(not np.array_equal(np.array(moved[k]), np.array(before[k])) for k in before)
    # The report keeps the starting drafter's report: the card then shows both stages, and
    # the second stage's command continues the first instead of choosing a vocabulary.
    report = json.loads((more / "report.json").read_text())
    assert report["init_report"] == json.loads((first / "report.json").read_text())
    assert report["data"]["answers"] > 0
    card = load_bench("drafter_card")
    first_stage, second_stage = card.lineage(report)
    assert first_stage["train_steps"] == 3 and second_stage["train_steps"] == 2
    command = card.train_command(second_stage, "DRAFTER_2", init="DRAFTER_1")
    assert "--init-drafter DRAFTER_1" in command and "--draft-vocab" not in command
    assert "--draft-vocab 64" in card.train_command(first_stage)
    assert "--completions-only" not in command and "half as chat" in card.stage_lines(report)[0]
    fresh = {**second_stage, "recipe": {**second_stage["recipe"], "chat_share": 0.0}}
    fresh["recipe"]["fresh_prompts"] = True
    assert card.train_command(fresh).endswith(" --completions-only --fresh-prompts")
    assert "(raw completions only, none used by an earlier stage;" in card.stage_lines(fresh)[0]
    info = {"chip": "c", "cpu_count": 2, "platform": "p", "mlx": "m", "mlx_lm": "l", "device": "d"}
    text = card.card_markdown(report, {"greedy": {"W=1,L=3": 1.5}}, "0-1", 8, info)
    assert "Stage 2 (continues stage 1)" in text and "| W=1 | 1.50 |" in text
    del report["init_report"]  # a continued drafter whose start is unknown: said, not hidden
    with pytest.raises(ValueError, match="init_report"):
        card.lineage(report)
    # A drafter of another shape: an error that names the flag to pass.
    r = invoke(*args, "--init-drafter", first, "--num-draft-layers", "1")
    assert r.exit_code == 1 and "--num-draft-layers 2" in r.output, r.output
    r = invoke(*args, "--init-drafter", first, "--head-init", "llm")
    assert r.exit_code == 1 and "--head-init llm" in r.output, r.output


@pytest.fixture(scope="module")
def random_drafter_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("drafter") / "random"
    tiny_drafter(HIDDEN, VOCAB, seed=3).save_pretrained(folder)
    return folder


def test_train_kl_term_and_llm_head_init_reach_the_trainer(tiny_llm_dir, tmp_path, monkeypatch):
    """--kl-weight hands the LLM's draft-vocab output rows to the trainer (the KL term is
    computed, not silently skipped) and --head-init llm starts from those rows."""
    from redrafter_mlx import recipe

    seen = {}
    real = recipe.train

    def spy(drafter, *a, **kw):
        seen["head"] = np.array(drafter.lm_head[-1].weight)
        seen["llm_head"] = kw.get("llm_head")
        return real(drafter, *a, **kw)

    monkeypatch.setattr(recipe, "train", spy)
    args = train_args(tiny_llm_dir, tmp_path / "d", tmp_path / "w")
    r = invoke(*args, "--max-steps", "1", "--kl-weight", "0.5", "--head-init", "llm")
    assert r.exit_code == 0, r.output
    rows = np.array(seen["llm_head"])
    assert rows.shape == (64, HIDDEN)
    np.testing.assert_array_equal(seen["head"][:, :HIDDEN], rows)
    assert not seen["head"][:, HIDDEN:].any()
    r = invoke(*args, "--max-steps", "1", "--head-init", "medusa")
    assert r.exit_code != 0 and "head_init must be" in r.output


def test_bench_grid_table_json_and_heat_map(tiny_llm_dir, random_drafter_dir, tmp_path):
    prompts = tmp_path / "mt.jsonl"
    prompts.write_text('{"turns": ["the cat"]}\n{"prompt": "def f(x):"}\n')
    out, png = tmp_path / "bench.json", tmp_path / "grid.png"
    r = invoke(
        "bench",
        "--model",
        tiny_llm_dir,
        "--drafter",
        random_drafter_dir,
        "--prompts",
        prompts,
        "-m",
        "10",
        "--grid",
        "1,2x2,3",
        "--out",
        out,
        "--png",
        png,
    )
    assert r.exit_code == 0, r.output
    assert "speedup" in r.output and "ReDrafter W=2 L=3" in r.output and "AR (mlx-lm)" in r.output
    result = json.loads(out.read_text())
    assert set(result["summary"]) == {"AR (mlx-lm)"} | {  # with chat's default prompt lookup
        f"ReDrafter W={w} L={n} lookup 2" for w in (1, 2) for n in (2, 3)
    }
    assert result["lookup"] == [2]
    for row in result["summary"].values():  # greedy: identical to AR on both prompts
        assert row["identical_to_baseline"] == 2 and row["mismatched_prompts"] == []
    assert result["machine"]["mlx"] and png.read_bytes()[:4] == b"\x89PNG"


def test_bench_prune_adds_a_pruned_run_of_each_config(tiny_llm_dir, random_drafter_dir, tmp_path):
    prompt, out = tmp_path / "p.txt", tmp_path / "bench.json"
    prompt.write_text("the cat sat")
    args = ["--model", tiny_llm_dir, "--drafter", random_drafter_dir, "--prompts", prompt]
    r = invoke(
        "bench", *args, "-m", "10", "--grid", "2x3", "--prune", "--lookup", "0,2", "--out", out
    )
    assert r.exit_code == 0, r.output
    assert "step cost for 1..5 tokens" in r.output and "pruned" in r.output
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == {"AR (mlx-lm)"} | {
        f"ReDrafter W=2 L=3{p}{n}" for p in ("", " pruned") for n in ("", " lookup 2")
    }
    for row in summary.values():
        assert row["identical_to_baseline"] == 1
    for bad in ("3,x", "3,3", "-1"):
        r = invoke("bench", *args, "--lookup", bad)
        assert r.exit_code == 1 and "--lookup" in r.output, r.output
    assert summary["ReDrafter W=2 L=3 pruned"]["identical_to_baseline"] == 1
    assert 1 <= summary["ReDrafter W=2 L=3 pruned"]["tree_tokens"] <= 5


def test_bench_text_file_sampling_and_profile(tiny_llm_dir, random_drafter_dir, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("the cat sat")
    r = invoke(
        "bench",
        "--model",
        tiny_llm_dir,
        "--drafter",
        random_drafter_dir,
        "--prompts",
        prompt,
        "-m",
        "8",
        "--temp",
        "0.7",
        "--top-p",
        "0.9",
        "--seed",
        "1",
        "--profile",
    )
    assert r.exit_code == 0, r.output
    assert "temp 0.7" in r.output
    phases = r"tree [\d.]+,\s+verify [\d.]+,\s+accept [\d.]+,\s+draft [\d.]+,\s+commit [\d.]+"
    assert re.search(phases, r.output), r.output


def test_tune_stores_the_fastest_shape(tiny_llm_dir, random_drafter_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("REDRAFTER_HOME", str(tmp_path))
    prompts = tmp_path / "p.txt"
    prompts.write_text("the cat")
    r = invoke(
        "tune",
        "--model",
        tiny_llm_dir,
        "--drafter",
        random_drafter_dir,
        "--prompts",
        prompts,
        "-m",
        "6",
        "--grid",
        "1,2x2",
    )
    assert r.exit_code == 0, r.output
    settings = json.loads((tmp_path / "settings.json").read_text())
    (beam,) = [v["beam"] for v in settings.values()]
    assert beam["width"] in (1, 2) and beam["length"] == 2
    assert "pruned" in r.output  # pruned variants were tried
    assert beam["drafter"] == str(random_drafter_dir.resolve())
    if beam["prune"]:  # the cost it measured, one entry per tree size, kept for chat/generate
        assert len(beam["step_cost"]) == 1 + beam["width"] and beam["alpha"] > 0
    else:
        assert "step_cost" not in beam
    r = invoke(
        "generate",
        "--model",
        tiny_llm_dir,
        "--drafter",
        random_drafter_dir,
        "--prompt",
        "x",
        "-m",
        "3",
        "--json",
    )
    assert json.loads(r.output)["settings"]["beam_width"] == beam["width"]


def test_chat_turns_commands_and_stats(tiny_llm_dir, random_drafter_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("REDRAFTER_HOME", str(tmp_path))
    script = "the cat\ndef f(x):\n/stats\n/reset\n/help\nthe cat\n/quit\n"
    r = runner.invoke(
        app,
        ["chat", "--model", str(tiny_llm_dir), "--drafter", str(random_drafter_dir), "-m", "8"],
        input=script,
    )
    assert r.exit_code == 0, r.output
    assert r.output.count("tokens/step") >= 3  # a status line after each reply, and /stats
    assert "vs AR" in r.output and "conversation cleared" in r.output and "/reset" in r.output
    assert "2 replies" in r.output


def test_chat_reuses_the_cache_and_matches_plain_decoding(
    tiny_llm_dir, random_drafter_dir, monkeypatch
):
    """Turn 2 feeds only the new tokens, and every reply equals plain decoding's; prompt
    lookup searches the whole conversation, not only the new tokens."""
    import redrafter_mlx.generate
    from redrafter_mlx.drafter import Drafter
    from redrafter_mlx.loading import load
    from redrafter_mlx.prompt_lookup import PromptLookup
    from redrafter_mlx.tree_budget import TreeBudget
    from redrafter_mlx.verification import SamplingParams

    from redrafter_cli.chat import Session

    model, tokenizer, _ = load(tiny_llm_dir)
    drafter = Drafter.from_pretrained(random_drafter_dir)
    spec = Session(model, tokenizer, drafter, 2, 3, SamplingParams(), 8)
    budget = TreeBudget([1.0, 1.1, 1.2, 2.0, 2.1])
    pruned = Session(model, tokenizer, drafter, 2, 3, SamplingParams(), 8, budget=budget)
    plain = Session(model, tokenizer, None, 2, 3, SamplingParams(), 8)
    lookup = Session(model, tokenizer, drafter, 1, 3, SamplingParams(), 8, lookup=1)
    assert pruned.budget is not None and spec.budget is None
    contexts = []

    class Recording(PromptLookup):
        def __init__(self, tokens, *args):
            contexts.append(list(tokens))
            super().__init__(tokens, *args)

    monkeypatch.setattr(redrafter_mlx.generate, "PromptLookup", Recording)
    for turn in ("the cat", "def f(x):", "sat"):
        a = "".join(spec.reply(turn))
        b = "".join(plain.reply(turn))
        assert a == b == "".join(pruned.reply(turn))
        assert "".join(lookup.reply(turn)) == a
        asked = lookup.messages[:-1]  # the reply's prompt: without the reply itself
        ids = tokenizer.apply_chat_template(asked, add_generation_prompt=True)
        assert contexts[-1][: len(ids)] == ids and len(contexts[-1]) == len(ids) + 1
        if turn != "the cat":
            assert spec.last.prompt_tokens < len(spec.prompt_ids())  # only the new part fed
            assert lookup.last.prompt_tokens < len(ids)
    assert lookup.last.lookup_steps > 0
    assert spec.messages == plain.messages


def test_float16_drafter_computes_in_the_llms_dtype(tiny_llm_dir, tmp_path):
    """Shipped drafters are float16; beside a float32 LLM they are upcast on load (float16
    matmuls are several times slower on the CPU backend), with the same weights."""
    from redrafter_mlx.drafter import Drafter
    from redrafter_mlx.loading import load

    folder = tmp_path / "fp16"
    small = tiny_drafter(HIDDEN, VOCAB, seed=5)
    small.set_dtype(mx.float16)
    small.save_pretrained(folder)
    model, _, drafter = load(tiny_llm_dir, folder)
    assert model.model.embed_tokens.weight.dtype == mx.float32
    assert drafter.dtype == mx.float32
    stored = dict(tree_flatten(Drafter.from_pretrained(folder).parameters()))
    for name, w in tree_flatten(drafter.parameters()):
        assert w.dtype == mx.float32
        assert mx.array_equal(w, stored[name].astype(mx.float32)), name
    # generate, chat and bench keep it as stored: generation casts it only to draft in float.
    _, _, kept = load(tiny_llm_dir, folder, cast_drafter=False)
    assert kept.dtype == mx.float16


def test_bench_runs_after_a_float_search_see_the_shipped_float16_drafter(
    tiny_llm_dir, tmp_path, monkeypatch
):
    """A W=2 search casts the float16 drafter to float32 in place; the runs after it in a grid
    (W=1 here) must find it float16 again, or their peaks count a cast they do not use."""
    import redrafter_mlx.generate as generate
    from redrafter_mlx.loading import load
    from redrafter_mlx.verification import SamplingParams

    from redrafter_cli.bench import run_bench

    folder = tmp_path / "fp16"
    small = tiny_drafter(HIDDEN, VOCAB, seed=5)
    small.set_dtype(mx.float16)
    small.save_pretrained(folder)
    model, tokenizer, drafter = load(tiny_llm_dir, folder, cast_drafter=False)
    seen = []
    real = generate.stream_generate

    def spy(model, drafter, ids, **kw):
        before = drafter.dtype
        steps = real(model, drafter, ids, **kw)
        seen.append((kw["beam_width"], before, drafter.dtype))  # after: the proposer is built
        return steps

    monkeypatch.setattr(generate, "stream_generate", spy)
    ids = [tokenizer.encode("the cat sat"), tokenizer.encode("def f(x):")]
    summary, _ = run_bench(
        model, drafter, ids, [(2, 3), (1, 3)], SamplingParams(), 6,
        tokenizer.eos_token_ids, None, False, lambda *_: None, lookups=(0,),
    )  # fmt: skip
    assert {w for w, *_ in seen} == {1, 2} and len(seen) == 6  # a warm-up and 2 prompts each
    assert all(before == mx.float16 for _, before, _ in seen)  # every run starts as shipped
    assert all(after == mx.float32 for w, _, after in seen if w == 2)  # the float search's cast
    assert drafter.dtype == mx.float16
    for row in summary.values():
        assert row["identical_to_baseline"] == 2


def test_a_stored_tune_holds_only_for_its_drafter_weights_blas_and_cpu(
    tiny_llm_dir, random_drafter_dir, tmp_path, monkeypatch, capsys
):
    """Another drafter's weights in the same folder, another BLAS or another CPU make tune's
    shape, step cost and calibration meaningless: they are ignored, and the user is told to
    re-tune."""
    import shutil

    from redrafter_mlx import _blas, benchmark, settings

    from redrafter_cli.common import defaults

    monkeypatch.setenv("REDRAFTER_HOME", str(tmp_path / "home"))
    drafter_dir = tmp_path / "drafter"
    shutil.copytree(random_drafter_dir, drafter_dir)
    beam = {"width": 2, "length": 5, "prune": True, "step_cost": [1.0, 1.1, 1.2], "alpha": 2.0}
    settings.put(tiny_llm_dir, "beam", beam | settings.tuned_for(drafter_dir))
    assert settings.tuned_beam(tiny_llm_dir, drafter_dir)[0]["step_cost"] == [1.0, 1.1, 1.2]
    assert defaults(tiny_llm_dir, drafter_dir, None, None, None) == (2, 5)
    assert settings.tuned_beam(tiny_llm_dir, None) == ({}, None)  # --no-draft

    blas = _blas.status
    monkeypatch.setattr(_blas, "status", "loaded:libsomething.so")
    tuned, why = settings.tuned_beam(tiny_llm_dir, drafter_dir)
    assert tuned == {} and "BLAS" in why and "libsomething" in why
    monkeypatch.setattr(_blas, "status", blas)
    if _blas.gemm == "on":  # the same BLAS without the few-row kernel costs other step times
        monkeypatch.setattr(_blas, "gemm", "off")
        tuned, why = settings.tuned_beam(tiny_llm_dir, drafter_dir)
        assert tuned == {} and "few-row gemm off" in why
        monkeypatch.setattr(_blas, "gemm", "on")
    here = benchmark.chip()
    monkeypatch.setattr(benchmark, "chip", lambda: "Other CPU (AVX2)")
    tuned, why = settings.tuned_beam(tiny_llm_dir, drafter_dir)
    assert tuned == {} and "another CPU" in why and "Other CPU (AVX2)" in why
    monkeypatch.setattr(benchmark, "chip", lambda: here)
    assert settings.tuned_beam(tiny_llm_dir, drafter_dir)[0]["width"] == 2

    weights = drafter_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes() + b" ")  # retrained in place
    tuned, why = settings.tuned_beam(tiny_llm_dir, drafter_dir)
    assert tuned == {} and "other drafter weights" in why
    capsys.readouterr()
    assert defaults(tiny_llm_dir, drafter_dir, None, None, None) == (4, 5)  # the fallback
    assert "run `redrafter tune` again" in capsys.readouterr().err
    assert defaults(tiny_llm_dir, drafter_dir, None, 1, 3) == (1, 3)  # flags win


def test_the_machine_description_tells_cpu_generations_apart():
    """A VM's "AMD EPYC" was a Zen 1 one day and a Zen 4 the next (ratios 20% apart): the
    family, model and vector extension go with the name; only the first CPU's block counts."""
    from redrafter_mlx.benchmark import linux_chip

    def block(family: str, model: str, flags: str) -> str:
        return (
            f"processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\n"
            f"model\t\t: {model}\nmodel name\t: AMD EPYC\nflags\t\t: fpu {flags} sse\n"
        )

    zen1, zen4 = block("23", "1", "avx2 fma"), block("25", "17", "avx2 avx512f avx512bw")
    assert linux_chip(zen1) == "AMD EPYC (family 23, model 1; AVX2)"
    assert linux_chip(zen4) == "AMD EPYC (family 25, model 17; AVX-512)"
    assert linux_chip(zen1 + "\n" + zen4) == linux_chip(zen1)
    assert linux_chip("processor\t: 0\nmodel name\t: Some CPU\n") == "Some CPU"
    assert linux_chip("processor\t: 0\nCPU implementer\t: 0x41\n") is None  # aarch64


def test_chat_and_generate_prune_as_tune_found(
    tiny_llm_dir, random_drafter_dir, tmp_path, monkeypatch
):
    """No flag: prune with tune's stored cost when it chose pruning for this shape and drafter;
    --prune: that cost, else one measured now; --no-prune, another shape or drafter: none."""
    from redrafter_mlx import settings
    from redrafter_mlx.drafter import Drafter
    from redrafter_mlx.loading import load

    from redrafter_cli.common import tree_budget

    monkeypatch.setenv("REDRAFTER_HOME", str(tmp_path))
    model, _, _ = load(tiny_llm_dir)
    drafter = Drafter.from_pretrained(random_drafter_dir)
    cost = [1.0, 1.0, 9.0, 9.0, 9.0]  # verifying a third token never pays
    beam = {"width": 2, "length": 3, "speedup": 1.2, "prune": True, "alpha": 1.7}
    settings.put(
        tiny_llm_dir, "beam", beam | settings.tuned_for(random_drafter_dir) | {"step_cost": cost}
    )

    def budget(W=2, L=3, prune=None, drafter_dir=random_drafter_dir):
        return tree_budget(tiny_llm_dir, drafter_dir, model, drafter, W, L, prune)

    b = budget()
    assert b.step_cost == cost and b.alpha == 1.7
    assert budget(prune=True).step_cost == cost
    assert budget(prune=False) is None and budget(W=1) is None
    assert budget(drafter_dir=Path(random_drafter_dir).parent) is None
    measured = budget(W=1, prune=True)
    assert len(measured.step_cost) == 3 and measured.step_cost != cost[:3]
    common = ("--model", tiny_llm_dir, "--prompt", "the cat", "-m", "10", "--json")
    plain = json.loads(invoke("generate", *common, "--no-draft").output)
    for flags, pruned in [((), True), (("--no-prune",), False), (("--beam-width", "1"), False)]:
        r = invoke("generate", *common, "--drafter", random_drafter_dir, *flags)
        assert r.exit_code == 0, r.output
        out = json.loads(r.output)
        assert out["settings"]["prune"] is pruned and out["token_ids"] == plain["token_ids"]


def test_full_head_turns_the_screen_off_with_the_same_output(
    tiny_llm_dir, random_drafter_dir, monkeypatch
):
    """``--full-head`` (generate and chat) trades the int8 screen's memory for speed: the
    engine is asked for no screen, and the tokens are the same."""
    import redrafter_mlx.generate
    from redrafter_mlx.drafter import Drafter
    from redrafter_mlx.loading import load
    from redrafter_mlx.verification import SamplingParams

    from redrafter_cli.chat import Session

    asked = []
    original = redrafter_mlx.generate.stream_redrafter

    def recorded(*args, **kwargs):
        asked.append(kwargs["head_screen"])
        return original(*args, **kwargs)

    monkeypatch.setattr(redrafter_mlx.generate, "stream_redrafter", recorded)
    common = ("--model", tiny_llm_dir, "--drafter", random_drafter_dir, "-p", "the cat", "--json")
    screened = json.loads(invoke("generate", *common, "-m", "12").output)
    full = json.loads(invoke("generate", *common, "-m", "12", "--full-head").output)
    assert asked == [True, False]
    assert full["token_ids"] == screened["token_ids"] and full["settings"]["full_head"] is True

    model, tokenizer, _ = load(tiny_llm_dir)
    drafter = Drafter.from_pretrained(random_drafter_dir)
    on = Session(model, tokenizer, drafter, 1, 3, SamplingParams(), 8)
    off = Session(model, tokenizer, drafter, 1, 3, SamplingParams(), 8, head_screen=False)
    assert "".join(off.reply("the cat")) == "".join(on.reply("the cat"))
    assert asked[2:] == [False, True]
