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
from nq.kernels.common import head_parts, need, sm_count
from nq.ptx import (SIMULATOR, cp_async_bulk_prefetch_l2, griddepcontrol_launch_dependents,
                    griddepcontrol_wait)
from nq.ref import linear, rms_norm

_ALIGN = None if SIMULATOR else 16


def ref_lm_head(x, norm_w, eps, weight):
    """x fp32 (H,), norm_w (H,), weight (V, H) -> logits fp32 (V,)."""
    return linear(rms_norm(x, norm_w, eps), weight)


def lm_head_name(vocab: int, k: int, eps: float, threads: int, unroll: int) -> str:
    """e.g. lm_head_fp16_v152064_k3584_t256_u7_eps1em06."""
    return kernel_name("lm_head_fp16", v=vocab, k=k, t=threads, u=unroll, eps=float(eps))


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
