"""mul.hi.u32: the high half of a 32x32-bit product, for the sampler's Philox rounds.

Philox4x32 needs both halves of two 32x32 products a round.  Written in numba as an int64
product and a shift, NVVM keeps a 64x64-bit multiply (mul.lo.s64, three IMADs on sm_90) because
it cannot see that the operands fit 32 bits; with this wrapper a round is one mul.hi.u32 and one
mul.lo (LLVM narrows the masked low half itself).
"""
from __future__ import annotations

import numpy as np

from nq.ptx._asm import ptx


@ptx("mul.hi.u32 %0, %1, %2;", out="u32", args=("u32", "u32"))
def mul_hi_u32(a, b):
    """`mul.hi.u32 d, a, b;` -- d = (a * b) >> 32 for unsigned 32-bit a, b."""
    return np.uint32(((int(a) & 0xFFFFFFFF) * (int(b) & 0xFFFFFFFF)) >> 32)
