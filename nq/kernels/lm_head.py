"""The fp16 lm_head GEMV with the final RMSNorm fused: logits fp32 (V,) = W . rmsnorm(x, w_norm).

Public API:

    head = make_lm_head(cfg)                   # LmHead; tiling in .unroll/.threads/.grid
                                               # (make_lm_head(cfg, weight): the int8 head
                                               # of lm_head_int8.py for an Int8Rows weight,
                                               # lm_head_int4.py's for Int4Rows)
    head(x, norm_w, weight, logits, stream)    # x fp32 (H,), norm_w fp16 (H,),
                                               # weight fp16 (V, H) (embed_tokens when tied),
                                               # logits fp32 (V,)
    ref_lm_head(x, norm_w, eps, weight)        # NumPy reference

The weight is the file's row-major fp16 matrix, untouched (a tied model shares it with the
embedding).  Persistent grid: a fixed number of blocks (4 per SM) stage h = rmsnorm(x) once, in
fp32 shared memory, then each warp walks rows gw, gw + W, ...: its lanes read consecutive
16-byte chunks of the row (8 fp16 weights each; `unroll` chunks in flight per lane), widen
them to fp32 and accumulate in fp32; a 5-step shuffle reduces the warp.  h is kept in fp32
(not rounded to fp16) and the sums are fp32, so the logits match the fp32 reference to
~1e-6 relative: the argmax of near-tied logits is decided as the reference decides it.
The fp32 math is 2 instructions per weight, far under the issue rate at 2 bytes per weight.
Shared layout: chunk c's elements 0-3 at hA[4c], 4-7 at hB[4c], so the 16-byte reads of
consecutive lanes are consecutive (no bank conflicts).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32

from nq.config import ModelConfig
from nq.kernels.build import compile_kernel, kernel_name
from nq.kernels.common import (STATIC_SMEM_LIMIT, block_rstd, dev, loop_chunks, need,
                               row_chunk_loads, sm_count, warp_sum)
from nq.ptx import (SIMULATOR, cp_async_bulk_prefetch_l2, griddepcontrol_launch_dependents,
                    griddepcontrol_wait, ld_shared_v4_f32, unpack_f16x2_to_f32)
from nq.ref import linear, rms_norm

_ALIGN = None if SIMULATOR else 16


def ref_lm_head(x, norm_w, eps, weight):
    """x fp32 (H,), norm_w (H,), weight (V, H) -> logits fp32 (V,)."""
    return linear(rms_norm(x, norm_w, eps), weight)


def lm_head_name(vocab: int, k: int, eps: float, threads: int, unroll: int) -> str:
    """e.g. lm_head_fp16_v152064_k3584_t256_u7_eps1em06."""
    return kernel_name("lm_head_fp16", v=vocab, k=k, t=threads, u=unroll, eps=float(eps))


def head_parts(k: int, threads: int, unroll: int):
    """The fp16 head's device functions, shared with the INT4 head's exact rescoring
    (lm_head_rescore.py), whose logits must be these bit for bit: (SH, stage, row_dot).

    stage(x, norm_w, hA, hB, red, eps, inv_k) -> h = rmsnorm(x) * norm_w in fp32 shared
    memory (SH floats in each of hA, hB; red: a float a warp), the block synced after;
    row_dot(weight, row, lane, hA, hB) -> the row's dot with h, summed over the warp (every
    lane gets it)."""
    if k % 8 or threads % 32:
        raise ValueError(f"lm_head: hidden={k} must be a multiple of 8, threads of 32")
    if not 1 <= unroll <= 8:
        raise ValueError("lm_head: unroll must be 1..8")
    CH = k // 8                  # 16-byte chunks per row
    NCL = -(-CH // 32)           # chunks per lane
    U = unroll
    # floats in each of hA, hB: 4 a chunk the lane loop can name (common.loop_chunks); the
    # 7B's 448 chunks are 14 x 32 with unroll 7, so its kernel is unchanged
    SH = loop_chunks(CH, U) * 4
    if 2 * SH * 4 + 64 > STATIC_SMEM_LIMIT:
        raise ValueError(f"lm_head: hidden={k} needs {2 * SH * 4} bytes of shared memory at "
                         f"unroll {unroll}; use a smaller unroll")
    WARPS = threads // 32

    def dot_chunk(w0, w1, w2, w3, hA, hB, c, acc):
        a0, a1, a2, a3 = ld_shared_v4_f32(hA, c * 4)
        b0, b1, b2, b3 = ld_shared_v4_f32(hB, c * 4)
        p0, p1 = unpack_f16x2_to_f32(w0)
        p2, p3 = unpack_f16x2_to_f32(w1)
        p4, p5 = unpack_f16x2_to_f32(w2)
        p6, p7 = unpack_f16x2_to_f32(w3)
        acc += p0 * a0 + p1 * a1 + p2 * a2 + p3 * a3
        return acc + (p4 * b0 + p5 * b1 + p6 * b2 + p7 * b3)

    dot_chunk, wsum, rstd_of = dev(dot_chunk), dev(warp_sum), dev(block_rstd)
    load_u = row_chunk_loads(CH, U, 8)

    def dot1(w, hA, hB, c, acc):
        if c < CH:
            return dot_chunk(w[0], w[1], w[2], w[3], hA, hB, c, acc)
        return acc

    def dot_u(ws, hA, hB, lane, c0, acc):
        b = c0 * 32 + lane
        l0, l1, l2, l3, l4, l5, l6, l7 = ws
        acc = dot1(l0, hA, hB, b, acc)
        if U > 1:
            acc = dot1(l1, hA, hB, b + 32, acc)
        if U > 2:
            acc = dot1(l2, hA, hB, b + 64, acc)
        if U > 3:
            acc = dot1(l3, hA, hB, b + 96, acc)
        if U > 4:
            acc = dot1(l4, hA, hB, b + 128, acc)
        if U > 5:
            acc = dot1(l5, hA, hB, b + 160, acc)
        if U > 6:
            acc = dot1(l6, hA, hB, b + 192, acc)
        if U > 7:
            acc = dot1(l7, hA, hB, b + 224, acc)
        return acc

    dot1, dot_u = dev(dot1), dev(dot_u)

    def stage(x, norm_w, hA, hB, red, eps, inv_k):
        tid = cuda.threadIdx.x
        ss = float32(0.0)
        for e in range(tid, k, threads):
            v = x[e]
            ss += v * v
        ss = wsum(ss)
        if (tid & 31) == 0:
            red[tid >> 5] = ss
        cuda.syncthreads()
        rstd = rstd_of(red, WARPS, inv_k, eps)
        for e in range(tid, k, threads):
            h = (x[e] * rstd) * float32(norm_w[e])
            c = e >> 3
            if (e & 7) < 4:
                hA[c * 4 + (e & 3)] = h
            else:
                hB[c * 4 + (e & 3)] = h
        cuda.syncthreads()

    def row_dot(weight, row, lane, hA, hB):
        acc = float32(0.0)
        for c0 in range(0, NCL, U):
            # issue up to U 16-byte loads, then the math (U words x 4 in registers)
            ws = load_u(weight, row, lane, c0)
            acc = dot_u(ws, hA, hB, lane, c0, acc)
        return wsum(acc)

    return SH, dev(stage), dev(row_dot)


@functools.lru_cache(maxsize=None)
def build_kernel(vocab: int, k: int, eps: float, threads: int = 256, unroll: int = 7):
    """The kernel body named lm_head_name(...) and its signature."""
    SH, stage, row_dot = head_parts(k, threads, unroll)
    WARPS = threads // 32
    EPS = np.float32(eps)
    INV_K = np.float32(1.0 / k)

    def kernel(x, norm_w, weight, logits):
        hA = cuda.shared.array(SH, float32, alignment=_ALIGN)   # (CH, 4) elements 0-3
        hB = cuda.shared.array(SH, float32, alignment=_ALIGN)   # (CH, 4) elements 4-7
        red = cuda.shared.array(WARPS, float32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        # PDL: the block's first WARPS rows (contiguous) go to L2 while the last down GEMV
        # finishes; x is read only after the wait.
        first = cuda.blockIdx.x * WARPS
        if tid == 0 and first < vocab:
            cp_async_bulk_prefetch_l2(weight, (first, 0), min(WARPS, vocab - first) * k * 2)
        griddepcontrol_wait()
        griddepcontrol_launch_dependents()
        stage(x, norm_w, hA, hB, red, EPS, INV_K)
        nwarps = cuda.gridDim.x * WARPS
        for row in range(cuda.blockIdx.x * WARPS + warp, vocab, nwarps):
            acc = row_dot(weight, row, lane, hA, hB)
            if lane == 0:
                logits[row] = acc

    kernel.__name__ = kernel.__qualname__ = lm_head_name(vocab, k, eps, threads, unroll)
    return kernel, "void(float32[::1], float16[::1], float16[:, ::1], float32[::1])"


@functools.lru_cache(maxsize=None)
def lm_head_kernel(vocab: int, k: int, eps: float, threads: int, unroll: int):
    """The kernel compiled for sm_90 (launch bounds: threads)."""
    pyfunc, sig = build_kernel(vocab, k, eps, threads, unroll)
    return compile_kernel(pyfunc, sig, pyfunc.__name__, launch_bounds=(threads,))


class LmHead:
    """logits fp32 (V,) = weight fp16 (V, H) . rmsnorm(x, norm_w); see the module doc."""

    def __init__(self, cfg: ModelConfig, threads: int = 256, unroll: int = 7,
                 blocks_per_sm: int = 4, grid: int | None = None):
        self.vocab, self.k = cfg.vocab_size, cfg.hidden_size
        self.threads, self.unroll = threads, unroll
        self.kernel = lm_head_kernel(self.vocab, self.k, float(cfg.rms_norm_eps), threads, unroll)
        rows_per_block = threads // 32
        self.grid = grid or min(-(-self.vocab // rows_per_block), sm_count() * blocks_per_sm)
        self.name = lm_head_name(self.vocab, self.k, float(cfg.rms_norm_eps), threads, unroll)

    def __call__(self, x, norm_w, weight, logits, stream=0):
        need(x, f"{self.name} x", np.float32, (self.k,), 4)
        need(norm_w, f"{self.name} norm_w", np.float16, (self.k,), 2)
        need(weight, f"{self.name} weight", np.float16, (self.vocab, self.k))
        need(logits, f"{self.name} logits", np.float32, (self.vocab,), 4)
        self.kernel[self.grid, self.threads, stream](x, norm_w, weight, logits)


def make_lm_head(cfg: ModelConfig, weight=None, **tiling):
    """The lm_head launcher for cfg and the weight it will read: this fp16 one (threads=256,
    unroll=7, blocks_per_sm=4 by default), or for an int8 lm_head (an Int8Rows pair) the
    launcher of nq/kernels/lm_head_int8.py, for an INT4 one (Int4Rows) lm_head_int4.py's;
    each takes the same call."""
    from nq.kernels.lm_head_int4 import Int4Rows, make_lm_head_int4
    from nq.kernels.lm_head_int8 import Int8Rows, make_lm_head_int8
    if isinstance(weight, Int8Rows):
        return make_lm_head_int8(cfg, **tiling)
    if isinstance(weight, Int4Rows):     # rescored by its fp16 rows when it carries them
        return make_lm_head_int4(cfg, rescore=weight.exact is not None, **tiling)
    return LmHead(cfg, **tiling)
