"""Multi-turn chat that keeps its KV cache: each turn prefills only what is new.

Each turn renders the whole conversation with the model's chat template, as transformers
would, and tokenises it.  The backend's cache already holds a prefix of those ids (everything
fed so far: earlier prompts and replies).  Only the tokens after the longest common prefix are
prefilled; when a reply re-tokenises differently from the ids that were generated (BPE is not
always canonical), the cache is truncated to the common prefix first, so the result is exactly
what a fresh prefill of the rendered conversation would give.

`nq chat` drives a ChatSession from stdin: one line is one user message; the commands are
listed in COMMANDS.  Ctrl-C during a reply stops that reply (what was generated is kept as
the assistant's turn); Ctrl-C at the prompt, /exit, /bye, /quit or end of input quits.
"""
from __future__ import annotations

import dataclasses
import sys

from nq.generate import GenerationStats, generate

COMMANDS = """commands:
  /set temp|top-k|top-p|min-p|repeat-penalty|presence-penalty|frequency-penalty|seed VALUE
            change a sampling control (on the GPU: 64 bytes to the device, no recapture)
  /stats    the last reply's statistics and the current sampling controls
  /reset    forget the conversation (the system message stays)
  /help     this text
  /exit, /bye, /quit    leave"""

# /set NAME -> (SamplingParams field, parser)
SETTABLE = {"temp": ("temperature", float), "temperature": ("temperature", float),
            "top-k": ("top_k", int), "top-p": ("top_p", float), "min-p": ("min_p", float),
            "repeat-penalty": ("repeat_penalty", float), "seed": ("seed", int),
            "presence-penalty": ("presence_penalty", float),
            "frequency-penalty": ("frequency_penalty", float)}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def parse_set(params, args: str):
    """`/set NAME VALUE` -> new params (SamplingParams checks the range); ValueError says why."""
    parts = args.split()
    if len(parts) != 2 or parts[0] not in SETTABLE:
        raise ValueError(f"usage: /set {{{'|'.join(k for k in SETTABLE if k != 'temperature')}}} VALUE")
    field, kind = SETTABLE[parts[0]]
    try:
        value = kind(parts[1])
    except ValueError:
        raise ValueError(f"/set {parts[0]}: {parts[1]!r} is not a{'n integer' if kind is int else ' number'}")
    if field == "seed" and value < 0:
        raise ValueError("/set seed: give a seed >= 0")
    return dataclasses.replace(params, **{field: value})


class ChatSession:
    def __init__(self, backend, tok, params, max_ctx: int, system: str | None = None,
                 stop_ids=None, context_shift: bool = False):
        self.backend, self.tok, self.params, self.max_ctx = backend, tok, params, max_ctx
        self.system = system
        self.context_shift = context_shift
        self.stop = tuple(tok.eos_ids if stop_ids is None else stop_ids)
        self.last_stats: GenerationStats | None = None
        self.reset()

    def reset(self) -> None:
        self.messages = [] if self.system is None else [{"role": "system", "content": self.system}]
        self.fed: list[int] = []  # the ids in the backend's cache, in order
        self.backend.reset()

    def _render(self, messages) -> list[int]:
        return self.tok.encode(self.tok.apply_chat_template(messages, add_generation_prompt=True))

    def turn(self, text: str, n: int, on_token=None) -> tuple[str, GenerationStats]:
        """Add a user message, generate the reply (up to n tokens; -1: until an end token or
        the context is full), remember it.  A KeyboardInterrupt during the reply ends it there:
        the part generated so far becomes the assistant's turn, and the cache stays consistent."""
        messages = self.messages + [{"role": "user", "content": text}]
        ids = self._render(messages)
        first = 1 if self.system is not None else 0  # the oldest turn droppable by a shift
        while (self.context_shift and len(ids) + max(n, 1) > self.max_ctx
               and len(messages) - first > 1):
            messages = messages[:first] + messages[first + 2:]  # the oldest user/assistant pair
            ids = self._render(messages)
        budget = self.max_ctx - len(ids)
        if budget < 1 or (n > 0 and n > budget):
            raise ValueError(f"the conversation ({len(ids)} tokens) + -n {n} exceeds the "
                             f"context -c {self.max_ctx}; /reset to start over, raise -c, or "
                             "start nq chat with --context-shift to drop the oldest turns")
        n = budget if n < 0 else n
        keep = min(common_prefix(self.fed, ids), len(ids) - 1)  # >= 1 new token gives logits
        if keep < len(self.fed):
            self.backend.truncate(keep)
        new = ids[keep:]
        out: list[int] = []

        def collect(t: int):
            out.append(t)
            if on_token is not None:
                on_token(t)
        try:
            _, stats = generate(self.backend, new, n, self.params, self.stop, collect,
                                keep_context=True, history=ids[:keep])
        except KeyboardInterrupt:
            stats = GenerationStats(prompt_tokens=len(new), generated_tokens=len(out),
                                    stop_reason="interrupted")
            fed = keep + (len(new) + len(out) - 1 if out else 0)
            self.backend.truncate(fed)  # whatever was in flight is not part of the context
            if not out:
                self.fed = ids[:keep]
                raise
        self.fed = ids[:keep] + new + out[:-1]  # the last generated id is not fed yet
        reply = self.tok.decode([t for t in out if t not in self.stop])
        self.messages = messages + [{"role": "assistant", "content": reply}]
        self.last_stats = stats
        return reply, stats


def repl(session: ChatSession, n: int, out=sys.stdout, inp=sys.stdin, err=sys.stderr) -> int:
    """Read user lines from inp, stream replies to out, statistics and messages to err."""
    while True:
        if inp.isatty():
            err.write("> ")
            err.flush()
        try:
            line = inp.readline()
        except KeyboardInterrupt:
            err.write("\n")
            return 0
        if not line:
            return 0
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if text.startswith("/"):
            cmd, _, rest = text.strip().partition(" ")
            if cmd in ("/exit", "/bye", "/quit"):
                return 0
            if cmd == "/reset":
                session.reset()
                err.write("nq: context cleared\n")
            elif cmd == "/help":
                err.write(COMMANDS + "\n")
            elif cmd == "/set":
                try:
                    session.params = parse_set(session.params, rest)
                    err.write(f"nq: {rest.split()[0]} = {rest.split()[1]}\n")
                except ValueError as e:
                    err.write(f"nq: {e}\n")
            elif cmd == "/stats":
                p = session.params
                err.write(f"nq: temp {p.temperature}, top-k {p.top_k}, top-p {p.top_p}, min-p "
                          f"{p.min_p}, repeat-penalty {p.repeat_penalty}, seed {p.seed}; context "
                          f"{len(session.fed)} of {session.max_ctx} tokens\n")
                s = session.last_stats
                if s is not None:
                    err.write(f"nq: last reply: {s.prompt_tokens} new prompt tokens, "
                              f"{s.generated_tokens} generated ({s.stop_reason}); TTFT "
                              f"{s.ttft_s * 1e3:.1f} ms, {s.decode_tok_s:.2f} tok/s\n")
            else:
                err.write(f"nq: unknown command {cmd}; /help lists them (a message that starts "
                          "with / needs a leading space)\n")
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
        except KeyboardInterrupt:  # before the first token: nothing to keep
            err.write("\nnq: reply stopped\n")
            continue
        out.write("\n")
        out.flush()
        if stats.stop_reason == "interrupted":
            err.write("nq: reply stopped\n")
        err.write(f"nq: {stats.prompt_tokens} new prompt tokens (context "
                  f"{len(session.fed) + 1}), {stats.generated_tokens} generated; "
                  f"TTFT {stats.ttft_s * 1e3:.1f} ms, {stats.decode_tok_s:.2f} tok/s\n")
