"""Sampled decode on the device: the engine's second step graph, with the device sampler
(nq/kernels/sampler) where the greedy graph has argmax, and the bookkeeping that keeps the
sampler's penalty history equal to the KV cache's tokens.

Why a second graph and not one graph with the sampler in it: greedy keeps its argmax graph
bit for bit (argmax 4.8 us a token against 25.7 us for greedy through the sampler, measured
by scripts/bench_sampler.py on 2026-12-01, and the default decode PTX unchanged); both graphs
are captured from the same step list and read the same buffers (state, out_ids, the KV
pages), so switching between them per request is a choice of which one to launch, never a
recapture.  The sampler and its graph are built by `Engine.prepare_sampler()` (at start for
`nq generate` with sampled settings, `nq chat` and `nq serve`) or at the first sampled
request, so a greedy-only run pays nothing for them.

Parameters live in the sampler's device block (64 bytes, uploaded when they change), so
`/set temp` in chat or a new request in `nq serve` needs no recapture.

The penalty history (the sampler's ctx ring and count table) must hold exactly the tokens of
the cache.  The invariant kept here: the device history's length is `hist_n`, and its positions
[0, hist_n) equal the engine's host mirror of the cache ids (`Engine._ids`), every one of
which the host knows (prompt ids it uploaded, generated ids it read).  Then:

    reset()                  -> sampler.reset(), hist_n = 0
    truncate(n)              -> sampler.truncate_history(n) when hist_n > n
    a sampled prompt         -> catch up to the cache (upload of the ids a greedy turn added),
                                then the prompt's ids from the engine's device prompt buffer
    sampled decode steps     -> each step enters its own input token (the kernel does it)
    after generation         -> the graph ran one step past what the cache books (the last
                                read token is not kept): truncate_history(booked)

so a truncated or reset engine's counts equal a fresh engine's fed the same ids.
"""
from __future__ import annotations

import numpy as np


def needs_device_sampler(params) -> bool:
    """False only for plain greedy (temperature 0, no penalty): that keeps the argmax graph."""
    return bool(params.temperature > 0 or params.repeat_penalty != 1.0
                or getattr(params, "presence_penalty", 0.0)
                or getattr(params, "frequency_penalty", 0.0))


def pack_sampling(params, pack, max_len: int) -> np.ndarray:
    """nq.sample.SamplingParams -> the sampler's parameter block, through `pack` (a Sampler's
    pack_params with its vocabulary and capacities).  A seed of None draws a fresh 64-bit key
    from the OS, as the host sampler does; top_k <= 0 is off; a repeat window longer than the
    context is the whole context (the cache never holds more than max_len tokens)."""
    import secrets
    seed = secrets.randbits(64) if params.seed is None else int(params.seed) % 2**64
    window = int(params.repeat_last_n)
    if window > max_len:
        window = -1
    if params.repeat_penalty == 1.0 and not (getattr(params, "presence_penalty", 0.0)
                                            or getattr(params, "frequency_penalty", 0.0)):
        window = 0  # no penalty: the count table is never read, so keep no history
    return pack(temperature=float(params.temperature), top_k=max(int(params.top_k), 0),
                top_p=min(float(params.top_p), 1.0), min_p=float(params.min_p),
                repeat_penalty=float(params.repeat_penalty), repeat_last_n=window,
                presence_penalty=float(getattr(params, "presence_penalty", 0.0)),
                frequency_penalty=float(getattr(params, "frequency_penalty", 0.0)), seed=seed)


class DeviceSampling:
    """The sampler of one engine, its sampled step graph, and the history invariant above.

    `sampler` may be given (tests pass a host fake); by default the device sampler is built
    for the engine's config, tokenizer size (`eng.valid_vocab`) and context (`eng.max_len`).
    """

    def __init__(self, eng, sampler=None):
        self.eng = eng
        if sampler is None:
            from nq.kernels.sampler import make_sampler
            sampler = make_sampler(eng.cfg, eng.valid_vocab, max_len=eng.max_len)
        self.sampler = sampler
        self.hist_n = 0           # the device history's length; == the host mirror below it
        self.graph = None
        self._graph_key = None
        self._params = None       # the block last uploaded
        self._warm = False

    # ---- the step -----------------------------------------------------------------------------
    def steps(self) -> list:
        """The engine's step with the sampler in place of argmax (its last step)."""
        eng, s = self.eng, self.sampler
        body = eng.steps[:-1]
        if not body or eng.steps[-1][0] != "sample":
            raise RuntimeError("engine step list must end with its 'sample' step")
        return body + [("sample", lambda st: s.launch(eng.logits, eng.state, eng.out_ids, st))]

    def run_eager(self) -> None:
        for _, launch in self.steps():
            launch(self.eng.stream)

    def step(self) -> None:
        """Enqueue one sampled decode step: the sampled graph when the engine has graphs
        (captured again only if the engine's step list or PDL setting changed), else eager."""
        eng = self.eng
        if eng.graph is None:
            self.run_eager()
            return
        key = (eng.steps, eng.pdl)
        if self.graph is None or self._graph_key[0] is not key[0] or self._graph_key[1] != key[1]:
            self.capture()
        self.graph.replay()

    def warm_up(self) -> None:
        """Launch the sampler's kernels once before any capture (compilation or a first launch
        inside a capture invalidates it), on a scratch state whose position is past any
        history length (<= max_len), so the history is untouched; a whole step leaves the
        sampler's tickets re-armed."""
        if self._warm:
            return
        from numba import cuda

        from nq.paged import STATE_LEN, STATE_POS
        st = np.zeros(STATE_LEN, np.int32)
        st[STATE_POS] = self.eng.max_len + 1
        scratch = cuda.to_device(st, stream=self.eng.stream)
        out = cuda.device_array(1, np.int32)
        self.sampler.launch(self.eng.logits, scratch, out, self.eng.stream)
        self.eng.stream.synchronize()
        self._warm = True

    def capture(self) -> None:
        from nq.runtime.graphs import CapturedGraph
        eng = self.eng
        self.warm_up()
        eng.stream.synchronize()
        self.graph = CapturedGraph(eng.stream, self.run_eager, name="decode-sampled",
                                   programmatic=eng.pdl)
        self._graph_key = (eng.steps, eng.pdl)

    # ---- parameters ---------------------------------------------------------------------------
    def set_params(self, params) -> None:
        """Upload the block for nq.sample.SamplingParams (only when it changed)."""
        block = pack_sampling(params, self.sampler.pack, self.eng.max_len)
        if self._params is None or not np.array_equal(block, self._params):
            self.sampler.set_params(block, self.eng.stream)
            self._params = block

    # ---- history ------------------------------------------------------------------------------
    def reset(self) -> None:
        self.sampler.reset(self.eng.stream)
        self.hist_n = 0

    def truncate(self, n: int) -> None:
        if self.hist_n > n:
            self.sampler.truncate_history(n, self.eng.stream)
            self.hist_n = n

    def catch_up(self, n: int) -> None:
        """Make the device history the cache's first n ids (host mirror `eng._ids`)."""
        if self.hist_n > n:
            self.truncate(n)
        elif self.hist_n < n:
            ids = np.ascontiguousarray(self.eng._ids[self.hist_n:n])
            self.sampler.append_history(ids, self.hist_n, self.eng.stream)
            self.hist_n = n

    def append_prompt(self, start: int, n: int) -> None:
        """The prompt's n ids, already in the engine's device prompt buffer, fill positions
        [start, start + n): a device copy, so the step at the last prompt token finds its
        position already entered and enters nothing."""
        self.catch_up(start)
        self.sampler.append_history(self.eng.prompt[:n], start, self.eng.stream)
        self.hist_n = start + n

    def entered(self, n: int) -> None:
        """The sampled steps since append_prompt ran to a history of n tokens; the host knows
        (is about to book) only what the cache keeps: `truncate` brings it back."""
        self.hist_n = n
