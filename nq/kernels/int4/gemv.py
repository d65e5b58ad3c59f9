"""The CUDA-core INT4 GEMV kernels of a decode step: one factory, six kinds
(and lm_head's variant that also bounds its rescoring, lm_head_bound).

    qkv      out fp32 (N,)  = Wqkv . rmsnorm(x, w_in) + bias         N = q + 2 kv
    lm_head  out fp32 (V,)  = Wlm . rmsnorm(x, w_norm)               the INT4 head (no bias;
             `nq pack --lm-head int4`, nq/kernels/lm_head_int4.py); lm_head_bound also
             writes the rescoring's per-block bound maxima (nq/kernels/lm_head_rescore.py)
    qkv_rope qkv, then rope_kv's job in the epilogue: rotated q fp32 -> q_out, rotated k and
             v fp16 -> the KV page table[pos//16], slot pos%16 (nq/kernels/rope_kv.py)
    o_proj   x   fp32 (H,) += Wo . a                                 a fp16 (attention output)
    gate_up  out fp16 (I,)  = silu(Wg . h) * (Wu . h),  h = rmsnorm(x, w_post)
    down     x   fp32 (H,) += Wd . a                                 a fp16 (SwiGLU output)

`build_kernel(kind, n_out, k, tiling, eps, heads)` returns the kernel body and its signature;
`compile_gemv` compiles it once (nq/kernels/build.py) under a name that spells every constant
baked in.  The launchers (prepare, argument checks, grid) are in launch.py, the references in
reference.py, the tilings in tiling.py, the weight layout (`tile_rows`) in layout.py.  o_proj
and down run on the tensor cores by default (gemv_mma.py); this kernel takes them too.
(About 620 lines in one file on purpose: the six kinds share one load/dequant/dot loop, and
their prologues and epilogues read best beside it.)

How a kernel works (one thread = `rows` output rows x whole 128-weight groups):
  * A row's GROUPS = K/128 groups are split over `ks` lanes of a segment of pow2(ks) lanes;
    lane j owns groups j, j+ks, j+2ks, ... ("steps").  Per step it issues four 16-byte loads
    per weight row (one group: 128 nibbles) and one 2-byte scale load, all before any math;
    with `prefetch` the next step's loads are issued before this step's math.
  * The step-0 loads are issued first of all: weights do not depend on the activations, so
    the DRAM latency overlaps the prologue (RMSNorm, staging) and, under programmatic
    dependent launch, the kernel before (griddepcontrol.wait comes after them).
  * Prologue: every block stages the whole activation vector in shared memory as fp16, each
    group of 128 multiplied by a power of two f_g that brings its absmax into [128, 256)
    (exact; undone in fp32 with the weight scale).  This bounds every fp16 partial sum: a
    nibble times an activation is <= 7*256 = 1792, and 32 such products stay < 65504, so
    the fp16 partials cannot overflow even on Qwen's "massive activations".  RMSNorm's rstd
    is applied once to the final dot product (the staged values are x*w*f_g).
  * Dequant, per 32-bit word (8 weights): dequant.py's 9 instructions, each pair's fma.f16x2
    with the activations right after it: 13 per 8 weights.
  * fp16 partial sums span `span` weights (32: one 16-byte chunk, 8 products per fp16 lane;
    128: one group), then go to fp32 and are scaled once per group: fp32 acc += partial *
    (scale * 1/f_g).  Error: the inputs are fp16 (2^-11 relative), each fp16 partial adds
    ~sqrt(8) roundings of 2^-11 of its own magnitude, which is random in sign across
    chunks: |out - ref_fp64| / |ref| ~ 1e-3 (tests allow 5e-3 relative to the row norm).
  * The segment reduces its lanes with shuffles; lane 0 writes (one writer per element).

With `Tiling.i8` (qkv's and qkv_rope's default under NQ_I8=1) the staging and the dot are
gemv_digits.py's instead: the activations as three signed-byte digits, the products summed
exactly by dp4a (1e-6 of the output's norm, against ~1e-3 above), at the same speed in the 7B
step and faster at the 14B's and 32B's widths (docs/PERF.md 0.30).

qkv_rope is qkv with rope_kv's job as its epilogue (rope_epilogue.py says how it stays bit
for bit qkv + rope_kv): a thread owns one RoPE pair, its rows=2 slots the pair's two rows
(`weight_row`), so it reads qkv's uploaded weights as they are.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
from numba import cuda, float32, uint32

from nq.config import GROUP_SIZE
from nq.kernels.build import compile_kernel, kernel_name
from nq.kernels.common import block_rstd, dev, warp_max, warp_sum
from nq.kernels.int4.dequant import (_MAGIC_HI, _MAGIC_LO, _MASK_HI, _MASK_LO, _NEG72, _NEG1032,
                                     _SH8, _SIXTEENTH, pow2_scale_f32)
from nq.kernels.int4.gemv_digits import digits_body, slot_rows
from nq.kernels.int4.rope_epilogue import put_rope_body
from nq.kernels.int4.tiling import NORM_KINDS, Tiling, check_tiling
from nq.ptx import (LUT_AND_XOR, SIMULATOR, add_rn_f16x2, cp_async_bulk_prefetch_l2,
                    cvt_f32_f16, cvt_rn_f16_f32, cvta_to_shared_u32, fma_rn_f16x2,
                    griddepcontrol_launch_dependents,
                    griddepcontrol_wait, ld_global_nc_u16, ld_global_nc_v2_u32,
                    ld_global_nc_v4_f32, ld_global_nc_v4_u32, ld_shared_v4_u32_at, lop3_b32,
                    pack_f16x2_from_f32, st_global_u16, unpack_f16x2_to_f32)
from nq.ref import K_SIGMA

_ALIGN = None if SIMULATOR else 16   # the simulator refuses alignment=; numba honours it

# Retired, each after it lost in the 7B step graph on the H200 (docs/PERF.md, 0.4 rows):
# block_major (a block's step one contiguous run): down +0.027 ms a step (8K +0.033); code at 13c221c
# bulk (a producer warp's cp.async.bulk ring): down +0.11 ms a step (bulk=2 +0.50); code at 13c221c
# stream (weight loads L1::no_allocate.L2::256B): down +0.005 ms a step, gate_up +0.019; code at 13c221c
# resident (qkv / qkv_rope's weight rows bulk-copied into shared memory before the wait; H100,
# 2026-12-07): the qkv region alone 0.197 / 0.185 ms at 384 / 256 threads against 0.178, the
# step +0.031 / +0.024 at 512 / 8K (docs/PERF.md 0.38-0.39); code at bb95d7a


def gemv_name(kind: str, n_out: int, k: int, t: Tiling, eps: float, heads=None) -> str:
    """The kernel's name (profiles, launcher errors): every constant build_kernel bakes in."""
    extra = {} if heads is None else dict(zip(("heads", "kv_heads", "head_dim"), heads))
    fields = dataclasses.asdict(t)
    for f in ("early", "i8"):
        if not fields[f]:
            del fields[f]                # the names of the kernels before them stand
    return kernel_name(f"gemv_int4_{kind}", n=n_out, k=k, **fields, eps=eps, **extra)


@functools.cache
def compile_gemv(kind: str, n_out: int, k: int, t: Tiling, eps: float, heads=None):
    """The compiled kernel (or the simulator's), once per process for each set of constants."""
    body, sig = build_kernel(kind, n_out, k, t, eps, heads)
    bounds = (t.threads, t.min_blocks) if t.min_blocks else (t.threads,)
    return compile_kernel(body, sig, gemv_name(kind, n_out, k, t, eps, heads),
                          launch_bounds=bounds)


@functools.cache
def build_kernel(kind: str, n_out: int, k: int, t: Tiling, eps: float, heads=None):
    """The kernel body of `gemv_name(...)` and the signature to compile it for.

    heads: (num_heads, num_kv_heads, head_dim), for qkv_rope only (the RoPE epilogue)."""
    check_tiling(kind, n_out, k, t, heads)
    # The constants the body closes over (numba freezes them):
    #   GROUPS       k / 128: a row's groups
    #   KS, LANES    the tiling's ks (lanes that own groups) and pow2(ks) (a row's segment)
    #   ROWS         output rows of a thread; MATS weight matrices (2: gate_up's [gate; up]);
    #                SLOTS = ROWS * MATS weight rows a thread loads (<= 4: the tuples below)
    #   STEPS        ceil(GROUPS / KS); LAST_GROUPS the groups of the last (maybe short) step
    #   THREADS, WARPS, SEGMENTS   a block's threads, warps and row segments
    #   ACT_WORDS    staged activations, uint32 words (fp16 pairs)
    #   AT_ONCE      groups a warp loads at once in the prologue
    #   HQ, HKV, D, HALF           qkv_rope's heads, head_dim and head_dim / 2 (1 elsewhere)
    ROPE = kind == "qkv_rope"
    HQ = HKV = D = HALF = 1   # bound in every kind: the closures see them
    if ROPE:
        HQ, HKV, D = (int(h) for h in heads)
        HALF = D // 2
    GROUPS = k // GROUP_SIZE
    KS, LANES, ROWS, THREADS = t.ks, t.lanes, t.rows, t.threads
    MATS = 2 if kind == "gate_up" else 1
    SLOTS = ROWS * MATS
    STEPS = -(-GROUPS // KS)
    LAST_GROUPS = GROUPS - (STEPS - 1) * KS
    SEGMENTS = THREADS // LANES
    WARPS = THREADS // 32
    NORM = kind in NORM_KINDS
    PREFETCH = int(t.prefetch) >= 1
    SPAN32 = t.span == 32
    I8 = bool(t.i8)        # activations as digits, summed by dp4a (gemv_digits.py)
    STEP_UNITS = (24 if I8 else 16) * KS   # 16-byte units of staged activations a step
    ACT_WORDS = STEPS * STEP_UNITS * 4
    AT_ONCE = 4 if NORM else 8
    STAGE_ITERS = -(-GROUPS // (WARPS * AT_ONCE))
    EPS = np.float32(eps)
    INV_K = np.float32(1.0 / k)
    NORM_BYTES = 2 * k   # the norm's fp16 weights (norm_to_l2)
    ZERO = np.uint32(0)
    EARLY = bool(t.early)  # step 1's loads before the wait too (prefetch, >= 2 steps: check_tiling)

    def load_row(qw, sc, row, ok, s, j):
        # 16 words of group s*KS+j of weight row `row`, and its scale's bits (zeros if absent)
        gs = KS if s < STEPS - 1 else LAST_GROUPS
        if ok and j < gs:
            c = s * (KS * 16) + j * 4          # word index of chunk (i=0, j) of step s
            a0, a1, a2, a3 = ld_global_nc_v4_u32(qw, (row, c))
            b0, b1, b2, b3 = ld_global_nc_v4_u32(qw, (row, c + gs * 4))
            c0, c1, c2, c3 = ld_global_nc_v4_u32(qw, (row, c + gs * 8))
            d0, d1, d2, d3 = ld_global_nc_v4_u32(qw, (row, c + gs * 12))
            sb = uint32(ld_global_nc_u16(sc, (row, s * KS + j)))
            return (a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, sb)
        return (ZERO, ZERO, ZERO, ZERO, ZERO, ZERO, ZERO, ZERO,
                ZERO, ZERO, ZERO, ZERO, ZERO, ZERO, ZERO, ZERO, ZERO)

    def dot8(q, a, h0, h1):
        # 8 weights of word q times the 8 fp16 activations a (4 pairs), into fp16x2 h0, h1.
        # dequant_word's instructions, each pair's fma right after it: the order every figure
        # in docs/PERF.md was measured with (calling dequant_word gives the same values but
        # another PTX order and SASS schedule; compare on the device before switching)
        lo0 = lop3_b32(q, _MASK_LO, _MAGIC_LO, LUT_AND_XOR)
        hi0 = lop3_b32(q, _MASK_HI, _MAGIC_HI, LUT_AND_XOR)
        q8 = q >> _SH8
        lo1 = lop3_b32(q8, _MASK_LO, _MAGIC_LO, LUT_AND_XOR)
        hi1 = lop3_b32(q8, _MASK_HI, _MAGIC_HI, LUT_AND_XOR)
        h0 = fma_rn_f16x2(add_rn_f16x2(lo0, _NEG1032), a[0], h0)
        h1 = fma_rn_f16x2(fma_rn_f16x2(hi0, _SIXTEENTH, _NEG72), a[1], h1)
        h0 = fma_rn_f16x2(add_rn_f16x2(lo1, _NEG1032), a[2], h0)
        h1 = fma_rn_f16x2(fma_rn_f16x2(hi1, _SIXTEENTH, _NEG72), a[3], h1)
        return h0, h1

    def load_act(abase, u):
        # the activations of one chunk: word t's 8 fp16 are unit u + t*KS (16 bytes each).
        # abase is the staged array's 32-bit shared address, so the offsets stay 32-bit and
        # ptxas folds the constant ones into the loads (LDS.128 R, [R+imm]); with &act[idx]
        # each load paid a 64-bit add (down: 380 -> 333 instructions a step, -0.048 ms a token)
        a = abase + uint32(u) * uint32(16)
        return (ld_shared_v4_u32_at(a), ld_shared_v4_u32_at(a + uint32(KS * 16)),
                ld_shared_v4_u32_at(a + uint32(2 * KS * 16)),
                ld_shared_v4_u32_at(a + uint32(3 * KS * 16)))

    def to_f32(h0, h1):
        if SPAN32:  # 16 products per fp16 lane: h0 + h1 <= 16*1792 cannot overflow
            lo, hi = unpack_f16x2_to_f32(add_rn_f16x2(h0, h1))
            return lo + hi
        a, b = unpack_f16x2_to_f32(h0)  # 32 products each: add in fp32
        c, d = unpack_f16x2_to_f32(h1)
        return (a + b) + (c + d)

    def chunk(q0, q1, q2, q3, a, st):
        # one 16-byte chunk (32 weights) of one row; st = (h0, h1, p): fp16x2 partials, fp32 sum
        h0, h1, p = st
        h0, h1 = dot8(q0, a[0], h0, h1)
        h0, h1 = dot8(q1, a[1], h0, h1)
        h0, h1 = dot8(q2, a[2], h0, h1)
        h0, h1 = dot8(q3, a[3], h0, h1)
        if SPAN32:
            return ZERO, ZERO, p + to_f32(h0, h1)
        return h0, h1, p

    def scaled(st, sbits, fi):
        # a row's group sum in fp32, times its weight scale and the activations' 1/f_g
        h0, h1, p = st
        if not SPAN32:
            p = to_f32(h0, h1)
        return p * (cvt_f32_f16(sbits) * fi)

    def dot_step(cur, abase, u, fi):
        """The thread's SLOTS rows times one group of activations (chunk-major: each chunk's
        activations are read from shared once and used by every row).  Written out, not
        looped: tuple elements need literal indices to stay in registers."""
        r0, r1, r2, r3 = cur
        z = (ZERO, ZERO, float32(0.0))
        sts = (z, z, z, z)
        sts = rows_chunk(r0[0:4], r1[0:4], r2[0:4], r3[0:4], load_act(abase, u), sts)
        sts = rows_chunk(r0[4:8], r1[4:8], r2[4:8], r3[4:8], load_act(abase, u + 4 * KS), sts)
        sts = rows_chunk(r0[8:12], r1[8:12], r2[8:12], r3[8:12], load_act(abase, u + 8 * KS), sts)
        sts = rows_chunk(r0[12:16], r1[12:16], r2[12:16], r3[12:16],
                         load_act(abase, u + 12 * KS), sts)
        s0, s1, s2, s3 = sts
        return (scaled(s0, r0[16], fi), scaled(s1, r1[16], fi),
                scaled(s2, r2[16], fi), scaled(s3, r3[16], fi))

    def weight_row(row0, m):
        # weight row of a thread's m-th row slot: gate_up stacks [gate; up], up rows at +n_out;
        # qkv_rope: row0 = 2p for RoPE pair p, rows i and i + D/2 of head p // (D/2), i = p % (D/2)
        # (row0 < n_out iff the pair exists, so the bounds checks of the row slots stand)
        if MATS == 2:
            return row0 + (m % ROWS) + (m // ROWS) * n_out
        if ROPE:
            p = row0 >> 1
            return (p // HALF) * D + p % HALF + m * HALF
        return row0 + m

    def load_step(qw, sc, row0, s, j):
        r0 = load_row(qw, sc, weight_row(row0, 0), row0 < n_out, s, j)
        r1 = r0
        r2 = r0
        r3 = r0
        if SLOTS >= 2:
            r1 = load_row(qw, sc, weight_row(row0, 1), row0 + (1 % ROWS) < n_out, s, j)
        if SLOTS >= 3:
            r2 = load_row(qw, sc, weight_row(row0, 2), row0 + (2 % ROWS) < n_out, s, j)
        if SLOTS >= 4:
            r3 = load_row(qw, sc, weight_row(row0, 3), row0 + (3 % ROWS) < n_out, s, j)
        return r0, r1, r2, r3

    def piece_load(xin, norm_w, g, lane):
        # a lane's 4 inputs of group g (clamped into range: a spare load beats a branch)
        base = min(g, GROUPS - 1) * GROUP_SIZE + lane * 4
        if NORM:
            x0, x1, x2, x3 = ld_global_nc_v4_f32(xin, base)
            w01, w23 = ld_global_nc_v2_u32(norm_w, base)
            return x0, x1, x2, x3, w01, w23
        a01, a23 = ld_global_nc_v2_u32(xin, base)
        z = float32(0.0)
        return z, z, z, z, a01, a23

    def four_values(pc):
        # a lane's four loaded inputs as the values to stage (x * norm_w, or a) and its sum of x^2
        x0, x1, x2, x3, w01, w23 = pc
        n0, n1 = unpack_f16x2_to_f32(w01)
        n2, n3 = unpack_f16x2_to_f32(w23)
        if NORM:
            ss = x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3
            return x0 * n0, x1 * n1, x2 * n2, x3 * n3, ss
        return n0, n1, n2, n3, float32(0.0)

    def piece_put(pc, g, lane, act, invf):
        # scale group g by its power of two, store it permuted; returns the lane's sum of x^2
        p0, p1, p2, p3, ss = four_values(pc)
        m = wmax(max(max(abs(p0), abs(p1)), max(abs(p2), abs(p3))))
        f, fi = pow2_scale(m)
        if g >= GROUPS:
            return float32(0.0)
        s = g // KS
        u = ((s * 4 + (lane >> 3)) * 4 + ((lane >> 1) & 3)) * KS + (g - s * KS)
        w = u * 4 + (lane & 1) * 2
        act[w] = pack_f16x2_from_f32(p0 * f, p1 * f)
        act[w + 1] = pack_f16x2_from_f32(p2 * f, p3 * f)
        if lane == 0:
            invf[g] = fi
        return ss

    def stage(xin, norm_w, act, invf, red):
        """Stage the activations (fp16, or digits with i8: p_load / p_put), pre-scaled by f_g, in
        the order the dot reads them; rstd.

        A warp owns groups warp, warp + WARPS, ...; it issues the loads of AT_ONCE groups
        before using any (one group per iteration made the prologue a chain of L2 latencies:
        ~0.4 us each, 19 of them for down_proj, measured as 2.5x its streaming time)."""
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        ss = float32(0.0)
        for it in range(STAGE_ITERS):
            g0 = it * AT_ONCE * WARPS + warp
            c0 = p_load(xin, norm_w, g0, lane)
            c1 = p_load(xin, norm_w, g0 + WARPS, lane)
            c2 = p_load(xin, norm_w, g0 + 2 * WARPS, lane)
            c3 = p_load(xin, norm_w, g0 + 3 * WARPS, lane)
            c4 = c5 = c6 = c7 = c0
            if AT_ONCE == 8:
                c4 = p_load(xin, norm_w, g0 + 4 * WARPS, lane)
                c5 = p_load(xin, norm_w, g0 + 5 * WARPS, lane)
                c6 = p_load(xin, norm_w, g0 + 6 * WARPS, lane)
                c7 = p_load(xin, norm_w, g0 + 7 * WARPS, lane)
            ss += p_put(c0, g0, lane, act, invf)
            ss += p_put(c1, g0 + WARPS, lane, act, invf)
            ss += p_put(c2, g0 + 2 * WARPS, lane, act, invf)
            ss += p_put(c3, g0 + 3 * WARPS, lane, act, invf)
            if AT_ONCE == 8:
                ss += p_put(c4, g0 + 4 * WARPS, lane, act, invf)
                ss += p_put(c5, g0 + 5 * WARPS, lane, act, invf)
                ss += p_put(c6, g0 + 6 * WARPS, lane, act, invf)
                ss += p_put(c7, g0 + 7 * WARPS, lane, act, invf)
        rstd = float32(1.0)
        if NORM:
            ss = wsum(ss)
            if lane == 0:
                red[warp] = ss
        cuda.syncthreads()
        if NORM:
            rstd = rstd_of(red, WARPS, INV_K, EPS)
        return rstd

    def seg_sum(v):
        # butterfly over the LANES lanes of a segment (LANES divides 32: lanes never leave it)
        off = LANES >> 1
        while off > 0:
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, off)
            off >>= 1
        return v

    def mainloop(qw, sc, act, invf, row0, j, cur, nxt1):
        """fp32 dot products of the thread's SLOTS weight rows over its groups, lane-partial.
        cur: step 0's loads (issued before the prologue); nxt1: with EARLY, step 1's (too)."""
        # prefetch=2 (two steps in flight): lost, down +0.033 ms a step, qkv/o_proj +0.055; code at 13c221c
        nxt = cur
        abase = cvta_to_shared_u32(act)
        acc0 = float32(0.0)
        acc1 = float32(0.0)
        acc2 = float32(0.0)
        acc3 = float32(0.0)
        for s in range(STEPS):
            if PREFETCH and s + 1 < STEPS:
                if EARLY and s == 0:
                    nxt = nxt1
                else:
                    nxt = load_step(qw, sc, row0, s + 1, j)
            g = s * KS + j
            if g < GROUPS and j < KS:
                d0, d1, d2, d3 = dot(cur, abase, s * STEP_UNITS + j, invf[g])
                acc0 += d0
                acc1 += d1
                acc2 += d2
                acc3 += d3
            if s + 1 < STEPS:
                if PREFETCH:
                    cur = nxt
                else:
                    cur = load_step(qw, sc, row0, s + 1, j)
        return seg_sum(acc0), seg_sum(acc1), seg_sum(acc2), seg_sum(acc3)

    def first_loads(qw, sc, row0, j):
        """What goes out before the wait: step 0's loads, and with EARLY step 1's (else step
        0's again, unused)."""
        cur = load_step(qw, sc, row0, 0, j)
        nxt1 = load_step(qw, sc, row0, 1, j) if EARLY else cur
        return cur, nxt1

    def early():
        """Programmatic dependent launch (nq/ptx/griddep.py): wait for the kernel before,
        then let the next one launch.  The caller has already issued its step-0 weight loads,
        which depend on nothing upstream."""
        # l2_steps (L2 prefetch of a row's first steps here): lost, qkv/o_proj +0.005 ms a step; code at 13c221c
        # ahead (blocks 0..E-1 pulling the whole matrix into L2 beside the kernel before): lost,
        # qkv_rope +0.02..+0.05 ms a step for E = 20..144; code at 7b9d142 (docs/PERF.md)
        griddepcontrol_wait()
        griddepcontrol_launch_dependents()

    def norm_to_l2(norm_w):
        # the norm's weights (K fp16: DRAM, evicted by the step's other weights since the last
        # step) pulled into L2 before the wait, so that the staging after it waits on L2 only
        if cuda.threadIdx.x == 0:
            cp_async_bulk_prefetch_l2(norm_w, 0, NORM_BYTES)

    def start():
        # (the thread's first output row, its lane in the row's segment)
        tid = cuda.threadIdx.x
        j = tid % LANES
        row0 = (cuda.blockIdx.x * SEGMENTS + tid // LANES) * ROWS
        return row0, j

    def put_qkv(out, bias, row, v):
        if row < n_out:
            out[row] = v + cvt_f32_f16(ld_global_nc_u16(bias, row))

    def put_head(out, row, v):
        if row < n_out:
            out[row] = v

    def put_swiglu(out, row, gt, up):
        if row < n_out:
            y = gt / (float32(1.0) + math.exp(-gt)) * up
            st_global_u16(out, row, cvt_rn_f16_f32(y))

    def put_residual(x, row, v):
        if row < n_out:
            x[row] += v

    pow2_scale, wsum, wmax, rstd_of = (dev(f) for f in (pow2_scale_f32, warp_sum, warp_max,
                                                         block_rstd))
    four_values = dev(four_values)
    load_row, dot8, load_act, to_f32, chunk, scaled, dot_step, weight_row, \
        load_step, piece_load, piece_put, stage, seg_sum, mainloop, early, norm_to_l2, start, \
        put_qkv, put_head, put_swiglu, put_residual = (
            dev(f) for f in (load_row, dot8, load_act, to_f32, chunk, scaled,
                             dot_step, weight_row, load_step, piece_load, piece_put, stage,
                             seg_sum, mainloop, early, norm_to_l2, start, put_qkv, put_head,
                             put_swiglu, put_residual))
    rows_chunk = dev(slot_rows(chunk, SLOTS))   # dot_step's (gemv_digits.slot_rows)
    first_loads = dev(first_loads)   # (after load_step's dev)
    # the staging's and the dot's two forms: fp16 (above) or digits (gemv_digits.py)
    p_load, p_put, dot = (digits_body(GROUPS, KS, SLOTS, NORM, four_values) if I8
                          else (piece_load, piece_put, dot_step))
    # (after weight_row's dev)
    put_rope, rope_setup = put_rope_body(n_out, HQ, HKV, D, weight_row)
    put_rope, rope_setup = dev(put_rope), dev(rope_setup)

    if kind == "qkv":
        def kernel(x, norm_w, qw, sc, bias, out):
            act = cuda.shared.array(ACT_WORDS, uint32, alignment=_ALIGN)
            invf = cuda.shared.array(GROUPS, float32)
            red = cuda.shared.array(WARPS, float32)
            row0, j = start()
            cur, nxt1 = first_loads(qw, sc, row0, j)
            norm_to_l2(norm_w)
            early()
            rstd = stage(x, norm_w, act, invf, red)
            acc = mainloop(qw, sc, act, invf, row0, j, cur, nxt1)
            if j == 0:
                a0, a1, a2, a3 = acc
                put_qkv(out, bias, row0, a0 * rstd)
                if ROWS >= 2:
                    put_qkv(out, bias, row0 + 1, a1 * rstd)
                if ROWS >= 3:
                    put_qkv(out, bias, row0 + 2, a2 * rstd)
                if ROWS >= 4:
                    put_qkv(out, bias, row0 + 3, a3 * rstd)
        sig = "void(float32[::1], float16[::1], uint32[:, ::1], float16[:, ::1], float16[::1], float32[::1])"
    elif kind in ("lm_head", "lm_head_bound"):
        # qkv's body without the bias, on a persistent grid (the launcher's: a few blocks an
        # SM): a block stages rmsnorm(x) once, then walks row blocks b, b + gridDim.x, ...,
        # issuing the next one's first loads before this one's stores.  lm_head_bound adds
        # the rescoring's bound pass (nq/kernels/lm_head_rescore.py) to the walk: each
        # writer keeps the max of l_i - bound_i * s over its rows, s = K_SIGMA |h| / sqrt 12,
        # and the block's max goes to bmax[block] (block 0 also writes s to bmax[gridDim]),
        # so the rescoring kernel after it reads gridDim + 1 floats instead of a third kernel
        # reading every logit again.
        BLOCKS = -(-n_out // (SEGMENTS * ROWS))
        BOUND = kind == "lm_head_bound"
        SIGMA = np.float32(K_SIGMA / math.sqrt(12.0))
        NEG_INF = np.float32(-np.inf)

        def h_scale(x, norm_w, rstd, red):
            """K_SIGMA |h| / sqrt 12, h = rmsnorm(x) * norm_w as the rescoring's reference
            computes it: every thread gets it (red: free on entry, the block syncs)."""
            tid = cuda.threadIdx.x
            hh = float32(0.0)
            for e in range(tid, norm_w.shape[0], THREADS):   # (not unrolled: few registers
                h = (x[e] * rstd) * float32(norm_w[e])        # beside the loads in flight)
                hh += h * h
            hh = wsum(hh)
            cuda.syncthreads()                  # every warp has read red (rstd)
            if (tid & 31) == 0:
                red[tid >> 5] = hh
            cuda.syncthreads()
            tot = float32(0.0)
            for w in range(WARPS):
                tot += red[w]
            return SIGMA * math.sqrt(tot)

        def put_row(out, bound, row, v, m, s):
            # put_head's store; lm_head_bound also folds the row's l - bound * s into m
            put_head(out, row, v)
            if BOUND and row < n_out:
                m = max(m, v - bound[row] * s)
            return m

        def head(x, norm_w, qw, sc, out, bound, bmax):
            act = cuda.shared.array(ACT_WORDS, uint32, alignment=_ALIGN)
            invf = cuda.shared.array(GROUPS, float32)
            red = cuda.shared.array(WARPS, float32)
            row0, j = start()
            b = cuda.blockIdx.x
            seg_rows = row0 - b * (SEGMENTS * ROWS)   # the thread's first row in any block
            cur, nxt1 = first_loads(qw, sc, row0, j)
            norm_to_l2(norm_w)
            early()
            rstd = stage(x, norm_w, act, invf, red)
            s = h_scale(x, norm_w, rstd, red) if BOUND else float32(0.0)
            m = NEG_INF
            while b < BLOCKS:
                acc = mainloop(qw, sc, act, invf, row0, j, cur, nxt1)
                b += cuda.gridDim.x
                nrow0 = b * (SEGMENTS * ROWS) + seg_rows
                if b < BLOCKS:
                    cur, nxt1 = first_loads(qw, sc, nrow0, j)
                if j == 0:
                    a0, a1, a2, a3 = acc
                    m = put_row(out, bound, row0, a0 * rstd, m, s)
                    if ROWS >= 2:
                        m = put_row(out, bound, row0 + 1, a1 * rstd, m, s)
                    if ROWS >= 3:
                        m = put_row(out, bound, row0 + 2, a2 * rstd, m, s)
                    if ROWS >= 4:
                        m = put_row(out, bound, row0 + 3, a3 * rstd, m, s)
                row0 = nrow0
            if BOUND:   # the block's max (the lanes j != 0 hold -inf)
                m = wmax(m)
                cuda.syncthreads()              # red (h_scale's) is read by every warp
                if (cuda.threadIdx.x & 31) == 0:
                    red[cuda.threadIdx.x >> 5] = m
                cuda.syncthreads()
                if cuda.threadIdx.x == 0:
                    for w in range(1, WARPS):
                        m = max(m, red[w])
                    bmax[cuda.blockIdx.x] = m
                    if cuda.blockIdx.x == 0:
                        bmax[cuda.gridDim.x] = s

        h_scale, put_row, head = dev(h_scale), dev(put_row), dev(head)
        if BOUND:
            def kernel(x, norm_w, qw, sc, out, bound, bmax):
                head(x, norm_w, qw, sc, out, bound, bmax)
            sig = ("void(float32[::1], float16[::1], uint32[:, ::1], float16[:, ::1], "
                   "float32[::1], float32[::1], float32[::1])")
        else:
            def kernel(x, norm_w, qw, sc, out):
                head(x, norm_w, qw, sc, out, out, out)
            sig = "void(float32[::1], float16[::1], uint32[:, ::1], float16[:, ::1], float32[::1])"
    elif kind == "qkv_rope":
        def kernel(x, norm_w, qw, sc, bias, state, inv_freq, table, kv, q_out):
            act = cuda.shared.array(ACT_WORDS, uint32, alignment=_ALIGN)
            invf = cuda.shared.array(GROUPS, float32)
            red = cuda.shared.array(WARPS, float32)
            row0, j = start()
            cur, nxt1 = first_loads(qw, sc, row0, j)
            norm_to_l2(norm_w)
            # the epilogue's inputs but the sums, before the wait (rope_epilogue.rope_setup)
            pre = rope_setup(bias, state, inv_freq, table, row0)
            early()
            rstd = stage(x, norm_w, act, invf, red)
            acc = mainloop(qw, sc, act, invf, row0, j, cur, nxt1)
            if j == 0:
                a0, a1, a2, a3 = acc
                put_rope(kv, q_out, row0, a0 * rstd, a1 * rstd, pre)
        sig = ("void(float32[::1], float16[::1], uint32[:, ::1], float16[:, ::1], float16[::1], "
               "int32[::1], float32[::1], int32[::1], float16[:, :, :, :, ::1], float32[::1])")
    elif kind == "gate_up":
        def kernel(x, norm_w, qw, sc, out):
            act = cuda.shared.array(ACT_WORDS, uint32, alignment=_ALIGN)
            invf = cuda.shared.array(GROUPS, float32)
            red = cuda.shared.array(WARPS, float32)
            row0, j = start()
            cur, nxt1 = first_loads(qw, sc, row0, j)
            norm_to_l2(norm_w)
            early()
            rstd = stage(x, norm_w, act, invf, red)
            acc = mainloop(qw, sc, act, invf, row0, j, cur, nxt1)
            if j == 0:
                a0, a1, a2, a3 = acc
                if ROWS == 1:
                    put_swiglu(out, row0, a0 * rstd, a1 * rstd)
                else:  # ROWS == 2: rows (g0, g1, u0, u1)
                    put_swiglu(out, row0, a0 * rstd, a2 * rstd)
                    put_swiglu(out, row0 + 1, a1 * rstd, a3 * rstd)
        sig = "void(float32[::1], float16[::1], uint32[:, ::1], float16[:, ::1], float16[::1])"
    else:
        def kernel(a, qw, sc, x):
            act = cuda.shared.array(ACT_WORDS, uint32, alignment=_ALIGN)
            invf = cuda.shared.array(GROUPS, float32)
            red = cuda.shared.array(WARPS, float32)
            row0, j = start()
            cur, nxt1 = first_loads(qw, sc, row0, j)
            early()
            stage(a, a, act, invf, red)
            acc = mainloop(qw, sc, act, invf, row0, j, cur, nxt1)
            if j == 0:
                a0, a1, a2, a3 = acc
                put_residual(x, row0, a0)
                if ROWS >= 2:
                    put_residual(x, row0 + 1, a1)
                if ROWS >= 3:
                    put_residual(x, row0 + 2, a2)
                if ROWS >= 4:
                    put_residual(x, row0 + 3, a3)
        sig = "void(float16[::1], uint32[:, ::1], float16[:, ::1], float32[::1])"
    return kernel, sig
