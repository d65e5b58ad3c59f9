"""The CUDA-core GEMV's activations as signed-byte digits, summed exactly by dp4a (`Tiling.i8`).

Why: the fp16 kernel (gemv.py) multiplies fp16 activations (2^-11 of each value) into fp16
partial sums, the decode tier's largest error at the 7B width once gate_up and o_proj left
it (docs/PERF.md 0.30).  Here each staged value v (x * norm_w * f_g, |v| < 256, as gemv.py
stages it) becomes x = rni(v * 2^14), three signed bytes hi, mid, lo (dequant.digit_bits:
2^-22 of the group's absmax), and a weight word's 8 signed nibbles become two words of signed
bytes 16 w:

    A = (q << 4) & 0xF0F0F0F0    bytes w0 w4 w1 w5   (a word's nibbles 0, 2, 4, 6)
    B =  q       & 0xF0F0F0F0    bytes w2 w6 w3 w7   (nibbles 1, 3, 5, 7)

so `dp4a(A, digits, acc)` adds four products exactly in int32; one group's sums per plane are
< 2^21, and hi * 2^16 + mid * 2^8 + lo is rounded to fp32 once a group.  Per 8 weights: 3
integer instructions and 6 dp4a, where the fp16 path spends 9 dequant and 4 fp16x2 fmas.

Staging (`piece_put_i8`): lane L of a group owns weight word L // 2 of it (positions 8 (L // 2)
.. + 7) and half h = L % 2 of it, the positions 2h, 2h + 1, 2h + 4, 2h + 5, which are the bytes
of A (h = 0) or B (h = 1) in the order (2h, 2h + 4, 2h + 1, 2h + 5); it gathers each plane's
four digits with prmt (7) and stores three words.  In shared memory a chunk (4 weight words)
is 6 units of 16 bytes, unit (plane, half) holding that plane's word for each of the 4 weight
words, so `dot_step_i8` reads a chunk with 6 `ld.shared.v4` and every row slot of the thread
uses them.  Unit index ((step * 4 + chunk) * 6 + plane * 2 + half) * KS + lane j, as gemv.py's
units are ((step * 4 + chunk) * 4 + word) * KS + j.  invf[g] holds 1/f_g * 2^-18 (16 from the
weights' bytes, 2^14 from the digits).
"""
from __future__ import annotations

import math

from numba import float32, int32, uint32

from nq.config import GROUP_SIZE
from nq.kernels.common import dev, warp_max, warp_sum
from nq.kernels.int4.dequant import digit_bits, pow2_scale_f32
from nq.ptx import (cvt_f32_f16, dp4a_s32, ld_global_nc_u32, ld_global_nc_v2_f32,
                    ld_shared_v4_u32_at, prmt_b32)

_HIGH = uint32(0xF0F0F0F0)      # the top nibble of each byte
_SH4 = uint32(4)
_DOWN = float32(2.0 ** -18)     # 1 / (16 * 2^14): the weights' bytes are 16 w, digits v * 2^14


def slot_rows(chunk, SLOTS: int):
    """rows_chunk for a thread's SLOTS row slots (<= 4): chunk(w0, w1, w2, w3, a, st) of slot
    m's four words c_m against one chunk of activations a, for each slot in use (gemv.py's fp16
    chunk and chunk_i8 below).  Written out, not looped: tuple elements need literal indices
    to stay in registers."""
    def rows_chunk(c0, c1, c2, c3, a, sts):
        s0, s1, s2, s3 = sts
        s0 = chunk(c0[0], c0[1], c0[2], c0[3], a, s0)
        if SLOTS >= 2:
            s1 = chunk(c1[0], c1[1], c1[2], c1[3], a, s1)
        if SLOTS >= 3:
            s2 = chunk(c2[0], c2[1], c2[2], c2[3], a, s2)
        if SLOTS >= 4:
            s3 = chunk(c3[0], c3[1], c3[2], c3[3], a, s3)
        return s0, s1, s2, s3
    return rows_chunk


def digits_body(GROUPS: int, KS: int, SLOTS: int, NORM: bool, four_values):
    """Device functions for a gemv.py kernel with i8: (piece_load_i8, piece_put_i8,
    dot_step_i8), with the signatures of gemv.py's piece_load, piece_put and dot_step (u the
    unit of the step's chunk 0 for lane j: step * 24 * KS + j); GROUPS = K / 128, KS and
    SLOTS as gemv.py's, NORM whether the values are rmsnorm(x) * norm_w (else fp16 a);
    four_values is gemv.py's device function (a lane's loaded inputs -> its four values and
    their sum of squares), here for positions (0, 1, 4, 5) of piece_load_i8."""
    UNIT = KS * 16              # bytes between a chunk's (plane, half) units
    PLANE = 2 * KS * 4          # words between a plane's units

    def piece_load_i8(xin, norm_w, g, lane):
        # the lane's 4 inputs of group g: positions 8 (lane // 2) + 2 (lane % 2) + (0, 1, 4, 5)
        # (clamped into range: a spare load beats a branch)
        base = min(g, GROUPS - 1) * GROUP_SIZE + (lane >> 1) * 8 + (lane & 1) * 2
        if NORM:
            x0, x1 = ld_global_nc_v2_f32(xin, base)
            x4, x5 = ld_global_nc_v2_f32(xin, base + 4)
            return x0, x1, x4, x5, ld_global_nc_u32(norm_w, base), ld_global_nc_u32(norm_w, base + 4)
        z = float32(0.0)
        return z, z, z, z, ld_global_nc_u32(xin, base), ld_global_nc_u32(xin, base + 4)

    def piece_put_i8(pc, g, lane, act, invf):
        # group g's four values of the lane as digits, times f_g; returns the lane's sum of x^2
        p0, p1, p4, p5, ss = four_values(pc)
        a0, a1, a4, a5 = abs(p0), abs(p1), abs(p4), abs(p5)
        f, fi = pow2_scale(wmax(max(max(a0, a1), max(a4, a5))))
        # cvt.rni takes NaN to 0 and saturates inf: a non-finite value of the group makes its
        # 1/f_g NaN, which reaches every row as the fp16 staging's NaN would (a sum: max
        # drops a NaN)
        if not wsum((a0 + a1) + (a4 + a5)) <= float32(3.4028234663852886e38):
            fi = float32(math.nan)
        if g >= GROUPS:
            return float32(0.0)
        d0, d1 = digits(p0 * f), digits(p1 * f)
        d4, d5 = digits(p4 * f), digits(p5 * f)
        lh04 = prmt_b32(d0, d4, 0x6240)       # d0.lo d4.lo d0.hi d4.hi
        lh15 = prmt_b32(d1, d5, 0x6240)
        m04 = prmt_b32(d0, d4, 0x0051)        # d0.mid d4.mid (bytes 0, 1)
        m15 = prmt_b32(d1, d5, 0x0051)
        s = g // KS
        tw = lane >> 1
        w = (((s * 4 + (tw >> 2)) * 6 + (lane & 1)) * KS + (g - s * KS)) * 4 + (tw & 3)
        act[w] = prmt_b32(lh04, lh15, 0x7632)                # hi:  0 4 1 5
        act[w + PLANE] = prmt_b32(m04, m15, 0x5410)          # mid
        act[w + 2 * PLANE] = prmt_b32(lh04, lh15, 0x5410)    # lo
        if lane == 0:
            invf[g] = fi * _DOWN
        return ss

    def load_digits(abase, u):
        # a chunk's 6 units (hi A, hi B, mid A, mid B, lo A, lo B), each 4 words (a word each
        # of the chunk's 4 weight words); abase: the staged array's 32-bit shared address
        a = abase + uint32(u) * uint32(16)
        return (ld_shared_v4_u32_at(a), ld_shared_v4_u32_at(a + uint32(UNIT)),
                ld_shared_v4_u32_at(a + uint32(2 * UNIT)), ld_shared_v4_u32_at(a + uint32(3 * UNIT)),
                ld_shared_v4_u32_at(a + uint32(4 * UNIT)), ld_shared_v4_u32_at(a + uint32(5 * UNIT)))

    def word_i8(q, ha, hb, ma, mb, la, lb, st):
        # one weight word (8 weights) against its digits: 3 integer instructions, 6 dp4a
        hi, mid, lo = st
        a = (q << _SH4) & _HIGH
        b = q & _HIGH
        hi = dp4a_s32(b, hb, dp4a_s32(a, ha, hi))
        mid = dp4a_s32(b, mb, dp4a_s32(a, ma, mid))
        lo = dp4a_s32(b, lb, dp4a_s32(a, la, lo))
        return hi, mid, lo

    def chunk_i8(q0, q1, q2, q3, d, st):
        ha, hb, ma, mb, la, lb = d
        st = word_i8(q0, ha[0], hb[0], ma[0], mb[0], la[0], lb[0], st)
        st = word_i8(q1, ha[1], hb[1], ma[1], mb[1], la[1], lb[1], st)
        st = word_i8(q2, ha[2], hb[2], ma[2], mb[2], la[2], lb[2], st)
        return word_i8(q3, ha[3], hb[3], ma[3], mb[3], la[3], lb[3], st)

    def scaled_i8(st, sbits, fi):
        # a row's group sum: hi 2^16 + mid 2^8 + lo (exact in int32 up to the last add, then
        # one fp32 rounding), times its weight scale and 1/f_g 2^-18
        hi, mid, lo = st
        v = float32(int32(hi * 256 + mid)) * float32(256.0) + float32(lo)
        return v * (cvt_f32_f16(sbits) * fi)

    def dot_step_i8(cur, abase, u, fi):
        """gemv.py's dot_step with digits: the thread's SLOTS rows times one group, chunk-major
        (each chunk's digits read from shared once for every row).  Written out, not looped."""
        r0, r1, r2, r3 = cur
        z = int32(0)
        sts = ((z, z, z), (z, z, z), (z, z, z), (z, z, z))
        sts = rows_chunk_i8(r0[0:4], r1[0:4], r2[0:4], r3[0:4], load_digits(abase, u), sts)
        sts = rows_chunk_i8(r0[4:8], r1[4:8], r2[4:8], r3[4:8],
                            load_digits(abase, u + 6 * KS), sts)
        sts = rows_chunk_i8(r0[8:12], r1[8:12], r2[8:12], r3[8:12],
                            load_digits(abase, u + 12 * KS), sts)
        sts = rows_chunk_i8(r0[12:16], r1[12:16], r2[12:16], r3[12:16],
                            load_digits(abase, u + 18 * KS), sts)
        s0, s1, s2, s3 = sts
        return (scaled_i8(s0, r0[16], fi), scaled_i8(s1, r1[16], fi),
                scaled_i8(s2, r2[16], fi), scaled_i8(s3, r3[16], fi))

    pow2_scale, wmax, wsum, digits = (dev(f) for f in (pow2_scale_f32, warp_max, warp_sum,
                                                        digit_bits))
    piece_load_i8, piece_put_i8, load_digits, word_i8, chunk_i8 = (
        dev(f) for f in (piece_load_i8, piece_put_i8, load_digits, word_i8, chunk_i8))
    rows_chunk_i8 = dev(slot_rows(chunk_i8, SLOTS))
    scaled_i8, dot_step_i8 = dev(scaled_i8), dev(dot_step_i8)
    return piece_load_i8, piece_put_i8, dot_step_i8
