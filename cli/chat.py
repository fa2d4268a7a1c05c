"""``redrafter chat``: a multi-turn terminal chat that streams tokens as they are accepted."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from .common import (
    DrafterOpt,
    FullHeadOpt,
    LengthOpt,
    LookupOpt,
    MaxTokensOpt,
    MinPOpt,
    ModelOpt,
    NoDraftOpt,
    PruneOpt,
    SeedOpt,
    TempOpt,
    TopKOpt,
    TopPOpt,
    VerboseOpt,
    WidthOpt,
    defaults,
    resolve,
    tree_budget,
    user_errors,
)

HELP = """[bold]/reset[/bold] forget the conversation  [bold]/stats[/bold] session statistics
[bold]/help[/bold] this help  [bold]/quit[/bold] leave (or Ctrl-D)  Ctrl-C stops a reply"""


class Session:
    """The conversation, and the KV cache of what the model has already read."""

    def __init__(
        self,
        llm,
        tokenizer,
        drafter,
        W,
        L,
        sampling,
        max_tokens,
        system=None,
        budget=None,
        lookup=0,
        head_screen=True,
    ):
        from redrafter_mlx.beam_search import make_proposer
        from redrafter_mlx.llm import TreeLLM
        from redrafter_mlx.loading import compute_dtype

        self.model, self.tokenizer = llm, tokenizer
        self.tree_llm = TreeLLM(llm) if drafter is not None else None
        self.propose = (
            make_proposer(
                drafter,
                self.tree_llm.embed,
                W,
                L,
                with_scores=budget is not None,
                int8=True,
                dtype=compute_dtype(llm),
            )
            if drafter is not None
            else None
        )
        # One budget for the session: its calibration carries over from reply to reply.
        self.budget = budget if drafter is not None else None
        self.lookup, self.head_screen = lookup, head_screen
        self.sampling, self.max_tokens = sampling, max_tokens
        self.system = system
        self.context = int(getattr(llm.args, "max_position_embeddings", 0) or 0)
        self.totals = {"replies": 0, "tokens": 0, "steps": 0, "seconds": 0.0}
        self.last = None  # summary of the latest reply
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.cache, self.cached = None, []  # KV cache and the token ids it holds

    def prompt_ids(self) -> list[int]:
        return self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True)

    def reply(self, text: str):
        """Stream the reply to ``text`` as text pieces; ``self.last`` holds its summary."""
        from redrafter_mlx.generate import stream_autoregressive, stream_redrafter

        self.messages.append({"role": "user", "content": text})
        ids = self.prompt_ids()
        if self.context and len(ids) + self.max_tokens > self.context:
            self.messages.pop()
            raise ValueError(
                f"the conversation ({len(ids)} tokens) plus --max-tokens {self.max_tokens} "
                f"exceeds the model's context of {self.context}; /reset or lower --max-tokens"
            )
        stop = self.tokenizer.eos_token_ids
        if self.propose is None:
            stream = stream_autoregressive(
                self.model,
                ids,
                max_tokens=self.max_tokens,
                sampling=self.sampling,
                stop_tokens=stop,
            )
        else:
            new = self._reuse_cache(ids)
            stream = stream_redrafter(
                self.tree_llm,
                self.propose,
                new,
                max_tokens=self.max_tokens,
                sampling=self.sampling,
                stop_tokens=stop,
                cache=self.cache,
                budget=self.budget,
                lookup=self.lookup,
                history=ids[: len(ids) - len(new)],  # the earlier turns, for prompt lookup
                head_screen=self.head_screen,
            )
        detok = self.tokenizer.detokenizer
        detok.reset()
        answer: list[int] = []
        try:
            for out in stream:
                self.last = summary = out.summary
                answer += out.tokens
                for t in out.tokens:
                    detok.add_token(t)
                yield detok.last_segment
        except KeyboardInterrupt:
            self.cache, self.cached = None, []  # interrupted mid-step: rebuild it next turn
            detok.finalize()
            self.messages.append({"role": "assistant", "content": detok.text})
            raise
        detok.finalize()
        yield detok.last_segment
        self.messages.append({"role": "assistant", "content": detok.text})
        self.cached = ids + answer[:-1] if self.cache is not None else []
        self.totals["replies"] += 1
        self.totals["tokens"] += summary.generation_tokens
        self.totals["steps"] += summary.steps
        self.totals["seconds"] += summary.generation_time

    def _reuse_cache(self, ids: list[int]) -> list[int]:
        """Keep the cached prefix the new prompt shares; return the tokens still to feed."""
        keep = 0
        for a, b in zip(self.cached, ids, strict=False):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(ids) - 1)  # at least one new token to feed
        if self.cache is not None and all(c.start <= keep for c in self.cache):
            for c in self.cache:
                c.trim(c.length - keep)
            return ids[keep:]
        self.cache = self.tree_llm.make_cache()
        return ids


def chat(
    model: ModelOpt = None,
    drafter: DrafterOpt = None,
    max_tokens: MaxTokensOpt = 512,
    temp: TempOpt = 0.0,
    top_p: TopPOpt = 0.0,
    top_k: TopKOpt = 0,
    min_p: MinPOpt = 0.0,
    seed: SeedOpt = None,
    beam_width: WidthOpt = None,
    beam_length: LengthOpt = None,
    prune: PruneOpt = None,
    lookup: LookupOpt = 2,
    no_draft: NoDraftOpt = False,
    full_head: FullHeadOpt = False,
    system: Annotated[str | None, typer.Option("--system", help="A system prompt.")] = None,
    verbose: VerboseOpt = False,
) -> None:
    """Chat in the terminal; each reply streams, then one line of speed statistics."""
    console = Console(highlight=False)
    with user_errors(verbose):
        from redrafter_mlx import settings
        from redrafter_mlx.loading import load
        from redrafter_mlx.verification import SamplingParams

        import mlx.core as mx

        model_dir, drafter_dir, entry = resolve(model, drafter, no_draft)
        W, L = defaults(model_dir, drafter_dir, entry, beam_width, beam_length)
        with console.status(f"loading {model_dir.name}"):
            llm, tokenizer, draft_model = load(model_dir, drafter_dir, cast_drafter=False)
        if tokenizer.chat_template is None:
            raise ValueError(f"{model_dir} has no chat template; use `redrafter generate`")
        if seed is not None:
            mx.random.seed(seed)
        sampling = SamplingParams(temp=temp, top_p=top_p, min_p=min_p, top_k=top_k)
        budget = tree_budget(model_dir, drafter_dir, llm, draft_model, W, L, prune)
        session = Session(
            llm,
            tokenizer,
            draft_model,
            W,
            L,
            sampling,
            max_tokens,
            system,
            budget,
            lookup,
            head_screen=not full_head,
        )
        ar_rate = settings.get(model_dir, "ar_tokens_per_s")
        if ar_rate is None and not no_draft:
            ar_rate = calibrate(llm, tokenizer, console)
            settings.put(model_dir, "ar_tokens_per_s", ar_rate)
    mode = "plain decoding" if no_draft else f"ReDrafter W={W} L={L}"
    if budget is not None:
        mode += " pruned"
    if lookup and not no_draft:
        mode += f" · lookup {lookup}"
    console.print(f"[bold]{model_dir.name}[/bold] · {mode} · type /help for commands")
    while True:
        try:
            text = console.input("[bold green]>>> [/bold green]")
        except (EOFError, KeyboardInterrupt):
            console.print()
            return
        command = text.strip()
        if not command:
            continue
        if command in ("/quit", "/exit"):
            return
        if command == "/help":
            console.print(HELP)
            continue
        if command == "/reset":
            session.reset()
            console.print("[dim]conversation cleared[/dim]")
            continue
        if command == "/stats":
            t = session.totals
            rate = t["tokens"] / t["seconds"] if t["seconds"] else 0.0
            per_step = t["tokens"] / t["steps"] if t["steps"] else 0.0
            console.print(
                f"[dim]{t['replies']} replies, {t['tokens']} tokens, {rate:.1f} "
                f"tokens/s, {per_step:.2f} tokens/step[/dim]"
            )
            continue
        try:
            for piece in session.reply(text):
                console.print(piece, end="", markup=False, highlight=False, soft_wrap=True)
        except KeyboardInterrupt:
            console.print("\n[dim](stopped)[/dim]")
            continue
        except ValueError as e:
            console.print(f"[red]{e}[/red]")
            continue
        console.print()
        console.print(status_line(session.last, ar_rate, no_draft), style="dim")


def status_line(summary, ar_rate: float | None, no_draft: bool) -> str:
    line = (
        f"{summary.generation_tokens} tokens · {summary.generation_tps:.1f} tokens/s · "
        f"{summary.tokens_per_step:.2f} tokens/step"
    )
    if ar_rate and not no_draft and summary.generation_tps:
        line += f" · {summary.generation_tps / ar_rate:.2f}x vs AR ({ar_rate:.1f} tokens/s)"
    return line


def calibrate(llm, tokenizer, console) -> float:
    """Measure plain decoding once on this machine (cached afterwards)."""
    from redrafter_mlx.benchmark import consume
    from redrafter_mlx.generate import stream_autoregressive

    ids = tokenizer.encode("def fibonacci(n):\n")
    with console.status("measuring plain decoding speed once for the speedup figure"):
        run = consume("ar", 0, stream_autoregressive(llm, ids, max_tokens=24))
    return run.generation_tps
