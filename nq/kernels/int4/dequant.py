"""The INT4 dequantisation every INT4 kernel shares, as device-function bodies.

A 32-bit ValueShuffle word (nq/loader/quant.py) holds 8 signed nibbles; `dequant_word` turns
it into four fp16x2 pairs with 9 instructions and no conversion instruction:
(q & 0x000F000F) ^ 0x64086408 is the fp16 pair 1032+n (the XOR maps two's complement n to
n+8 and sets the exponent of 1024), minus 1032 gives n exactly; the high nibbles
(q & 0x00F000F0) ^ 0x64806480 are 1152+16n, fma(., 1/16, -72) gives n; q >> 8 gives the other
four.  The CUDA-core GEMV keeps these instructions interleaved with its fmas (gemv.py's dot8);
the tensor-core GEMV and the prefill GEMM wrap `dequant_word` with `dev`.

`pow2_scale_f32` is the activations' exact per-group scaling (a power of two that puts a
group's absmax in [128, 256), so fp16 partial sums cannot overflow); `digit_bits` turns such a
value into the three signed-byte digits both i8 stagings store (gemv_mma_stage, gemv_digits).  `fixed_to_f32` reads
xacc's int64 fixed point (units of 2^-32 of x; attn_o_proj), for the tensor-core kernels that
read x + xacc (gemv_mma.py "xacc").
"""
from __future__ import annotations

import numpy as np
from numba import float32, int64, uint32, uint64

from nq.ptx import (LUT_AND_XOR, add_rn_f16x2, cvt_rni_s32_f32, fma_rn_f16x2,
                    ld_global_nc_v4_u32, lop3_b32, mov_b32_f32_from_u32, mov_b32_u32_from_f32)

FIXED_ONE = 2.0 ** 32   # xacc's fixed point: one unit of x is 2^32


def fixed_to_f32(lo, hi):
    """An int64 of xacc (two uint32 words, low first) as fp32 units of x: rounded once to
    fp32, then times 2^-32 (exact).  A device function body (the kernels wrap it)."""
    return float32(int64((uint64(hi) << uint64(32)) | uint64(lo))) * float32(1.0 / FIXED_ONE)


def plus_xacc_body(fixed_f32):
    """The body of plus_xacc(xa, base, x0, x1, x2, x3): x[base .. base + 3] + xacc's four int64s
    there (two 16-byte loads of its words), each as fixed_f32 converts it; fixed_f32 is the
    kernel's device function of fixed_to_f32."""
    def plus_xacc(xa, base, x0, x1, x2, x3):
        l0, h0, l1, h1 = ld_global_nc_v4_u32(xa, 2 * base)
        l2, h2, l3, h3 = ld_global_nc_v4_u32(xa, 2 * base + 4)
        return (x0 + fixed_f32(l0, h0), x1 + fixed_f32(l1, h1), x2 + fixed_f32(l2, h2),
                x3 + fixed_f32(l3, h3))
    return plus_xacc


_NEG1032 = 0xE408E408     # fp16x2 (-1032, -1032)
_SIXTEENTH = 0x2C002C00   # fp16x2 (1/16, 1/16)
_NEG72 = 0xD480D480       # fp16x2 (-72, -72)
_MASK_LO = 0x000F000F
_MASK_HI = 0x00F000F0
_MAGIC_LO = 0x64086408    # fp16 1024 in both halves, and the sign flip of the low nibble
_MAGIC_HI = 0x64806480    # the same for the high nibble (bit 7 = its sign bit)
_SH8 = np.uint32(8)
_SH23 = np.uint32(23)




def dequant_word(q):
    """A word's 8 weights as 4 fp16x2 pairs (the ValueShuffle order's (w0,w1), (w2,w3), (w4,w5),
    (w6,w7)): (q & 0x000F000F) ^ 0x64086408 is 1032+n, minus 1032; (q & 0x00F000F0) ^
    0x64806480 is 1152+16n, times 1/16 minus 72; the same on q >> 8.  9 instructions.  A device
    function body (gemv_mma wraps it: its words are mma A fragments in this order; gemv.py's
    dot8 keeps these instructions interleaved with its fmas)."""
    lo0 = lop3_b32(q, _MASK_LO, _MAGIC_LO, LUT_AND_XOR)
    hi0 = lop3_b32(q, _MASK_HI, _MAGIC_HI, LUT_AND_XOR)
    q8 = q >> _SH8
    lo1 = lop3_b32(q8, _MASK_LO, _MAGIC_LO, LUT_AND_XOR)
    hi1 = lop3_b32(q8, _MASK_HI, _MAGIC_HI, LUT_AND_XOR)
    return (add_rn_f16x2(lo0, _NEG1032), fma_rn_f16x2(hi0, _SIXTEENTH, _NEG72),
            add_rn_f16x2(lo1, _NEG1032), fma_rn_f16x2(hi1, _SIXTEENTH, _NEG72))


def digit_bits(v):
    """v (|v| < 256) as x = rni(v * 2^14), |x| <= 2^22, its three signed-byte digits hi, mid,
    lo in bytes 2, 1, 0: (x + 0x808080) ^ 0x808080 -- each byte of x + 0x808080 is a digit +
    128.  A device function body: the i8 stagings of both GEMVs (gemv_mma_stage, gemv_digits)."""
    return uint32(cvt_rni_s32_f32(v * float32(16384.0)) + 0x808080) ^ uint32(0x808080)


def pow2_scale_f32(m):
    """(f, 1/f): powers of two with m*f in [128, 256) (clamped to 2^+-100 for 0 and tiny m).
    A device function body (the kernels wrap it); the activations' per-group exact scaling."""
    e = np.int32((mov_b32_u32_from_f32(m) >> _SH23) & 0xFF)
    ef = min(max(134 - e, -100), 100)
    return (mov_b32_f32_from_u32(uint32((ef + 127) << 23)),
            mov_b32_f32_from_u32(uint32((127 - ef) << 23)))
