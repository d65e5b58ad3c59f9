"""The generation loop shared by every backend: prompt ids in, streamed text and stats out.

A backend is anything with `prefill(ids) -> logits of the last position` and
`decode(token) -> logits`, plus `reset()`; the loop owns sampling, stop ids, streaming
detokenisation and timing, so the NumPy reference and the GPU engine are driven identically.
A backend that samples on the device (the GPU engine, every sampling setting) offers
`generate_ids(prompt_ids, n, params, stop_ids)` yielding ids; the loop then only streams and
times, and the penalty history is the backend's own (its cache's ids, kept on the device).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from nq.sample import Sampler, SamplingParams


@dataclasses.dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0          # prompt submitted → first generated token known on the host
    decode_s: float = 0.0        # first token → last token
    stop_reason: str = "length"  # "length" (-n), "eos", "stop" (a stop string), "context",
    #                              "interrupted" (Ctrl-C: see Interrupted)
    itl_ms: list = dataclasses.field(default_factory=list, repr=False)  # gaps between tokens

    @property
    def decode_tok_s(self) -> float:
        steps = self.generated_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s > 0 else 0.0

    def itl_percentile(self, q: float) -> float | None:
        """The q-th percentile (0..100) of the gaps between generated tokens, in ms."""
        return float(np.percentile(self.itl_ms, q)) if self.itl_ms else None

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        del d["itl_ms"]
        d["decode_tok_s"] = self.decode_tok_s
        d["prefill_tok_s"] = self.prefill_tok_s
        d["itl_ms"] = 1e3 / self.decode_tok_s if self.decode_tok_s else None
        d["itl_p50_ms"], d["itl_p90_ms"] = self.itl_percentile(50), self.itl_percentile(90)
        return d


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM, see nq.cli) during `generate`: a KeyboardInterrupt that carries the
    ids generated so far and their statistics (stop_reason "interrupted"), so the caller can
    still show them."""

    def __init__(self, ids: list[int], stats: GenerationStats):
        super().__init__()
        self.ids, self.stats = ids, stats


class StopStrings:
    """Streams text pieces through, holding back any tail that could be the start of a stop
    string (which can arrive split across tokens), and cuts the text at the first stop string:
    the stop string itself is never shown.

        stopper = StopStrings(["\\n\\n", "```"])
        shown, stopped = stopper.feed(piece)   # print `shown`; end generation if stopped
        shown = stopper.flush()                # at the end: what was held back
    """

    def __init__(self, stops):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def feed(self, piece: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self.held += piece
        hits = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.held, self.stopped = self.held[:min(hits)], "", True
            return out, True
        keep = 0
        for s in self.stops:  # the longest tail of held that is a proper prefix of a stop
            for n in range(min(len(s) - 1, len(self.held)), keep, -1):
                if self.held.endswith(s[:n]):
                    keep = n
                    break
        cut = len(self.held) - keep
        out, self.held = self.held[:cut], self.held[cut:]
        return out, False

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out


def _sampled_ids(backend, prompt_ids: list[int], n: int, sampler: Sampler,
                 stop_ids: frozenset[int], history: Sequence[int] = ()) -> Iterator[int]:
    """Host-side sampling over a backend's logits; `history`: the ids before prompt_ids."""
    history = list(history) + list(prompt_ids)
    logits = backend.prefill(np.asarray(prompt_ids, dtype=np.int64))
    for i in range(n):
        tok = sampler.sample(logits, history)
        history.append(tok)
        yield tok
        if tok in stop_ids or i == n - 1:
            return
        logits = backend.decode(tok)


def generate(backend, prompt_ids: list[int], n: int, params: SamplingParams,
             stop_ids: Iterable[int] = (), on_token: Callable[[int], None] | None = None,
             keep_context: bool = False, history: Sequence[int] = ()
             ) -> tuple[list[int], GenerationStats]:
    """Generate up to `n` tokens after `prompt_ids`; stop early on any id in `stop_ids`.

    `on_token` sees every generated id as soon as the host knows it (stop ids included, so the
    caller decides what to print); if it returns True, generation stops there (a stop string:
    stop_reason "stop").  With `keep_context` the backend's cache is kept and
    `prompt_ids` continue it (a chat turn); afterwards the cache holds the prompt and every
    generated id but the last.  `history` is what the kept cache holds before `prompt_ids`:
    the repeat penalty's window covers it, so a reused cache samples as a fresh prefill would.
    Returns the generated ids and the timing statistics.
    """
    if not prompt_ids:
        raise ValueError("empty prompt: give at least one token (-p TEXT or -f FILE)")
    stop = frozenset(int(s) for s in stop_ids)
    stats = GenerationStats(prompt_tokens=len(prompt_ids))
    if not keep_context:
        backend.reset()
    if n <= 0:
        return [], stats
    if hasattr(backend, "generate_ids"):  # its cache, hence `history`, is on the device
        source = backend.generate_ids(prompt_ids, n, params, stop)
    else:
        source = _sampled_ids(backend, prompt_ids, n, Sampler(params), stop, history)
    out: list[int] = []
    t0 = time.perf_counter()
    t_first = t_prev = None
    try:
        for tok in source:
            now = time.perf_counter()
            if t_first is None:
                t_first = now
                stats.ttft_s = t_first - t0
            else:
                stats.itl_ms.append(1e3 * (now - t_prev))
            t_prev = now
            out.append(tok)
            if on_token is not None and on_token(tok):
                stats.stop_reason = "stop"
                break
            if tok in stop:
                stats.stop_reason = "eos"
                break
    except KeyboardInterrupt:
        stats.stop_reason = "interrupted"
        if hasattr(source, "close"):
            source.close()       # a device generator books what its cache holds
        raise Interrupted(out, _finish(stats, out, t_first)) from None
    return out, _finish(stats, out, t_first)


def _finish(stats: GenerationStats, out: list[int], t_first: float | None) -> GenerationStats:
    stats.generated_tokens = len(out)
    stats.decode_s = time.perf_counter() - t_first if t_first is not None else 0.0
    return stats
