"""Multi-turn chat that keeps its KV cache: each turn prefills only what is new.

Each turn renders the whole conversation with the model's chat template, as transformers
would, and tokenises it.  The backend's cache already holds a prefix of those ids (everything
fed so far: earlier prompts and replies).  Only the tokens after the longest common prefix are
prefilled; when a reply re-tokenises differently from the ids that were generated (BPE is not
always canonical), the cache is truncated to the common prefix first, so the result is exactly
what a fresh prefill of the rendered conversation would give.

`nq chat` drives a ChatSession from stdin: one line is one user message; `/reset` starts
over, `/exit` (or end of input) quits.
"""
from __future__ import annotations

import sys

from nq.generate import GenerationStats, generate


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ChatSession:
    def __init__(self, backend, tok, params, max_ctx: int, system: str | None = None,
                 stop_ids=None):
        self.backend, self.tok, self.params, self.max_ctx = backend, tok, params, max_ctx
        self.system = system
        self.stop = tuple(tok.eos_ids if stop_ids is None else stop_ids)
        self.reset()

    def reset(self) -> None:
        self.messages = [] if self.system is None else [{"role": "system", "content": self.system}]
        self.fed: list[int] = []  # the ids in the backend's cache, in order
        self.backend.reset()

    def turn(self, text: str, n: int, on_token=None) -> tuple[str, GenerationStats]:
        """Add a user message, generate the reply (up to n tokens), remember it."""
        messages = self.messages + [{"role": "user", "content": text}]
        ids = self.tok.encode(self.tok.apply_chat_template(messages, add_generation_prompt=True))
        if len(ids) + n > self.max_ctx:
            raise ValueError(f"the conversation ({len(ids)} tokens) + -n {n} exceeds the "
                             f"context -c {self.max_ctx}; /reset to start over or raise -c")
        keep = min(common_prefix(self.fed, ids), len(ids) - 1)  # >= 1 new token gives logits
        if keep < len(self.fed):
            self.backend.truncate(keep)
        new = ids[keep:]
        out, stats = generate(self.backend, new, n, self.params, self.stop, on_token,
                              keep_context=True)
        self.fed = ids[:keep] + new + out[:-1]  # the last generated id is not fed yet
        reply = self.tok.decode([t for t in out if t not in self.stop])
        self.messages = messages + [{"role": "assistant", "content": reply}]
        return reply, stats


def repl(session: ChatSession, n: int, out=sys.stdout, inp=sys.stdin, err=sys.stderr) -> int:
    """Read user lines from inp, stream replies to out, statistics to err."""
    while True:
        if inp.isatty():
            err.write("> ")
            err.flush()
        line = inp.readline()
        if not line or line.strip() == "/exit":
            return 0
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            session.reset()
            err.write("nq: context cleared\n")
            continue
        if not text.strip():
            continue
        stream = session.tok.stream()

        def show(t: int):
            piece = stream.step(t)
            if piece and t not in session.stop:
                out.write(piece)
                out.flush()

        try:
            _, stats = session.turn(text, n, on_token=show)
        except ValueError as e:  # the context is full: say so and keep the session
            err.write(f"nq: {e}\n")
            continue
        out.write("\n")
        out.flush()
        err.write(f"nq: {stats.prompt_tokens} new prompt tokens (context "
                  f"{len(session.fed) + 1}), {stats.generated_tokens} generated; "
                  f"TTFT {stats.ttft_s * 1e3:.1f} ms, {stats.decode_tok_s:.2f} tok/s\n")
