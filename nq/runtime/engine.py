"""The GPU engine: weights on the device, KV pages, and decode as one captured CUDA graph.

One decode step (this file never holds a kernel body; nq/kernels does):

    feed       state.token = prompt[pos - start] while inside the prompt (prefill = replays)
    embed      x = emb[state.token]                                   x: (hidden,) fp32
    per layer  qkv  = rmsnorm(x) @ Wqkv + b                           fused in the GEMV
               q, KV page[pos] = rope(qkv)                            in its epilogue (qkv_rope;
                                                                      step.FUSE_ROPE=False: rope_kv)
               partials = paged_attention(q, pages[0..pos])           attn_split (the splits)
               xacc += merge(partials) @ Wo                           attn_o_proj: a block a
                                                                      head, int64 sums (step.
                                                                      FUSE_O=0: attn_combine,
                                                                      then the o_proj GEMV)
               a    = silu(rmsnorm(x') @ Wg) * (rmsnorm(x') @ Wu)     fused GEMV, x' = x + xacc
               x    = x' + a @ Wd;  xacc = 0                          GEMV, residual epilogue
    lm_head    logits = rmsnorm(x) @ Wlm                              fp16 GEMV
    argmax     state.token = argmax(logits); out_ids[step] = token; pos += 1; step += 1
               (any other sampling: the device sampler in its place, in a second graph
               captured from the same steps: nq/runtime/sampling.py)

A prompt of two tokens or more goes through the batched prefill instead (nq/runtime/prefill.py),
all of it; the last token's residual row then takes only the step's tail, lm_head and argmax
(or the sampler), launched eagerly: `_head`.

Everything that changes per step lives in device memory (`state`, the block table), so the
step is captured once and replayed.  One graph serves every position: the kernels read `pos`
on the device and pages are reserved ahead, so nothing differs at a page boundary
(docs/KERNELS.md says why the seed's two graphs are not needed here).
"""
from __future__ import annotations

import time

import numpy as np

from nq.config import ModelConfig
from nq.runtime.graphs import CapturedGraph
from nq.paged import STATE_LEN, STATE_POS, STATE_STEP, STATE_TOKEN, pages_for, pool_shape
from nq.runtime.kv_cache import KVCacheFull, PageAllocator, Sequence, release, reserve


def memset_zero(arr, stream) -> None:
    """Zero a numba device array asynchronously (no host buffer of its size)."""
    from numba.core import config
    if config.ENABLE_CUDASIM:  # the simulator's arrays are host arrays
        arr.copy_to_device(np.zeros(arr.shape, arr.dtype))
        return
    from cuda.bindings import driver as cu
    from nq.runtime.graphs import _check, stream_handle
    ptr = arr.__cuda_array_interface__["data"][0]
    _check(cu.cuMemsetD8Async(ptr, 0, arr.nbytes, stream_handle(stream)))


class Engine:
    """Batch-1 decode of one sequence on the GPU (the `--backend gpu` of `nq generate`).

    Backend interface of nq/generate.py: `reset()`, `prefill(ids) -> logits`,
    `decode(token) -> logits` (host sampling), and `generate_ids(...)` (every sampling
    setting on the device, the host reading each token one step late).  valid_vocab: the
    tokenizer's size; the sampler never draws the padded lm_head rows at or above it.
    """

    def __init__(self, cfg: ModelConfig, weights, max_len: int = 4096, use_graph: bool = True,
                 pdl: bool = True, prefill: str = "batched", prefill_chunk: int | None = None,
                 valid_vocab: int | None = None):
        from numba import cuda

        from nq.kernels import attention, rope_kv
        from nq.runtime.memory import check_device_memory
        from nq.runtime.prefill import DEFAULT_CHUNK

        # refuse a context that cannot fit before allocating any of it (bytes needed and free)
        check_device_memory(cfg, int(max_len), (prefill_chunk or DEFAULT_CHUNK)
                            if prefill == "batched" else 0, weights=False)
        self.cfg, self.w, self.max_len = cfg, weights, int(max_len)
        self.valid_vocab = int(valid_vocab or cfg.vocab_size)
        if not 0 < self.valid_vocab <= cfg.vocab_size:
            raise ValueError(f"valid_vocab {valid_vocab} must be in (0, {cfg.vocab_size}]: the "
                             "tokenizer's size, at most the model's lm_head rows")
        # the ids of the cache by position, as the host knows them (-1: not known, e.g. a
        # benchmark's steps); the sampler's penalty history is rebuilt from it when it lags
        self._ids = np.full(self.max_len, -1, np.int32)
        self.sampling = None  # nq/runtime/sampling.DeviceSampling, made on first use
        self.startup: dict[str, float] = getattr(weights, "startup", {}).copy()
        self.stream = cuda.stream()
        s = self.stream
        c = cfg
        # ---- decode state and scratch: allocated once; graphs keep pointing at them -------
        self.n_pages = pages_for(self.max_len) + 1
        self.alloc = PageAllocator(self.n_pages)
        self.seq = Sequence(max_pages=pages_for(self.max_len))
        self.kv = cuda.device_array(pool_shape(c, self.n_pages), np.float16)  # (L, pages, Hkv, 2, 16, D)
        memset_zero(self.kv, s)  # never-written slots must not hold NaN bit patterns
        self.d_table = cuda.to_device(self.seq.table, stream=s)              # (max_pages,) int32
        self.state = cuda.to_device(np.zeros(STATE_LEN, np.int32), stream=s)  # kv_cache.py layout
        self.out_ids = cuda.device_array(self.max_len, np.int32)              # ring, by step
        self.prompt = cuda.device_array(self.max_len, np.int32)               # (max_len,) ids
        self.feed_meta = cuda.to_device(np.zeros(2, np.int32), stream=s)      # [start, length]
        self.x = cuda.device_array(c.hidden_size, np.float32)                 # residual stream
        self.qkv = cuda.device_array(c.qkv_size, np.float32)
        self.q = cuda.device_array(c.q_size, np.float32)                      # rotated q
        self.o = cuda.device_array(c.q_size, np.float16)                      # attention output
        self.a = cuda.device_array(c.intermediate_size, np.float16)           # SwiGLU output
        self.logits = cuda.device_array(c.vocab_size, np.float32)
        self.inv_freq = cuda.to_device(rope_kv.rope_inv_freq(c.head_dim, c.rope_theta), stream=s)
        self.part_acc, self.part_ml = attention.decode_workspace(c)
        self._h_state = cuda.pinned_array(STATE_LEN, np.int32)
        self._h_tok = cuda.pinned_array(2, np.int32)
        # what the start is made of (`nq generate --verbose`): seconds by part, each a lap of
        # nq/timeline.py (the time since the previous lap, so the parts add up)
        lap = self._lap
        lap("KV cache + decode buffers")
        # prefill: "batched" (nq/runtime/prefill.py: the prompt as matrices on the tensor
        # cores) or "replay" (one decode step a prompt token: the reference path for tests).
        # Built before the warm-up, so that its kernels load while the weights upload.
        if prefill not in ("batched", "replay"):
            raise ValueError(f"prefill={prefill!r}: choose 'batched' or 'replay'")
        self.prefiller = None
        from nq.kernels.build import parallel_compiles
        with parallel_compiles():  # kernels not in the cache: compiled at once, in processes
            self.steps = self._build_steps()  # compiles (or loads from the cache) each kernel
            lap("step kernels")
            if prefill == "batched":
                from nq.runtime.prefill import DEFAULT_CHUNK, Prefill
                self.prefiller = Prefill(self, prefill_chunk or DEFAULT_CHUNK)
                lap("prefill kernels + workspace")
        lap("kernels compiled in parallel")
        self.w.wait()  # Engine.from_file's upload thread: the warm-up reads the weights
        lap("weights upload (waiting for it)")
        self.graph = None
        self.pdl = pdl
        if use_graph:
            self.run_eager()  # warm every kernel up before capture (DEVICE.md)
            self.stream.synchronize()
            lap("warm-up")
            self.capture(pdl)
            lap("graph capture")
        self.reset()

    def _lap(self, name: str) -> None:
        from nq.timeline import TIMELINE
        self.startup[name] = TIMELINE.lap(name)

    def _build_steps(self, tilings=None, attn=None, check_layout: bool = True,
                     fuse_rope: bool | None = None) -> list:
        """(region, launch) in step order (nq/runtime/step.py); tilings / attn: see `variant`."""
        from nq.runtime.step import build_steps
        return build_steps(self, tilings, attn, check_layout, fuse_rope)

    def variant(self, tilings=None, attn=None, check_layout: bool = True,
                fuse_rope: bool | None = None) -> None:
        """Experiments (scripts/step_variants.py): rebuild the step with other GEMV tilings
        ({kind: Tiling or MmaTiling}; each must keep the uploaded weights' layout: `layout()`)
        and attention launcher options (attention.decode_launcher keywords), warm it up and recapture.
        The decode state is kept; `variant()` restores the defaults.  check_layout=False
        allows another layout (timing random weights only: the outputs are then wrong)."""
        self.steps = self._build_steps(tilings, attn, check_layout, fuse_rope)
        self.run_eager()
        self.stream.synchronize()
        if self.graph is not None:
            self.capture(self.pdl)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_file(cls, nf, max_len: int = 4096, **kw) -> "Engine":
        from nq.runtime import preload
        from nq.runtime.memory import check_device_memory
        from nq.runtime.prefill import DEFAULT_CHUNK
        from nq.runtime.weights import upload
        pre = preload.take(nf)   # `nq generate`: the weights' copy began before numba's import
        check_device_memory(nf.config, int(max_len), kw.get("prefill_chunk") or DEFAULT_CHUNK,
                            weights=True, held=pre.nbytes if pre is not None else 0,
                            lm_head=nf.lm_head)
        # copies (or only the re-tiling, when preloaded) on a thread while the engine loads kernels
        w = upload(nf, background=True, preloaded=pre)
        return cls(nf.config, w, max_len=max_len, **kw)

    @classmethod
    def random(cls, cfg: ModelConfig, max_len: int = 4096, seed: int = 0, lm_head: str = "fp16",
               **kw) -> "Engine":
        """Random weights of cfg's shape made on the GPU (benchmarks: no download, no host copy).
        lm_head: as `nq pack --lm-head` stores it; "fp16" here, so that the step studies
        (scripts/step_variants.py) keep the head they were measured with, where `nq bench
        --random` takes pack's default."""
        from nq.runtime.weights import random_device_weights
        return cls(cfg, random_device_weights(cfg, seed, lm_head=lm_head), max_len=max_len, **kw)

    def capture(self, pdl: bool = True, full_into: tuple[str, ...] = ()) -> None:
        """(Re)capture the step graph; with pdl its kernel edges are programmatic (each kernel's
        weight prefetch overlaps the previous kernel's tail: nq/runtime/graphs.py, nq/ptx/griddep.py)
        but those into kernels whose names contain one of `full_into` (a diagnostic)."""
        self.stream.synchronize()
        self.pdl = pdl
        self.graph = CapturedGraph(self.stream, self.run_eager, name="decode", programmatic=pdl,
                                   full_into=full_into)

    # ---- one step -----------------------------------------------------------------------------
    def run_eager(self, regions=None) -> None:
        """Launch one step's kernels (only those of `regions`, if given) without a graph."""
        for region, launch in self.steps:
            if regions is None or region in regions:
                launch(self.stream)

    @property
    def regions(self) -> list[str]:
        """The step's regions in order (RMSNorm is fused into the qkv, gate_up and lm_head
        GEMVs, so it has no region of its own)."""
        return list(dict.fromkeys(r for r, _ in self.steps))

    def step(self, sampled: bool = False) -> None:
        """Enqueue one decode step (graph replay, or eager launches without a graph);
        sampled: the device sampler's step (prepare_sampler and set_sampling first)."""
        if sampled:
            self.sampling.step()
        elif self.graph is not None:
            self.graph.replay()
        else:
            self.run_eager()

    # ---- state --------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        """Tokens in the KV cache (host view; valid after a synchronize)."""
        return self._pos

    def truncate(self, n: int) -> None:
        """Keep the first n cached tokens (a chat turn that re-tokenised differently): later
        positions stay reserved and are overwritten by the next prefill."""
        self.stream.synchronize()
        self._pos = min(int(n), self._pos)
        if self.sampling is not None:
            self.sampling.truncate(self._pos)

    def reset(self) -> None:
        self.stream.synchronize()
        release(self.alloc, self.seq)
        self._pos = 0
        if self.sampling is not None:
            self.sampling.reset()
        self._write_state(token=0, pos=0, step=0)
        # no prompt: `feed` must not put an old prompt's token over a decode(token)
        self.feed_meta.copy_to_device(np.zeros(2, np.int32), stream=self.stream)

    # ---- saved sequences (nq serve --cache-slots; nq/runtime/kv_snapshot.py) -------------------
    def keep_snapshots(self, n: int) -> int:
        """Allow n host copies of the sequence at once; returns the bytes they may pin."""
        from nq.runtime.kv_snapshot import HostBuffers
        self._snapshots = HostBuffers(pool_shape(self.cfg, self.seq.max_pages), limit=n)
        return n * self._snapshots.buffer_bytes

    def snapshot(self):
        """Enqueue a host copy of the sequence (its pages and length), for `restore`."""
        from nq.runtime.kv_snapshot import HostBuffers, save
        if getattr(self, "_snapshots", None) is None:
            self._snapshots = HostBuffers(pool_shape(self.cfg, self.seq.max_pages))
        snap = save(self.kv, self.seq.pages, self._pos, self._snapshots, self.stream)
        snap.ids = self._ids[: self._pos].copy()  # the sampler's penalty history is rebuilt from it
        return snap

    def restore(self, snap) -> None:
        """Make the cache hold a snapshot's sequence again (any page ids: the copy follows the
        block table); the snapshot stays valid."""
        from nq.runtime.kv_snapshot import load
        self.reset()
        self._reserve(max(snap.length, 1))
        load(snap, self.kv, self.seq.pages, self.stream)
        self._pos = snap.length
        # reset() emptied the sampler's device history; the next sampled step catches it up
        # from the host mirror, which must hold this sequence's ids again
        self._ids[: snap.length] = -1 if snap.ids is None else snap.ids
        self._ids[snap.length:] = -1

    def discard(self, snap) -> None:
        """The snapshot will not be restored again: its host buffer is reused."""
        self._snapshots.give(snap.host)

    def _write_state(self, token: int, pos: int, step: int) -> None:
        h = self._h_state
        h[:] = 0
        h[STATE_TOKEN], h[STATE_POS], h[STATE_STEP] = token, pos, step
        self.state.copy_to_device(h, stream=self.stream)

    def _reserve(self, n_tokens: int) -> None:
        if n_tokens > self.max_len:
            raise KVCacheFull(f"context of {n_tokens} tokens exceeds this engine's {self.max_len}; "
                              "raise -c")
        reserve(self.alloc, self.seq, n_tokens)
        if self.seq.dirty:
            self.d_table.copy_to_device(self.seq.table, stream=self.stream)
            self.seq.dirty = False

    def _start_prompt(self, ids, batched: bool = True, sampled: bool = False) -> tuple[int, int]:
        """Upload ids as the tokens following the cache and, when this engine has a batched
        prefill, `batched` and there are two tokens or more, enqueue the prefill of all of them
        and the copy of the last one's residual row into `x`.  The state written here is the
        one the decode step of the next token to run sees: prompt token 0 for the replays, the
        last for `_head`, which then takes that token's step (the same token, position, step
        number and penalty history).  sampled: the sampler's penalty history takes the prompt
        too.  Returns (tokens, tokens prefilled): 0 (one replay a token) or all of them."""
        ids = np.asarray(ids, np.int32).reshape(-1)
        if ids.size == 0:
            raise ValueError("prefill: no tokens")
        start = self._pos
        self._reserve(start + ids.size)
        self.stream.synchronize()  # the pinned/host buffers below are reused
        self.prompt[: ids.size].copy_to_device(ids, stream=self.stream)
        self._ids[start: start + ids.size] = ids
        if sampled:
            self.sampling.append_prompt(start, int(ids.size))
        self.feed_meta.copy_to_device(np.array([start, ids.size], np.int32), stream=self.stream)
        n, done = int(ids.size), 0
        pre = self.prefiller
        if batched and pre is not None and n > 1:
            done = n
            pre.run(0, start, n, self.stream)
            # the row the decode step's layers would leave in x for the last token
            self.x.copy_to_device(pre.x[pre.last_row(n)], stream=self.stream)
        # the step of prompt token k runs next (a replay: feed puts prompt[k] in state.token;
        # or the head of the last), out_ids by step
        k = min(done, n - 1)
        self._write_state(token=int(ids[k]), pos=start + k, step=k)
        return n, done

    def _head(self, sampled: bool = False) -> None:
        """Enqueue the decode step's tail alone -- lm_head, then argmax (sampled: the device
        sampler) -- on the `x` a batched prefill left: the last prompt token's step without its
        layers, whose work the prefill did.  Eager launches, queued behind the prefill's."""
        for region, launch in self.steps:
            if region == "lm_head":
                launch(self.stream)
        _, sample = self.sampling.steps()[-1] if sampled else self.steps[-1]
        sample(self.stream)

    # ---- host-sampled interface ---------------------------------------------------------------
    def prefill(self, ids) -> np.ndarray:
        """Append ids to the context; logits (vocab,) fp32 of the last (the batched prefill and
        lm_head on its last row; one decode step a token without a prefiller or for one token)."""
        n, done = self._start_prompt(ids)
        if done == n:
            self._head()
        for _ in range(n - done):
            self.step()
        self._pos += n
        return self.logits.copy_to_host(stream=self.stream)

    def decode(self, token: int) -> np.ndarray:
        """Append one token -> logits (vocab,) fp32."""
        self._reserve(self._pos + 1)
        self._ids[self._pos] = int(token)
        self._write_state(token=int(token), pos=self._pos, step=0)
        self.step()
        self._pos += 1
        return self.logits.copy_to_host(stream=self.stream)

    # ---- generation on the device --------------------------------------------------------------
    def prepare_sampler(self):
        """Build the device sampler, its kernels and its graph now (otherwise the first
        sampled request does, inside its TTFT).  Capturing executes nothing, so this is safe
        at any point between steps."""
        if self.sampling is None:
            from nq.runtime.sampling import DeviceSampling
            t = time.perf_counter()
            self.sampling = DeviceSampling(self)
            self.startup["sampler kernels_s"] = time.perf_counter() - t
            if self.graph is not None:
                t = time.perf_counter()
                self.sampling.capture()
                self.startup["sampled graph capture_s"] = time.perf_counter() - t
        return self.sampling

    def set_sampling(self, params) -> None:
        """Sampled steps from here use `params` (nq.sample.SamplingParams; 64 bytes uploaded,
        no recapture), with the penalty history brought up to the cache."""
        self.prepare_sampler().set_params(params)
        self.sampling.catch_up(self._pos)

    def generate_ids(self, prompt_ids, n: int, params, stop_ids=frozenset()):
        """Yield up to n ids; the host reads token k while step k+1 already runs.  Plain
        greedy (temperature 0, no penalty) replays the argmax graph; any other setting the
        sampled graph (nq/runtime/sampling.py), whose penalty history is this cache."""
        from nq.runtime.sampling import needs_device_sampler
        sampled = needs_device_sampler(params)
        # the whole request is reserved before the prompt is uploaded: a refused one (KVCacheFull)
        # must leave no prompt behind for `feed` to put over a later decode(token)
        self._reserve(self._pos + np.asarray(prompt_ids).size + n)
        if sampled:
            self.prepare_sampler().set_params(params)
        start = self._pos
        p, done = self._start_prompt(prompt_ids, sampled=sampled)
        for _ in range(p - 1 - done):  # all but the last (none after a batched prefill)
            self.step()  # prompt tokens: whatever a replay picks, feed overwrites it
        # Step r writes out_ids[r]; generated token k comes from step p-1+k, the last prompt
        # token's for k = 0 (the head, when the prefill took the whole prompt).  Token k-1 is
        # read after step k is queued, so the GPU never waits for the host.  The consumer may
        # stop at any yield (a stop id): `finally` then books what the cache holds.
        produced = steps = 0
        try:
            prev = None
            for k in range(n):
                if k == 0 and done == p:
                    self._head(sampled)
                else:
                    self.step(sampled)
                steps += 1
                reader = self._enqueue_read(p - 1 + k, k % 2)
                if prev is not None:
                    tok = prev()
                    self._ids[start + p + produced] = tok
                    produced += 1
                    yield tok
                    if tok in stop_ids:
                        return
                prev = reader
            tok = prev()
            self._ids[start + p + produced] = tok
            produced += 1
            yield tok
        finally:
            # the prompt and every generated token but the last were fed to the cache
            self._finish(p + max(produced - 1, 0))
            if sampled:  # each sampled step entered its input token; keep what the cache
                # keeps.  start + p + steps bounds what was entered even if a Ctrl-C landed
                # between a step and its count, and the truncate sets the length outright
                self.sampling.entered(start + p + steps)
                self.sampling.truncate(self._pos)

    def _enqueue_read(self, index: int, slot: int):
        """Copy out_ids[index] into pinned slot after the work queued so far; return a reader."""
        from numba import cuda
        self.out_ids[index: index + 1].copy_to_host(self._h_tok[slot: slot + 1], stream=self.stream)
        ev = cuda.event(timing=False)
        ev.record(self.stream)

        def read() -> int:
            ev.synchronize()
            return int(self._h_tok[slot])
        return read

    def _finish(self, fed: int) -> None:
        """After generation: the cache holds the prompt plus the generated tokens that were fed."""
        self.stream.synchronize()
        self._pos += fed

    def reserve_ahead(self, n_tokens: int) -> None:
        """Reserve pages for n_tokens more tokens after the cache, for callers that replay
        steps directly (benchmarks): every step writes K/V at state.pos, and a block-table
        entry that was never reserved would alias page 0."""
        self._reserve(self._pos + n_tokens)

    def fake_context(self, length: int) -> None:
        """Benchmarks only: make the cache `length` tokens long without computing them (the
        pages hold zeros), so a decode step at 8K or 32K context can be timed in seconds."""
        self._reserve(length + 1)
        if self.sampling is not None:
            self.sampling.truncate(min(self._pos, int(length)))
        self._ids[min(self._pos, int(length)): int(length)] = -1
        self._pos = int(length)
        self._write_state(token=0, pos=self._pos, step=0)
        self.feed_meta.copy_to_device(np.zeros(2, np.int32), stream=self.stream)

    # ---- timing -------------------------------------------------------------------------------
    def time_steps(self, n: int, warmup: int = 3, sampled: bool = False) -> list[float]:
        """Per-step GPU times (ms) of n replays from the current state, measured with events.
        The steps are real: the cache grows by warmup + n tokens (pages reserved here), whose
        ids the host never reads (they count as unknown, -1, in the penalty history).
        sampled: the sampled step, with the parameters of the last set_sampling."""
        from numba import cuda
        self.reserve_ahead(warmup + n + 1)
        start = self._pos
        if sampled:
            self.sampling.catch_up(start)
        for _ in range(warmup):
            self.step(sampled)
        evs = [cuda.event() for _ in range(n + 1)]
        evs[0].record(self.stream)
        for i in range(n):
            self.step(sampled)
            evs[i + 1].record(self.stream)
        evs[-1].synchronize()
        self._pos += warmup + n
        self._ids[start: self._pos] = -1
        if sampled:
            self.sampling.entered(self._pos)
            self.sampling.truncate(start)
        return [cuda.event_elapsed_time(evs[i], evs[i + 1]) for i in range(n)]
