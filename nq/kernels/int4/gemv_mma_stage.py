"""The block's activations in the tensor-core GEMV (gemv_mma.py's module doc has the why):
`stage` copies fp16 `a` (o_proj, down) into shared memory in B-fragment order, `stage_norm`
writes rmsnorm(x) * norm_w there (gate_up: each group times a power of two, its inverse in
`invf`; with i8 as digits) and returns rstd;
`stage_digits` stages fp16 `a` as digits (o_proj, down with i8).  `act_path(shape)` returns them
as device functions for gemv_mma.build_kernel."""
from __future__ import annotations

import math
from types import SimpleNamespace

from numba import cuda, float32, uint16, uint32  # module globals: the simulator swaps cuda

from nq.config import GROUP_SIZE
from nq.kernels.common import block_rstd, dev, warp_max, warp_sum
from nq.kernels.int4.dequant import digit_bits as digit_bits_body
from nq.kernels.int4.dequant import fixed_to_f32, plus_xacc_body, pow2_scale_f32
from nq.kernels.int4.gemv_mma_shape import MmaShape
from nq.kernels.int4.layout import CHUNK
from nq.ptx import (cvta_to_shared_u32, ld_global_nc_v2_u32, ld_global_nc_v4_f32,
                    ld_global_nc_v4_u32, pack_f16x2_from_f32, st_shared_u8_at,
                    unpack_f16x2_to_f32)


def act_path(s: MmaShape) -> SimpleNamespace:
    """The activation side of one kernel's body, as device functions."""
    THREADS, WARPS, GROUPS, CHUNKS = s.THREADS, s.WARPS, s.GROUPS, s.CHUNKS
    STAGE_ITERS, NORM_ITERS, EPS, INV_K = s.STAGE_ITERS, s.NORM_ITERS, s.EPS, s.INV_K
    XACC, I8 = s.XACC, s.I8

    def stage(a, act):
        # every chunk c's 8 fp16 pairs p0..p7 stored as (p0 p4)(p1 p5)(p2 p6)(p3 p7) at word
        # 8c: lane t's B fragment (b0 = pair t, b1 = pair t + 4) is then 8 contiguous bytes
        for it in range(STAGE_ITERS):
            c = it * THREADS + cuda.threadIdx.x
            if c < CHUNKS:
                p0, p1, p2, p3 = ld_global_nc_v4_u32(a, c * CHUNK)
                p4, p5, p6, p7 = ld_global_nc_v4_u32(a, c * CHUNK + 8)
                w = c * 8
                act[w] = p0
                act[w + 1] = p4
                act[w + 2] = p1
                act[w + 3] = p5
                act[w + 4] = p2
                act[w + 5] = p6
                act[w + 6] = p3
                act[w + 7] = p7

    def stage_norm(x, xa, norm_w, act, invf, ssum):
        """gate_up: stage x * norm_w in stage's order, each group times f_g (module doc;
        invf[g] = 1/f_g), and return rstd.  Warp w stages groups w, w + WARPS, ...; a lane's
        four values and where they land are scaled_group's.  gemv.py's piece_put, value for
        value.  xa: xacc's words (XACC; else any stand-in, never read)."""
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        ss = float32(0.0)
        for it in range(NORM_ITERS):
            grp = it * WARPS + warp
            v0, v1, v2, v3, fi, sq, w = scaled_group(x, xa, norm_w, grp, lane)
            if grp < GROUPS:
                ss += sq
                if I8:
                    put_digits(act, grp, lane, v0, v1, v2, v3)
                    fi = finite_or_nan(fi, v0, v1, v2, v3)
                else:
                    act[w] = pack_f16x2_from_f32(v0, v1)
                    act[w + 2] = pack_f16x2_from_f32(v2, v3)   # pair j + 1: two words on
                if lane == 0:
                    invf[grp] = fi
        ss = wsum(ss)
        if lane == 0:
            ssum[warp] = ss
        cuda.syncthreads()
        return rstd_of(ssum, WARPS, INV_K, EPS)

    def scaled_group(x, xa, norm_w, grp, lane):
        """Group grp's values of a lane as stage_norm stages them: v = x * norm_w * f_g for
        x[128 grp + 4 lane ..] (four), 1/f_g, the lane's sum of squares of x, and the word of
        its first pair in stage's order (lane l holds pairs 2(l%4) and 2(l%4)+1 of chunk l//4,
        which land at words 2j (j < 4) or 2(j-4)+1 of the chunk).  Past the last group the loads read the last one (a spare load beats a branch) and the
        caller stores nothing."""
        base = min(grp, GROUPS - 1) * GROUP_SIZE + lane * 4
        x0, x1, x2, x3 = ld_global_nc_v4_f32(x, base)
        if XACC:   # x + xacc * 2^-32 (the int64 words of base .. base + 3)
            x0, x1, x2, x3 = plus_xacc(xa, base, x0, x1, x2, x3)
        w01, w23 = ld_global_nc_v2_u32(norm_w, base)
        n0, n1 = unpack_f16x2_to_f32(w01)
        n2, n3 = unpack_f16x2_to_f32(w23)
        p0, p1, p2, p3 = x0 * n0, x1 * n1, x2 * n2, x3 * n3
        m = wmax(max(max(abs(p0), abs(p1)), max(abs(p2), abs(p3))))
        f, fi = pow2_scale(m)
        j = (lane & 3) * 2          # the lane's first pair in its chunk (0, 2, 4, 6)
        w = (grp * (GROUP_SIZE // CHUNK) + (lane >> 2)) * 8
        w += 2 * j if j < 4 else 2 * j - 7
        return (p0 * f, p1 * f, p2 * f, p3 * f, fi, x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3, w)

    def put_digit(o, v):
        """i8: v's digits (digit_bits), hi at shared address o (plane 0), mid 128 bytes on
        (plane 1), lo 256 on (plane 2)."""
        d = digit_bits(v)
        st_shared_u8_at(o, uint16(d >> uint32(16)))
        st_shared_u8_at(o + uint32(128), uint16(d >> uint32(8)))
        st_shared_u8_at(o + uint32(256), uint16(d))

    def put_digits(act, grp, lane, v0, v1, v2, v3):
        """i8: the lane's four values of group grp (columns 4 lane .. 4 lane + 3: chunk
        lane // 4, positions p = 4 (lane % 4) + i) where the B fragments read them.  A k32
        step s takes chunks 2s (b0) and 2s + 1 (b1); lane t's four bytes of a chunk are its
        A word's columns 2t, 2t + 8, 2t + 1, 2t + 9 (gemv_mma.py "i8"), so position p goes
        to lane t = (p % 8) // 2, byte (p % 2) * 2 + p // 8, at byte
        grp * 384 + plane * 128 + t * 32 + s * 8 + (chunk % 2) * 4 + byte."""
        c = lane >> 2
        p = (lane & 3) * 4
        o = cvta_to_shared_u32(act) + uint32(grp * 384 + (c >> 1) * 8 + (c & 1) * 4
                                             + ((p & 7) >> 1) * 32 + (p >> 3))
        put_digit(o, v0)                  # positions p, p + 1: lane t's bytes j, j + 2;
        put_digit(o + uint32(2), v1)      # p + 2, p + 3: lane t + 1's
        put_digit(o + uint32(32), v2)
        put_digit(o + uint32(34), v3)

    def finite_or_nan(fi, v0, v1, v2, v3):
        """i8 (the whole warp): 1/f_g, or NaN where a value of the warp's group is not finite
        -- cvt.rni would take a NaN to 0 and saturate an inf, so the group's 1/f_g carries it
        to every row, as the fp16 staging's NaN would.  A sum, not a max: max drops a NaN."""
        s_ = wsum(abs(v0) + abs(v1) + abs(v2) + abs(v3))
        return fi if s_ <= float32(3.4028234663852886e38) else float32(math.nan)

    def load_group_a(a, grp, lane):
        # the lane's four fp16 of group grp of `a` (past the last group: the last one's)
        return ld_global_nc_v2_u32(a, min(grp, GROUPS - 1) * GROUP_SIZE + lane * 4)

    def digit_group(act, invf, grp, lane, w01, w23):
        # group grp's four values of the lane as digits, times f_g (none past the last group)
        p0, p1 = unpack_f16x2_to_f32(w01)
        p2, p3 = unpack_f16x2_to_f32(w23)
        f, fi = pow2_scale(wmax(max(max(abs(p0), abs(p1)), max(abs(p2), abs(p3)))))
        fi = finite_or_nan(fi, p0, p1, p2, p3)
        if grp < GROUPS:
            put_digits(act, grp, lane, p0 * f, p1 * f, p2 * f, p3 * f)
            if lane == 0:
                invf[grp] = fi

    def stage_digits(a, act, invf):
        """o_proj, down with i8: fp16 `a` staged as digits, each group times a power of two
        f_g that puts its absmax in [128, 256) (invf[g] = 1/f_g, as stage_norm's).  Warp w
        stages groups w, w + WARPS, ...; a lane its four values 4 lane .. 4 lane + 3.  Eight
        groups a warp at a time, their loads written out ahead of their math: in a loop NVVM
        kept, each group's L2 round trip waited for the one before (down: 5 a warp)."""
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        for it in range(0, NORM_ITERS, 8):
            g0 = it * WARPS + warp
            a0 = load_group_a(a, g0, lane)
            a1 = a2 = a3 = a4 = a5 = a6 = a7 = a0
            if NORM_ITERS > 1:
                a1 = load_group_a(a, g0 + WARPS, lane)
            if NORM_ITERS > 2:
                a2 = load_group_a(a, g0 + 2 * WARPS, lane)
            if NORM_ITERS > 3:
                a3 = load_group_a(a, g0 + 3 * WARPS, lane)
            if NORM_ITERS > 4:
                a4 = load_group_a(a, g0 + 4 * WARPS, lane)
            if NORM_ITERS > 5:
                a5 = load_group_a(a, g0 + 5 * WARPS, lane)
            if NORM_ITERS > 6:
                a6 = load_group_a(a, g0 + 6 * WARPS, lane)
            if NORM_ITERS > 7:
                a7 = load_group_a(a, g0 + 7 * WARPS, lane)
            digit_group(act, invf, g0, lane, a0[0], a0[1])
            if NORM_ITERS > 1:
                digit_group(act, invf, g0 + WARPS, lane, a1[0], a1[1])
            if NORM_ITERS > 2:
                digit_group(act, invf, g0 + 2 * WARPS, lane, a2[0], a2[1])
            if NORM_ITERS > 3:
                digit_group(act, invf, g0 + 3 * WARPS, lane, a3[0], a3[1])
            if NORM_ITERS > 4:
                digit_group(act, invf, g0 + 4 * WARPS, lane, a4[0], a4[1])
            if NORM_ITERS > 5:
                digit_group(act, invf, g0 + 5 * WARPS, lane, a5[0], a5[1])
            if NORM_ITERS > 6:
                digit_group(act, invf, g0 + 6 * WARPS, lane, a6[0], a6[1])
            if NORM_ITERS > 7:
                digit_group(act, invf, g0 + 7 * WARPS, lane, a7[0], a7[1])

    digit_bits = dev(digit_bits_body)
    put_digit, put_digits, finite_or_nan, load_group_a, digit_group, stage_digits = (
        dev(f) for f in (put_digit, put_digits, finite_or_nan, load_group_a, digit_group,
                         stage_digits))
    fixed_f32 = dev(fixed_to_f32)
    pow2_scale, plus_xacc = dev(pow2_scale_f32), dev(plus_xacc_body(fixed_f32))
    wsum, wmax, rstd_of = dev(warp_sum), dev(warp_max), dev(block_rstd)
    scaled_group, stage, stage_norm = (dev(f) for f in (scaled_group, stage, stage_norm))
    return SimpleNamespace(stage=stage, stage_norm=stage_norm,
                           stage_digits=stage_digits, put_digits=put_digits,
                           finite_or_nan=finite_or_nan)
