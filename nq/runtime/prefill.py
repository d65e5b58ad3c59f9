"""Batched prefill: a prompt's tokens through every layer a chunk at a time, on the tensor cores.

Decode runs one token a step as a captured graph of GEMVs; a prompt of p tokens used to be p
replays of that graph (955 ms for 512 tokens of the 7B).  Here the prompt goes through the
model as matrices: per chunk of m <= `chunk` tokens at positions start .. start+m-1,

    embed_rows      x = emb[ids]                                   (m, H) fp32 residual
    per layer       h = rmsnorm_rows(x, w_in)                       (m, H) fp16
                    qkv = gemm_qkv(h) + b                           (m, q+2kv) fp32
                    q, K/V pages = rope_kv_rows(qkv, start)         q (m, Hq, D) fp32; K, V fp16 into
                                                                    the pages at start+i
                    o = prefill_attention(q, pages[0..start+i])     (m, Hq*D) fp16, causal
                    x += gemm_o(o)
                    h = rmsnorm_rows(x, w_post)
                    a = gemm_gate_up(h)  (SwiGLU in the epilogue)   (m, I) fp16
                    x += gemm_down(a)

The INT4 GEMMs (nq/kernels/int4/gemm.py) read the weights exactly as decode uploaded them
(the mma fragment layout for o_proj/down/gate_up, the row layout for qkv, as `layout_of`
passes them on): no second copy.
The whole prompt is prefilled here, its last token included; the engine then copies that
token's row of `x` (`last_row`) into the decode step's residual buffer and launches only the
step's tail on it: lm_head (on that one position, the final RMSNorm fused) and argmax or the
sampler, the same launches every decode step ends with, so the first token is chosen exactly
as every other.  A whole decode step for the last token, the way before, read every weight once
more: ~1.6 ms of every 7B time-to-first-token on the H200 (the step 1.87 ms, its tail ~0.25).

Workspace: the six chunk buffers above, allocated once for `chunk` rows (7B at 2048 tokens:
~190 MB; `workspace_bytes`); a 32K prompt runs as 16 chunks through the same buffers.
Launches are eager (1 + 8 a layer, 225 a chunk for the 7B): their host cost overlaps the GPU's
work once a chunk has more than a few hundred tokens (docs/PERF.md has the measurement).
"""
from __future__ import annotations

import os

import numpy as np

DEFAULT_CHUNK = 2048
# The projections' GEMM: "wgmma" (sm_90a, nq/kernels/int4/gemm_wgmma.py) for M > 64 and the
# mma.sync kernel below that; "mma" for mma.sync at every M.  H200, 2026-12-01, 28 layers of
# the 7B's projections (scripts/bench_gemm.py --quick --wgmma): 19.98 ms at M = 512 against
# 28.53 on mma.sync, 276.6 ms at 8192 against 408.8 (cuBLAS fp16: 9.41 / 161.1).
GEMM_BACKEND = "wgmma"
# The causal attention: "wgmma" (sm_90a, nq/kernels/attention/prefill_wgmma.py: the CTA rows
# of the mma.sync kernel on warpgroup MMAs with 128-key tiles) or "mma" (mma.sync,
# nq/kernels/attention/prefill.py); NQ_PREFILL_ATTN picks it for a process.  H200, 2026-12-01
# (scripts/prefill_timeline.py --random 7b, 28 layers of attention): 63.1 -> 46.1 ms of an 8K
# prompt (306.4 -> 289.4 ms in all), 964 -> 683 ms of a 32K one (1914 -> 1633 ms).
ATTN_BACKEND = os.environ.get("NQ_PREFILL_ATTN", "wgmma")
ATTN_BACKENDS = ("mma", "wgmma")


def layout_of(gemv) -> object:
    """The weight layout a decode GEMV's upload wrote, as the prefill GEMM names it: "mma"
    (the fragment layout) or ("rows", ks) (the row layout of a CUDA-core tiling)."""
    kind, arg = gemv.tiling.layout()          # ("rows", ks) or ("mma", 16)
    return "mma" if kind == "mma" else ("rows", int(arg))


def workspace_bytes(cfg, chunk: int) -> int:
    """Device bytes of Prefill's chunk buffers for `chunk` rows (ids, x, h, qkv, q, o, a)."""
    row = (4 + 4 * cfg.hidden_size + 2 * cfg.hidden_size + 4 * cfg.qkv_size
           + 4 * cfg.num_heads * cfg.head_dim + 2 * cfg.q_size + 2 * cfg.intermediate_size)
    return int(chunk) * row


class Prefill:
    """The prefill of one engine: its chunk workspaces and launchers, built once."""

    def __init__(self, eng, chunk: int = DEFAULT_CHUNK, gemm_backend: str = GEMM_BACKEND,
                 attn_backend: str = ATTN_BACKEND):
        from numba import cuda

        from nq.kernels import rows
        if attn_backend not in ATTN_BACKENDS:
            raise ValueError(f"prefill attention backend {attn_backend!r} (NQ_PREFILL_ATTN): "
                             f"use one of {', '.join(ATTN_BACKENDS)}")
        if attn_backend == "wgmma":
            from nq.kernels.attention.prefill_wgmma import prefill_attention_launcher
        else:
            from nq.kernels.attention.prefill import prefill_attention_launcher
        from nq.kernels.int4.gemm import make_gemm
        from nq.runtime.weights import weight_layouts

        c, w = eng.cfg, eng.w
        self.eng, self.cfg = eng, c
        self.chunk = C = max(1, min(int(chunk), eng.max_len))
        H, I, D = c.hidden_size, c.intermediate_size, c.head_dim
        self.ids = cuda.device_array(C, np.int32)                    # the chunk's token ids
        self.x = cuda.device_array((C, H), np.float32)               # residual stream
        self.h = cuda.device_array((C, H), np.float16)               # RMSNorm output
        self.qkv = cuda.device_array((C, c.qkv_size), np.float32)    # [q | k | v] + bias
        self.q = cuda.device_array((C, c.num_heads, D), np.float32)  # rotated q
        self.o = cuda.device_array((C, c.q_size), np.float16)        # attention output
        self.a = cuda.device_array((C, I), np.float16)               # SwiGLU output
        g = weight_layouts(c)   # the decode tilings fix the uploaded layouts the GEMMs read
        self.gemm = {
            "qkv": make_gemm("qkv", c.qkv_size, H, layout_of(g["qkv"]), backend=gemm_backend),
            "o_proj": make_gemm("o_proj", H, c.q_size, layout_of(g["o_proj"]), backend=gemm_backend),
            "gate_up": make_gemm("gate_up", I, H, layout_of(g["gate_up"]), backend=gemm_backend),
            "down": make_gemm("down", H, I, layout_of(g["down"]), backend=gemm_backend),
        }
        # every tile configuration compiled now, not at the first prompt that needs it: the
        # engine builds this inside its parallel_compiles block, so a first start compiles the
        # prefill's kernels beside the step's (on the H200, 2026-12-02, a cold first prompt of
        # 1,998 tokens spent 5.4 s compiling the four wgmma GEMMs one kind a process, after the
        # start's batch of 21 had taken 5.3 s).  Cached ones are not loaded here: each loads at
        # the first prompt that needs it (a short prompt, only the small tiles)
        for gemm in self.gemm.values():
            gemm.prepare()
        self.embed = rows.embed_rows_launcher(w.embed, self.ids, self.x)
        eps = float(c.rms_norm_eps)
        self.norm_in = [rows.rmsnorm_rows_launcher(self.x, L.input_norm, self.h, eps)
                        for L in w.layers]
        self.norm_post = [rows.rmsnorm_rows_launcher(self.x, L.post_norm, self.h, eps)
                          for L in w.layers]
        self.rope = [rows.rope_kv_rows_launcher(c, self.qkv, eng.inv_freq, eng.d_table,
                                                eng.kv[i], self.q) for i in range(c.num_layers)]
        self.attn = [prefill_attention_launcher(c, self.q, eng.kv[i], eng.d_table, self.o)
                     for i in range(c.num_layers)]

    @property
    def workspace_bytes(self) -> int:
        return sum(a.nbytes for a in (self.ids, self.x, self.h, self.qkv, self.q, self.o, self.a))

    def last_row(self, n: int) -> int:
        """The row of `x` holding token n-1 after `run` of n tokens: each chunk starts at row 0."""
        return (int(n) - 1) % self.chunk

    def run(self, first: int, start: int, n: int, stream) -> None:
        """Enqueue the prefill of the n prompt tokens eng.prompt[first : first+n] at positions
        start .. start+n-1 (their pages reserved, the block table on the device)."""
        for i0 in range(0, n, self.chunk):   # every tile an M can pick was prepared at build
            self._chunk(first + i0, start + i0, min(self.chunk, n - i0), stream)

    def _chunk(self, first: int, start: int, m: int, stream) -> None:
        w, gm = self.eng.w, self.gemm
        self.ids[:m].copy_to_device(self.eng.prompt[first:first + m], stream=stream)
        self.embed(m, stream)
        for i, L in enumerate(w.layers):
            self.norm_in[i](m, stream)
            gm["qkv"](self.h, L.qkv_w, L.qkv_s, L.qkv_b, self.qkv, m, stream=stream)
            self.rope[i](m, start, stream)
            self.attn[i](m, start, stream)
            gm["o_proj"](self.o, L.o_w, L.o_s, self.x, m, stream=stream)
            self.norm_post[i](m, stream)
            gm["gate_up"](self.h, L.gu_w, L.gu_s, self.a, m, stream=stream)
            gm["down"](self.a, L.down_w, L.down_s, self.x, m, stream=stream)
