"""fp16 arithmetic on packed half2 words, and fp16 <-> fp32 conversions.

Registers hold two fp16 values in one uint32 (lower half = element 0), which is what the INT4
dequant produces (0x6400|n pairs) and what a 16-byte load of fp16 activations delivers.
`fma.rn.f16x2` does two multiply-adds in one instruction; numba's float16 support goes through
scalar conversions and cannot express it.  The conversions exist so kernels can move between
fp32 accumulators and fp16 storage without numba's fp16 helper calls (which stay real calls,
with local memory, without LTO).

All arithmetic here is `.rn` (round to nearest even), subnormals kept (no `.ftz`), so the
twins can be exact: they compute in rationals and round once.  A NaN result is the canonical
fp16 NaN 0x7FFF (fp16 arithmetic results, and cvt.rn.f16.f32 of a NaN).
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np

from nq.ptx._asm import ptx

F16_NAN = 0x7FFF  # canonical NaN of fp16 arithmetic


def f16_round_bits(x) -> int:
    """fp16 bit pattern nearest to the exact value x (a Fraction or float), ties to even."""
    if isinstance(x, float):
        if x != x:
            return F16_NAN
        if x in (float("inf"), float("-inf")):
            return 0xFC00 if x < 0 else 0x7C00
        neg = x < 0 or (x == 0 and np.signbit(x))
        x = Fraction(x)
    else:
        neg = x < 0
    x = abs(x)
    sign = 0x8000 if neg else 0
    if x == 0:
        return sign
    e = x.numerator.bit_length() - x.denominator.bit_length()
    if Fraction(2) ** e > x:
        e -= 1
    e = max(e, -14)  # below 2**-14 the quantum stays 2**-24: subnormals
    n = round(x / Fraction(2) ** (e - 10))  # Fraction.__round__ ties to even
    if n == 2048:
        e, n = e + 1, 1024
    if e > 15:
        return sign | 0x7C00
    if n < 1024:
        return sign | n
    return sign | ((e + 15) << 10) | (n - 1024)


def f16_value(bits) -> float:
    """The value of an fp16 bit pattern as a Python float (exact)."""
    return float(np.array(int(bits) & 0xFFFF, dtype=np.uint16).view(np.float16))


def _fma_f16_bits(a, b, c) -> int:
    fa, fb, fc = f16_value(a), f16_value(b), f16_value(c)
    if not all(np.isfinite([fa, fb, fc])):
        with np.errstate(invalid="ignore"):  # inf*0 and inf-inf are NaN, as on the GPU
            return f16_round_bits(float(np.float64(fa) * np.float64(fb) + np.float64(fc)))
    p = Fraction(fa) * Fraction(fb)
    s = p + Fraction(fc)
    if s == 0:
        p_neg = np.signbit(fa) != np.signbit(fb)
        neg = p_neg and bool(np.signbit(fc)) if p == 0 and fc == 0 else False
        return 0x8000 if neg else 0
    return f16_round_bits(s)


def _halves(x):
    x = int(x) & 0xFFFFFFFF
    return x & 0xFFFF, x >> 16


def _lanes(f, *words):
    lo = f(*(_halves(w)[0] for w in words))
    hi = f(*(_halves(w)[1] for w in words))
    return np.uint32(lo | (hi << 16))


@ptx("fma.rn.f16x2 %0, %1, %2, %3;", out="u32", args=("u32", "u32", "u32"))
def fma_rn_f16x2(a, b, c):
    """`fma.rn.f16x2 d, a, b, c;` -- d = a*b + c on both fp16 halves, rounded once.

    The dequant-and-dot workhorse: (0x6400|n) * scale + (-1032*scale) turns a nibble pair into
    two scaled weights in one instruction.
    """
    return _lanes(_fma_f16_bits, a, b, c)


@ptx("mul.rn.f16x2 %0, %1, %2;", out="u32", args=("u32", "u32"))
def mul_rn_f16x2(a, b):
    """`mul.rn.f16x2 d, a, b;` -- a*b on both halves.  `.rn` stops ptxas fusing it into an fma."""
    return _lanes(lambda x, y: _fma_f16_bits(x, y, 0x8000), a, b)


@ptx("add.rn.f16x2 %0, %1, %2;", out="u32", args=("u32", "u32"))
def add_rn_f16x2(a, b):
    """`add.rn.f16x2 d, a, b;` -- a+b on both halves (sub: add the value with sign bits flipped)."""
    return _lanes(lambda x, y: _fma_f16_bits(x, 0x3C00, y), a, b)


@ptx("cvt.f32.f16 %0, %1;", out="f32", args=("u16",))
def cvt_f32_f16(h):
    """`cvt.f32.f16 f, h;` -- fp16 bits (uint16) to float32, exact."""
    return np.float32(f16_value(h))


@ptx("cvt.rn.f16.f32 %0, %1;", out="u16", args=("f32",))
def cvt_rn_f16_f32(f):
    """`cvt.rn.f16.f32 h, f;` -- float32 to fp16 bits (uint16), round to nearest even."""
    return np.uint16(f16_round_bits(float(np.float32(f))))


@ptx("cvt.rni.s32.f32 %0, %1;", out="s32", args=("f32",))
def cvt_rni_s32_f32(f):
    """`cvt.rni.s32.f32 i, f;` -- float32 to the nearest int32, ties to even (saturating at the
    int32 range; NaN gives 0)."""
    f = float(np.float32(f))
    if f != f:
        return np.int32(0)
    if abs(f) >= 2.0**31:
        return np.int32(-2**31 if f < 0 else 2**31 - 1)
    return np.int32(round(f))   # round(): ties to even


@ptx("cvt.rn.f16x2.f32 %0, %2, %1;", out="u32", args=("f32", "f32"))
def pack_f16x2_from_f32(lo, hi):
    """`cvt.rn.f16x2.f32 d, hi, lo;` -- two float32 to one half2 word, lo in bits 0-15.

    PTX puts its FIRST source in the UPPER half; this wrapper takes (lo, hi) in memory order
    and swaps them in the emitted instruction, so pack_f16x2_from_f32(x[0], x[1]) stored as a
    uint32 equals the fp16 array [x[0], x[1]].
    """
    return np.uint32(f16_round_bits(float(np.float32(lo)))
                     | (f16_round_bits(float(np.float32(hi))) << 16))


@ptx("{ .reg .f16 nq_lo, nq_hi; mov.b32 {nq_lo, nq_hi}, %2; "
     "cvt.f32.f16 %0, nq_lo; cvt.f32.f16 %1, nq_hi; }",
     out=("f32", "f32"), args=("u32",))
def unpack_f16x2_to_f32(x):
    """`mov.b32 {lo, hi}, x; cvt.f32.f16 f0, lo; cvt.f32.f16 f1, hi;` -- half2 word to (lo, hi) float32.

    The mov is free (ptxas addresses the halves of a register directly).
    """
    lo, hi = _halves(x)
    return np.float32(f16_value(lo)), np.float32(f16_value(hi))
