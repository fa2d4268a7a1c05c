"""The Recurrent Drafter: a small RNN over the LLM's own token embeddings with a ResNet head.

Architecture and parameter names follow Apple's ml-recurrent-drafter so that its checkpoints
load one to one:

- ``rnn_w.weight`` [H, H] (no bias) and ``rnn_u.weight`` [H, H], ``rnn_u.bias`` [H] when
  ``rnn`` is on;
- ``lm_head.{i}.linear.weight/bias`` [E, E] for the ``num_draft_layers`` residual blocks and
  ``lm_head.{N}.weight`` [V, E] (no bias) for the output layer;
- ``input_proj.weight/bias`` [E, 2H] only when ``exit_dim != 2 * hidden_size``.

Given the LLM's final hidden state ``h`` (after its final norm) at the position that produced
the guaranteed token, and the RNN state ``s``::

    s_0 = 0
    s_t = SiLU(rnn_w(E(tok)) + rnn_u(s_{t-1}))     (rnn=True)
    s_t = s_{t-1} + E(tok)                          (rnn=False)
    logits_t = lm_head(input_proj?(concat[h, s_t]))

Extension: an optional *draft vocabulary*, a sorted list of token ids the output layer predicts
over (``V_d`` rows instead of ``V``). For large-vocabulary LLMs a full-vocabulary head costs more
than the LLM step it tries to save.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

MODEL_TYPE = "recurrent_drafting_drafter"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass
class DrafterConfig:
    vocab_size: int
    hidden_size: int
    exit_dim: int | None = None  # defaults to 2 * hidden_size
    num_draft_layers: int = 2
    rnn: bool = True
    emb_norm: bool = False  # present in Apple's config; ignored in the forward pass
    draft_vocab: list[int] | None = None  # sorted token ids predicted by the output layer
    extra: dict[str, Any] = field(default_factory=dict)  # other config.json keys, kept as is

    def __post_init__(self) -> None:
        if self.exit_dim is None:
            self.exit_dim = 2 * self.hidden_size
        for name in ("vocab_size", "hidden_size", "exit_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"drafter config: {name} must be a positive integer, got {value!r}"
                )
        if not isinstance(self.num_draft_layers, int) or self.num_draft_layers < 0:
            raise ValueError(
                "drafter config: num_draft_layers must be a non-negative integer, "
                f"got {self.num_draft_layers!r}"
            )
        if self.draft_vocab is not None:
            ids = [int(i) for i in self.draft_vocab]
            if not ids:
                raise ValueError("drafter config: draft_vocab is empty; omit it for the full vocab")
            if any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
                raise ValueError(
                    "drafter config: draft_vocab must be strictly increasing token ids"
                )
            if ids[0] < 0 or ids[-1] >= self.vocab_size:
                raise ValueError(
                    f"drafter config: draft_vocab ids must lie in [0, {self.vocab_size}), "
                    f"got {ids[0]}..{ids[-1]}"
                )
            self.draft_vocab = ids

    @property
    def output_size(self) -> int:
        """Rows of the output layer: the draft vocabulary size, or the full vocabulary."""
        return len(self.draft_vocab) if self.draft_vocab is not None else self.vocab_size

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> DrafterConfig:
        names = {f.name for f in fields(cls)} - {"extra"}
        missing = [k for k in ("vocab_size", "hidden_size") if k not in config]
        if missing:
            raise ValueError(f"drafter config: missing required field(s) {', '.join(missing)}")
        known = {k: v for k, v in config.items() if k in names}
        extra = {k: v for k, v in config.items() if k not in names}
        return cls(**known, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        extra = d.pop("extra")
        if d["draft_vocab"] is None:
            d.pop("draft_vocab")
        return {**extra, **d, "model_type": MODEL_TYPE}


class ResBlock(nn.Module):
    """``x + SiLU(Linear(x))``: one residual block of the drafter head."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        return x + nn.silu(self.linear(x))


class Drafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        H, E = config.hidden_size, config.exit_dim
        if E != 2 * H:
            self.input_proj = nn.Linear(2 * H, E, bias=True)
        self.lm_head = [ResBlock(E) for _ in range(config.num_draft_layers)] + [
            nn.Linear(E, config.output_size, bias=False)
        ]
        if config.rnn:
            self.rnn_w = nn.Linear(H, H, bias=False)
            self.rnn_u = nn.Linear(H, H, bias=True)
        # Underscored: not a parameter, not saved with the weights.
        self._draft_vocab = (
            mx.array(config.draft_vocab, dtype=mx.int32) if config.draft_vocab is not None else None
        )

    @property
    def dtype(self) -> mx.Dtype:
        return self.lm_head[-1].weight.dtype

    def step(self, state: mx.array, token_embedding: mx.array) -> mx.array:
        """Advance the RNN state by one token. state, token_embedding: [..., H]."""
        e = token_embedding.astype(state.dtype)
        if self.config.rnn:
            return nn.silu(self.rnn_w(e) + self.rnn_u(state))
        return state + e

    def logits(self, hidden: mx.array, state: mx.array) -> mx.array:
        """Draft logits over the draft vocabulary. hidden, state: [..., H] -> [..., V_d]."""
        x = mx.concatenate([hidden.astype(state.dtype), state], axis=-1)
        if "input_proj" in self:
            x = self.input_proj(x)
        for layer in self.lm_head:
            x = layer(x)
        return x

    def token_ids(self, draft_ids: mx.array) -> mx.array:
        """Map indices into the output layer to the LLM's token ids."""
        if self._draft_vocab is None:
            return draft_ids
        return self._draft_vocab[draft_ids]

    def __call__(self, hidden: mx.array, token_embeddings: mx.array) -> mx.array:
        """Teacher-forced logits for a run of tokens (training and parity checks).

        hidden: [B, H], the LLM's state that produced the first token;
        token_embeddings: [B, T, H], embeddings of the T tokens fed to the RNN.
        Returns [B, T, V_d]: position t predicts the token after the t-th input token.
        """
        B, T, H = token_embeddings.shape
        state = mx.zeros((B, H), dtype=self.dtype)
        outputs = []
        for t in range(T):
            state = self.step(state, token_embeddings[:, t])
            outputs.append(self.logits(hidden, state))
        return mx.stack(outputs, axis=1)

    # -- persistence ---------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Drafter:
        """Load a drafter folder (``config.json`` + ``model.safetensors``) in MLX format."""
        path = Path(path)
        config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
        for p in (config_path, weights_path):
            if not p.is_file():
                raise FileNotFoundError(
                    f"{p}: not found; a drafter folder holds {CONFIG_FILE} and {WEIGHTS_FILE} "
                    "(convert Apple/PyTorch checkpoints with `redrafter convert drafter`)"
                )
        try:
            config = DrafterConfig.from_dict(json.loads(config_path.read_text()))
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"{config_path}: not a valid drafter config ({e})") from e
        model = cls(config)
        weights = mx.load(str(weights_path))
        weights.pop("emb_norm.weight", None)  # Apple's optional norm is unused in the forward
        try:
            model.load_weights(list(weights.items()), strict=True)
        except ValueError as e:
            raise ValueError(f"{weights_path}: weights do not match {config_path} ({e})") from e
        mx.eval(model.parameters())
        return model

    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(path / WEIGHTS_FILE), dict(tree_flatten(self.parameters())))
        (path / CONFIG_FILE).write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
