"""The sampler object: its workspaces, the step's launches, parameters and penalty history.

    s = make_sampler(cfg, valid_vocab, max_len=4096)
    s.set_params(pack_params(...), stream)       # any time between steps (64 bytes, no recapture)
    s.launch(logits, state, out_ids, stream)     # in the decode step, where argmax was
    s.reset(stream) / s.seed_history(ids) / s.append_history(ids_dev, start) / s.truncate_history(n)

`launch` allocates nothing and reads every parameter on the device, so it can be captured once.
The history methods copy a few bytes and launch two small kernels: call them outside capture,
between steps.  The history must mirror the KV cache's tokens; an engine keeps it so with:

    reset()                           -> s.reset(stream)
    batched prefill of positions [start, start + done) from its device prompt buffer
                                      -> s.append_history(prompt[:done], start, stream)
    truncate(n), and after generation books fewer tokens than the graph fed (the last
    step's token is read but not kept)  -> s.truncate_history(n, stream)
    decode steps (replays)            -> nothing: each step enters its own input token
"""
from __future__ import annotations

import numpy as np

from nq.kernels.common import need
from nq.kernels.sampler import kernels as K
from nq.kernels.sampler.params import PARAMS_LEN, P_WINDOW, pack_params

NB, THREADS, BITS = 128, 256, 11   # measured: see the package doc's table


class Sampler:
    """Workspaces (device, allocated here, once):

        params     (PARAMS_LEN,) int32   params.py's layout
        counts     (vocab,) int32        occurrences of each id in the penalty window
        ctx        (max_len,) int32      the context's tokens by position (mod max_len)
        pen        (vocab,) f32          penalised logits of the step (ids < valid_vocab)
        ctl        (CTL_LEN,) int64      pass plan, tickets, running totals, history length
        hist_cnt   (2^bits,) int32       a level's count histogram (zero between passes)
        hist_mass  (2^bits,) int64       a level's quantised-mass histogram (zero between)
        cand       (2^bits,) int64       compacted composite keys of the final pass
    """

    def __init__(self, vocab: int, valid_vocab: int, max_len: int = 4096, nb: int = NB,
                 threads: int = THREADS, bits: int = BITS):
        from numba import cuda

        self.vocab, self.valid, self.ring = int(vocab), int(valid_vocab), int(max_len)
        self.nb, self.threads, self.bits = int(nb), int(threads), int(bits)
        self.cap = 1 << self.bits
        self.smem = K.select_smem_bytes(self.bits)
        self.passes = K.n_select_passes(self.vocab, self.bits)
        self.penalize, self.select, self.history = K.compiled(
            self.vocab, self.valid, self.nb, self.threads, self.bits, self.ring)
        self._h_params = np.zeros(PARAMS_LEN, np.int32)
        self._h_params[:] = self.pack()
        self.params = cuda.to_device(self._h_params)
        self.counts = cuda.to_device(np.zeros(self.vocab, np.int32))
        self.ctx = cuda.to_device(np.full(self.ring, -1, np.int32))
        self.pen = cuda.device_array(self.vocab, np.float32)
        self.ctl = cuda.to_device(K.ctl_initial())
        self.hist_cnt = cuda.to_device(np.zeros(self.cap, np.int32))
        self.hist_mass = cuda.to_device(np.zeros(self.cap, np.int64))
        self.cand = cuda.to_device(np.zeros(self.cap, np.int64))
        self._checked = None

    def pack(self, **kw) -> np.ndarray:
        """pack_params with this sampler's vocabulary and capacities filled in."""
        return pack_params(valid_vocab=self.valid, max_top_k=self.cap, history_cap=self.ring,
                           **kw)

    # ---- the step ------------------------------------------------------------------------
    def launch(self, logits, state, out_ids, stream=0) -> None:
        """Sample one token from logits (vocab,) f32 into the decode state (module doc of
        nq/paged.py; the same effect as argmax's): 1 + `self.passes` kernels, no allocation."""
        key = (id(logits), id(state), id(out_ids))
        if key != self._checked:
            need(logits, "sampler logits", np.float32, (self.vocab,))
            if state.dtype != np.int32 or out_ids.dtype != np.int32 or len(out_ids.shape) != 1:
                raise ValueError("sampler: state and out_ids must be 1-d int32 device arrays")
            self._checked = key
        self.penalize[self.nb, self.threads, stream](logits, state, self.params, self.counts,
                                                     self.ctx, self.pen, self.ctl, self.hist_cnt)
        for _ in range(self.passes):
            self.select[self.nb, self.threads, stream, self.smem](self.pen, state, self.params, out_ids,
                                                       self.ctl, self.hist_cnt, self.hist_mass,
                                                       self.cand)

    # ---- parameters -------------------------------------------------------------------------
    def set_params(self, params, stream=0) -> None:
        """Upload a pack_params block; a new penalty window rebuilds the counts from the ring."""
        params = np.asarray(params, np.int32)
        if params.shape != (PARAMS_LEN,):
            raise ValueError(f"sampler params: expected int32 ({PARAMS_LEN},) from pack_params, "
                             f"got {params.dtype} {params.shape}")
        if params[P_WINDOW] > self.ring:
            raise ValueError(f"sampler: repeat_last_n {params[P_WINDOW]} exceeds the history "
                             f"ring of {self.ring} tokens")
        old_window = self._h_params[P_WINDOW]
        self._h_params[:] = params
        self.params.copy_to_device(self._h_params, stream=stream)
        if params[P_WINDOW] != old_window:
            self._rebuild(stream)

    # ---- history ----------------------------------------------------------------------------
    def reset(self, stream=0) -> None:
        """Forget the history and re-arm every ticket (a new conversation)."""
        self.ctl.copy_to_device(K.ctl_initial(), stream=stream)
        self.hist_cnt.copy_to_device(np.zeros(self.cap, np.int32), stream=stream)
        self.hist_mass.copy_to_device(np.zeros(self.cap, np.int64), stream=stream)
        self._rebuild(stream)

    def seed_history(self, ids, stream=0) -> None:
        """The context is exactly `ids` (positions 0..len-1): upload them, recount."""
        ids = np.ascontiguousarray(ids, np.int32).reshape(-1)
        if ids.size > self.ring:
            raise ValueError(f"sampler: {ids.size} history tokens exceed the ring of {self.ring}")
        if ids.size:
            self.ctx[: ids.size].copy_to_device(ids, stream=stream)
        self._set_length(ids.size, stream)

    def append_history(self, ids_dev, start: int, stream=0) -> None:
        """Tokens ids_dev (device int32) fill positions start.. of the context (a batched
        prefill that bypassed the decode step): device copy, recount."""
        n = int(ids_dev.shape[0])
        if start + n > self.ring:
            raise ValueError(f"sampler: history up to {start + n} exceeds the ring of {self.ring}")
        if n:
            self.ctx[start: start + n].copy_to_device(ids_dev, stream=stream)
        self._set_length(start + n, stream)

    def truncate_history(self, n: int, stream=0) -> None:
        """Keep positions < n (the engine's truncate)."""
        self._set_length(int(n), stream)

    def _set_length(self, n: int, stream) -> None:
        self.ctl[K.C_HIST_LEN: K.C_HIST_LEN + 1].copy_to_device(np.array([n], np.int64),
                                                                 stream=stream)
        self._rebuild(stream)

    def _rebuild(self, stream) -> None:
        for op in (0, 1):
            self.history[self.nb, self.threads, stream](self.counts, self.ctx, self.ctl,
                                                        self.params, op)

    # ---- inspection (tests) -------------------------------------------------------------------
    def history_length(self) -> int:
        return int(self.ctl.copy_to_host()[K.C_HIST_LEN])


def make_sampler(cfg, valid_vocab: int, max_len: int = 4096, params=None, **opts) -> Sampler:
    """The device sampler for a model config (cfg.vocab_size logits), ids < valid_vocab."""
    if not 0 < valid_vocab <= cfg.vocab_size:
        raise ValueError(f"valid_vocab {valid_vocab} must be in (0, {cfg.vocab_size}] "
                         "(the tokenizer's size; the logits are cfg.vocab_size long)")
    s = Sampler(cfg.vocab_size, valid_vocab, max_len, **opts)
    if params is not None:
        s.set_params(params)
    return s
