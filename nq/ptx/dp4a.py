"""dp4a: four int8 products summed into an int32 in one instruction.

For an INT8 path (activations quantised per token, weights widened from INT4 to int8 with
prmt/lop3), dp4a does four multiply-adds per instruction where fp16x2 does two.
"""
from __future__ import annotations

import numpy as np

from nq.ptx._asm import ptx


def _s8(x, i):
    b = (int(x) >> (8 * i)) & 0xFF
    return b - 256 if b & 0x80 else b


@ptx("dp4a.s32.s32 %0, %1, %2, %3;", out="s32", args=("u32", "u32", "s32"))
def dp4a_s32(a, b, c):
    """`dp4a.s32.s32 d, a, b, c;` -- d = c + sum over bytes i of int8(a_i) * int8(b_i).

    The sum wraps modulo 2^32 like any s32 add.
    """
    d = int(c) + sum(_s8(a, i) * _s8(b, i) for i in range(4))
    return np.int32(((d + 2**31) % 2**32) - 2**31)
