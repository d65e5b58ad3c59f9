"""The int8 lm_head GEMV, final RMSNorm fused: logits fp32 (V,) = scale * (q . rmsnorm(x, w_norm)).

Public API (the fp16 head's, nq/kernels/lm_head.py, with the weight an `Int8Rows` pair;
`lm_head.make_lm_head(cfg, weight)` picks this launcher for one):

    head = make_lm_head_int8(cfg)              # LmHeadInt8; tiling in .unroll/.rows/.grid
    head(x, norm_w, weight, logits, stream)    # x fp32 (H,), norm_w fp16 (H,),
                                               # weight Int8Rows(qweight int8 (V, H),
                                               #                 scales fp32 (V,)),
                                               # logits fp32 (V,)
    ref_lm_head_int8(x, norm_w, eps, qweight, scales)   # NumPy reference

Why: the fp16 lm_head is 1.09 GB of the 7B's ~4.49 GB a decode step reads; as int8 rows
(`nq pack --lm-head int8`, nq/loader/quant.py: one fp32 scale a row) it is half that.

The fp16 kernel's plan, at one byte a weight: a persistent grid (4 blocks per SM) stages
h = rmsnorm(x) once in fp32 shared memory, and each warp walks pairs of rows (`rows`=2): its
lanes read consecutive 16-byte chunks of both rows (16 weights each; `unroll` chunks of each
row in flight per lane), and each staged h value read from shared memory serves both rows.
At 4 bytes of h per weight byte, one row a warp would read shared memory at ~4x the weight
bandwidth (~8 TB/s for 4.8 TB/s of HBM, most of sm_90's); two rows halve it to the fp16
kernel's ratio.

Measured on the H200 (2026-12-01, scripts/bench_lm_head.py, the 7B's 0.55 GB head alone in a
graph; the fp16 head 256.4 us, 99.5 % of the copy rate): rows 2 x unroll 2, 4 blocks of 256 an
SM: 138.9 us, 92 % of the copy rate (unroll 1 145.7, 3 141.2, 4 147.9; 3 blocks an SM 142.3;
128 threads x 8 blocks 145.3; one row a warp, unroll 7: 154.6).  In the step: ITL 1.871 ->
1.765 ms at 512 with the unroll-4 kernel (`nq bench --random 7b --lm-head int8`).

int8 -> fp32, exactly, in two instructions a weight (CUTLASS's FastNumericArrayConverter
trick): `u = w ^ 0x80808080` makes the four bytes unsigned (s + 128), `prmt` puts byte k
under the exponent of 2^23 (bits 0x4B0000uu: the float 2^23 + u), and one fp32 subtract of
2^23 + 128 leaves s.  The products and sums are fp32, and the row's scale multiplies its
finished sum once, so the logits equal the fp32 reference over the dequantised rows
(q * scale) to fp32 rounding.  (The fp16 route -- prmt with 0x6400, sub.f16x2, then two
cvt.f32.f16 a pair -- costs the same four instructions a pair and needs the conversions.)
Shared layout: element j of 16-byte chunk c sits in part j // 4 at h[part * SH + 4c + j % 4],
so the 16-byte shared reads of consecutive lanes are consecutive (no bank conflicts).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from numba import cuda, float32

from nq.config import ModelConfig
from nq.kernels.build import compile_kernel, kernel_name
from nq.kernels.common import (STATIC_SMEM_LIMIT, block_rstd, dev, loop_chunks, need,
                               row_chunk_loads, sm_count, warp_sum)
from nq.loader.quant import dequantize_int8_rows
from nq.ptx import (SIMULATOR, cp_async_bulk_prefetch_l2, griddepcontrol_launch_dependents,
                    griddepcontrol_wait, ld_shared_v4_f32, mov_b32_f32_from_u32, prmt_b32)
from nq.ref import linear, rms_norm

_ALIGN = None if SIMULATOR else 16
FLIP = np.uint32(0x80808080)     # s -> s + 128 in every byte
MAGIC = np.uint32(0x4B000000)    # the float 2^23: its low mantissa byte takes u
BIAS = np.float32(8388736.0)     # 2^23 + 128
# prmt selectors: result bytes (u = byte k of a, 0x00, 0x00, 0x4B) from the pool {MAGIC, a}
SEL0, SEL1, SEL2, SEL3 = 0x7440, 0x7441, 0x7442, 0x7443


class Int8Rows(NamedTuple):
    """An int8 lm_head on the device: qweight int8 (V, H), scales fp32 (V,)."""
    qweight: object
    scales: object

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes

    @property
    def shape(self) -> tuple:
        return tuple(self.qweight.shape)


def ref_lm_head_int8(x, norm_w, eps, qweight, scales):
    """x fp32 (H,), norm_w (H,), qweight int8 (V, H), scales fp32 (V,) -> logits fp32 (V,)."""
    return linear(rms_norm(x, norm_w, eps), dequantize_int8_rows(qweight, scales))


def int8_to_f32x4(w):
    """The four int8 of word w (memory order) as exact float32 (the module doc's trick)."""
    u = w ^ FLIP
    return (mov_b32_f32_from_u32(prmt_b32(u, MAGIC, SEL0)) - BIAS,
            mov_b32_f32_from_u32(prmt_b32(u, MAGIC, SEL1)) - BIAS,
            mov_b32_f32_from_u32(prmt_b32(u, MAGIC, SEL2)) - BIAS,
            mov_b32_f32_from_u32(prmt_b32(u, MAGIC, SEL3)) - BIAS)


def lm_head_int8_name(vocab: int, k: int, eps: float, threads: int, unroll: int, rows: int) -> str:
    """e.g. lm_head_int8_v152064_k3584_t256_u2_r2_eps1em06."""
    return kernel_name("lm_head_int8", v=vocab, k=k, t=threads, u=unroll, r=rows, eps=float(eps))


@functools.lru_cache(maxsize=None)
def build_kernel(vocab: int, k: int, eps: float, threads: int = 256, unroll: int = 2,
                 rows: int = 2):
    """The kernel body named lm_head_int8_name(...) and its signature."""
    if k % 16 or threads % 32:
        raise ValueError(f"lm_head_int8: hidden={k} must be a multiple of 16, threads of 32")
    if not 1 <= unroll <= 8 or rows not in (1, 2):
        raise ValueError(f"lm_head_int8: unroll {unroll} (1..8), rows {rows} (1 or 2)")
    CH = k // 16                 # 16-byte chunks per row
    NCL = -(-CH // 32)           # chunks per lane
    U, R = unroll, rows
    # floats in each of the four parts of h: 4 a chunk the lane loop can name, not only the CH
    # real ones (common.loop_chunks: the H200 faulted on a 656-wide head at unroll 8)
    SH = loop_chunks(CH, U) * 4
    H_LEN = 4 * SH               # >= k
    if H_LEN * 4 + 64 > STATIC_SMEM_LIMIT:
        raise ValueError(f"lm_head_int8: hidden={k} needs {H_LEN * 4} bytes of shared memory "
                         f"at unroll {unroll}; use a smaller unroll")
    WARPS = threads // 32
    N_ITEMS = -(-vocab // R)     # row pairs (or rows)
    EPS = np.float32(eps)
    INV_K = np.float32(1.0 / k)

    def dot_word(w, a0, a1, a2, a3, acc):
        f0, f1, f2, f3 = cvt4(w)
        return acc + (f0 * a0 + f1 * a1 + f2 * a2 + f3 * a3)

    def dot_part(w, v, h, at, acc0, acc1):
        # one part (4 weights of each row) against the same 4 staged h values
        a0, a1, a2, a3 = ld_shared_v4_f32(h, at)
        acc0 = dot_word(w, a0, a1, a2, a3, acc0)
        if R > 1:
            acc1 = dot_word(v, a0, a1, a2, a3, acc1)
        return acc0, acc1

    def dot_chunk(w, v, h, c, acc0, acc1):
        acc0, acc1 = dot_part(w[0], v[0], h, c * 4, acc0, acc1)
        acc0, acc1 = dot_part(w[1], v[1], h, SH + c * 4, acc0, acc1)
        acc0, acc1 = dot_part(w[2], v[2], h, 2 * SH + c * 4, acc0, acc1)
        return dot_part(w[3], v[3], h, 3 * SH + c * 4, acc0, acc1)

    load_u = row_chunk_loads(CH, U, 16)   # the 4-word loads of U chunks a lane

    def dot1(w, v, h, c, acc0, acc1):
        if c < CH:
            return dot_chunk(w, v, h, c, acc0, acc1)
        return acc0, acc1

    def dot_u(ws, vs, h, lane, c0, acc0, acc1):
        b = c0 * 32 + lane
        acc0, acc1 = dot1(ws[0], vs[0], h, b, acc0, acc1)
        if U > 1:
            acc0, acc1 = dot1(ws[1], vs[1], h, b + 32, acc0, acc1)
        if U > 2:
            acc0, acc1 = dot1(ws[2], vs[2], h, b + 64, acc0, acc1)
        if U > 3:
            acc0, acc1 = dot1(ws[3], vs[3], h, b + 96, acc0, acc1)
        if U > 4:
            acc0, acc1 = dot1(ws[4], vs[4], h, b + 128, acc0, acc1)
        if U > 5:
            acc0, acc1 = dot1(ws[5], vs[5], h, b + 160, acc0, acc1)
        if U > 6:
            acc0, acc1 = dot1(ws[6], vs[6], h, b + 192, acc0, acc1)
        if U > 7:
            acc0, acc1 = dot1(ws[7], vs[7], h, b + 224, acc0, acc1)
        return acc0, acc1

    cvt4 = dev(int8_to_f32x4)
    dot_word, dot_part, dot_chunk = dev(dot_word), dev(dot_part), dev(dot_chunk)
    dot1, dot_u = dev(dot1), dev(dot_u)
    wsum, rstd_of = dev(warp_sum), dev(block_rstd)

    def kernel(x, norm_w, qweight, scales, logits):
        h = cuda.shared.array(H_LEN, float32, alignment=_ALIGN)   # (4, SH/4, 4): module doc
        red = cuda.shared.array(WARPS, float32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        # PDL: the block's first rows (contiguous) go to L2 while the last down GEMV finishes;
        # x is read only after the wait.
        first = cuda.blockIdx.x * WARPS * R
        if tid == 0 and first < vocab:
            cp_async_bulk_prefetch_l2(qweight, (first, 0), min(WARPS * R, vocab - first) * k)
        griddepcontrol_wait()
        griddepcontrol_launch_dependents()
        ss = float32(0.0)
        for e in range(tid, k, threads):
            v = x[e]
            ss += v * v
        ss = wsum(ss)
        if lane == 0:
            red[warp] = ss
        cuda.syncthreads()
        rstd = rstd_of(red, WARPS, INV_K, EPS)
        for e in range(tid, k, threads):
            j = e & 15
            h[(j >> 2) * SH + (e >> 4) * 4 + (j & 3)] = (x[e] * rstd) * float32(norm_w[e])
        cuda.syncthreads()
        nwarps = cuda.gridDim.x * WARPS
        for item in range(cuda.blockIdx.x * WARPS + warp, N_ITEMS, nwarps):
            r0 = item * R
            # an odd vocab's last pair re-reads row r0 as its second (its sum is dropped)
            r1 = r0 + 1 if R > 1 and r0 + 1 < vocab else r0
            acc0 = float32(0.0)
            acc1 = float32(0.0)
            for c0 in range(0, NCL, U):
                # issue U 16-byte loads of each row, then the math
                ws = load_u(qweight, r0, lane, c0)
                vs = load_u(qweight, r1, lane, c0) if R > 1 else ws
                acc0, acc1 = dot_u(ws, vs, h, lane, c0, acc0, acc1)
            acc0 = wsum(acc0)
            if R > 1:
                acc1 = wsum(acc1)
            if lane == 0:
                logits[r0] = acc0 * scales[r0]
                if R > 1 and r1 != r0:
                    logits[r1] = acc1 * scales[r1]

    kernel.__name__ = kernel.__qualname__ = lm_head_int8_name(vocab, k, eps, threads, U, R)
    return kernel, "void(float32[::1], float16[::1], int8[:, ::1], float32[::1], float32[::1])"


@functools.lru_cache(maxsize=None)
def lm_head_int8_kernel(vocab: int, k: int, eps: float, threads: int, unroll: int, rows: int,
                        blocks_per_sm: int):
    """The kernel compiled for sm_90; launch bounds (threads, blocks_per_sm): the persistent
    grid's blocks must all be resident at once, so ptxas may use at most 65536 /
    (threads * blocks_per_sm) registers (64 at the defaults)."""
    pyfunc, sig = build_kernel(vocab, k, eps, threads, unroll, rows)
    return compile_kernel(pyfunc, sig, pyfunc.__name__, launch_bounds=(threads, blocks_per_sm))


class LmHeadInt8:
    """logits fp32 (V,) = scales * (qweight int8 (V, H) . rmsnorm(x, norm_w)); see the module doc."""

    def __init__(self, cfg: ModelConfig, threads: int = 256, unroll: int = 2, rows: int = 2,
                 blocks_per_sm: int = 4, grid: int | None = None):
        self.vocab, self.k = cfg.vocab_size, cfg.hidden_size
        self.threads, self.unroll, self.rows = threads, unroll, rows
        eps = float(cfg.rms_norm_eps)
        self.kernel = lm_head_int8_kernel(self.vocab, self.k, eps, threads, unroll, rows,
                                          blocks_per_sm)
        rows_per_block = threads // 32 * rows
        self.grid = grid or min(-(-self.vocab // rows_per_block), sm_count() * blocks_per_sm)
        self.name = lm_head_int8_name(self.vocab, self.k, eps, threads, unroll, rows)

    def __call__(self, x, norm_w, weight: Int8Rows, logits, stream=0):
        need(x, f"{self.name} x", np.float32, (self.k,), 4)
        need(norm_w, f"{self.name} norm_w", np.float16, (self.k,), 2)
        need(weight.qweight, f"{self.name} qweight", np.int8, (self.vocab, self.k))
        need(weight.scales, f"{self.name} scales", np.float32, (self.vocab,), 4)
        need(logits, f"{self.name} logits", np.float32, (self.vocab,), 4)
        self.kernel[self.grid, self.threads, stream](x, norm_w, weight.qweight, weight.scales,
                                                     logits)


def make_lm_head_int8(cfg: ModelConfig, **tiling) -> LmHeadInt8:
    """The int8 lm_head launcher for cfg (threads=256, unroll=2, rows=2, blocks_per_sm=4)."""
    return LmHeadInt8(cfg, **tiling)
