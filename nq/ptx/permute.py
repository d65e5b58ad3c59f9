"""Bit shuffling on 32-bit registers: prmt (byte permute), lop3 (any 3-input logic op), and
mov.b32 bit casts between float32 and uint32.

These two make INT4 dequantisation a few instructions per eight weights: one lop3 masks a
nibble pair out of a ValueShuffle word and ORs the fp16 exponent 0x6400 onto it in one go
(fp16 0x6400|n == 1024 + n), and prmt moves bytes between words without shifts and masks.
NVVM would not emit lop3 from `(a & b) | c` written in Python reliably, and never prmt.
"""
from __future__ import annotations

import numpy as np

from nq.ptx._asm import ptx

# immLut truth-table inputs: lop3 evaluates F(a, b, c) on these three constants.
LOP3_A, LOP3_B, LOP3_C = 0xF0, 0xCC, 0xAA
# Luts the INT4 GEMV uses, spelled as the expressions they encode.
LUT_AND_OR = (LOP3_A & LOP3_B) | LOP3_C  # 0xEA: (a & b) | c   -- mask nibbles, OR 0x6400
LUT_AND_XOR = (LOP3_A & LOP3_B) ^ LOP3_C  # 0x6A: (a & b) ^ c  -- mask, flip sign, OR 0x6400


@ptx("prmt.b32 %0, %1, %2, %3;", out="u32", args=("u32", "u32", "u32"))
def prmt_b32(a, b, sel):
    """`prmt.b32 d, a, b, sel;` -- byte permute (default mode).

    The eight bytes {b, a} are numbered 0-3 (a, lowest first) and 4-7 (b).  Result byte i
    takes the byte numbered by bits 0-2 of selector nibble i; if bit 3 of that nibble is set
    the byte is replaced by its sign (0xFF or 0x00).  Only sel's low 16 bits are read.
    A constant selector costs nothing extra: ptxas folds it into the instruction.
    """
    a, b, sel = int(a) & 0xFFFFFFFF, int(b) & 0xFFFFFFFF, int(sel) & 0xFFFF
    pool = (b << 32) | a
    d = 0
    for i in range(4):
        s = (sel >> (4 * i)) & 0xF
        byte = (pool >> (8 * (s & 7))) & 0xFF
        if s & 8:
            byte = 0xFF if byte & 0x80 else 0x00
        d |= byte << (8 * i)
    return np.uint32(d)


@ptx("lop3.b32 %0, %1, %2, %3, %4;", out="u32", args=("u32", "u32", "u32", "imm"))
def lop3_b32(a, b, c, lut):
    """`lop3.b32 d, a, b, c, immLut;` -- any bitwise function of three words in one instruction.

    lut is the truth table: F evaluated on a=0xF0, b=0xCC, c=0xAA (LOP3_A/B/C), so
    `(LOP3_A & LOP3_B) | LOP3_C` == 0xEA selects `(a & b) | c`.  It must be a compile-time
    constant in the kernel (a literal, or a global/closure int): PTX takes it as an immediate.
    """
    a, b, c, lut = (int(v) & 0xFFFFFFFF for v in (a, b, c, lut))
    assert 0 <= lut <= 0xFF, "immLut is 8 bits"
    m = 0xFFFFFFFF
    d = 0
    for i in range(8):
        if (lut >> i) & 1:
            d |= (a if i & 4 else ~a & m) & (b if i & 2 else ~b & m) & (c if i & 1 else ~c & m)
    return np.uint32(d)


@ptx("mov.b32 %0, %1;", out="u32", args=("f32",))
def mov_b32_u32_from_f32(f):
    """`mov.b32 r, f;` -- the bits of a float32 (to read its exponent without frexp's calls).
    Free after register allocation."""
    return np.array([f], np.float32).view(np.uint32)[0]


@ptx("mov.b32 %0, %1;", out="f32", args=("u32",))
def mov_b32_f32_from_u32(r):
    """`mov.b32 f, r;` -- a float32 from its bits (to build an exact power of two)."""
    return np.array([int(r) & 0xFFFFFFFF], np.uint32).view(np.float32)[0]
