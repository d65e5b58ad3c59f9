"""INT4 GEMVs with the dot products on the tensor cores: o_proj and down (x += W . a) and
gate_up (silu(Wg . h) * (Wu . h), h = rmsnorm(x)).

Why: ncu reads the CUDA-core GEMV (gemv_int4) for down as issue-bound, not memory-bound (0.61
instructions issued a cycle per scheduler, DRAM at 38 % of peak; docs/KERNELS_GEMV.md).  Per 8
weights it spends 9 instructions turning nibbles into fp16 pairs and 4 fma.f16x2 multiplying
them with activations it read from shared memory (one 16-byte load a word).  Here the same 9
dequant instructions build the A fragment of one `mma.sync.m16n8k16` (fp16 in, fp32 out),
which replaces the 4 fmas, and one 8-byte B fragment of activations serves the 16 rows of the
tile: ~10 instructions per 8 weights instead of ~14.  The default for o_proj and down
(`gemv_int4.mma_tiling`; the 7B step -0.14 ms, docs/KERNELS_GEMV.md); gate_up here lost on
the H200, so it is opt-in (`Tiling(mma=True)`), as are `prefetch=2` (two groups' loads in
flight instead of one: down +0.04 ms a step) and `splits` (split-K over blocks with a
deterministic last-block combine: down +0.04..+0.17 ms).

The fragment layout decides the weight layout (`mma_layout`, a NumPy model; the kernel's loads
mirror it).  With g = lane // 4 and t = lane % 4, lane (g, t) of a 16-row tile holds for each
16-column chunk of K the word whose nibble slots are

    slot 0, 4: W[g,   2t], W[g,   2t+1]      -> (q & 0x000F000F) ^ 0x64086408 - 1032  = a0
    slot 1, 5: W[g+8, 2t], W[g+8, 2t+1]      -> (q & 0x00F000F0) ^ 0x64806480, fma    = a1
    slot 2, 6: W[g,   2t+8], W[g,   2t+9]    -> the same on q >> 8                    = a2
    slot 3, 7: W[g+8, 2t+8], W[g+8, 2t+9]                                             = a3

so the dequant is gemv_int4's, instruction for instruction (nq/ptx/mma.py has the fragment
coordinates).  Memory order: [tile][group][lane][8 words] -- a group (128 columns = 8 chunks)
of a tile is 1 KB, each lane's 32 bytes of it two 16-byte loads.  Scales stay in the file's
(N, K/128) layout (a lane reads rows g and g+8).

gate_up's warp holds a tile of gate rows and the same rows of up (the stacked matrix's tile
+ N/16), so each B fragment serves 32 rows; its activations are staged as gemv_int4 stages
them (x * norm_w times a power of two f_g per group that puts the group's absmax in [128,
256): exact, and fp16 cannot overflow), the group sums are scaled by 1/f_g, the rows by rstd.

A block is TILES = threads / 32 / ks row tiles of 16 rows; the `ks` warps of a tile split its
groups (warp w: groups w, w + ks, ...), each accumulating fp32 `mma(A, B) * scale` per group
(the products of fp16 are exact, the sums fp32: closer to the fp64 reference than gemv_int4's
fp16 partials).  The block stages `a` in shared memory once, in B-fragment order: chunk c,
lane t reads the 8 bytes (a[16c+2t : 16c+2t+2], a[16c+2t+8 : 16c+2t+10]).  B's 8 columns are
all `a` (lanes with the same t load the same bytes), so every column of D is the dot product
and lane (g, t) holds rows g (d0) and g+8 (d2).  The ks warps' partials meet in shared memory
and one thread a row adds them in a fixed order: deterministic, one writer per x element.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint32

from nq.config import GROUP_SIZE, ModelConfig
from nq.kernels.int4.dequant import dequant_word, pow2_scale_f32
from nq.kernels.int4.gemv import Tiling, _need, ref_o_proj
from nq.kernels.int4.layout import CHUNK, TILE, mma_layout, mma_unlayout  # noqa: F401
from nq.kernels.common import block_rstd, dev, warp_max, warp_sum
from nq.ptx import (SIMULATOR, cvt_f32_f16, cvt_rn_f16_f32, cvta_to_shared_u32,
                    griddepcontrol_launch_dependents, griddepcontrol_wait, ld_global_nc_u16,
                    ld_global_nc_v2_u32, ld_global_nc_v4_f32, ld_global_nc_v4_u32,
                    ld_shared_v2_u32_at, mma_sync_m16n8k16_f16_f32, pack_f16x2_from_f32,
                    st_global_u16, unpack_f16x2_to_f32)

KINDS = ("o_proj", "down", "gate_up")
ref_residual = ref_o_proj   # x + W . a, both kinds


# ---- the kernel ----------------------------------------------------------------------------------

def check_tiling(n_out: int, k: int, t: Tiling) -> None:
    kw = t.ks
    if not t.mma:
        raise ValueError(f"gemv_mma: tiling {t.tag()} is not an mma tiling (Tiling(mma=True))")
    if n_out % TILE or k % GROUP_SIZE:
        raise ValueError(f"gemv_mma: N={n_out} must be a multiple of {TILE} (an mma tile) and "
                         f"K={k} of {GROUP_SIZE}")
    if kw < 1 or t.threads % (32 * kw) or t.threads > 1024 or int(t.prefetch) not in (1, 2):
        raise ValueError(f"gemv_mma: tiling {t.tag()}: threads must be a multiple of 32*ks "
                         f"(ks = warps a tile's groups are split over), at most 1024, and "
                         f"prefetch 1 or 2 (groups whose loads are in flight ahead of the math)")
    if t.rows != 1 or t.block_major or t.bulk or t.stream or t.l2_steps:
        raise ValueError(f"gemv_mma: tiling {t.tag()}: rows, block_major, bulk, stream and "
                         f"l2_steps are gemv_int4's; an mma tiling takes ks, threads, prefetch "
                         f"and min_blocks")
    if k * 2 > 48 * 1024:
        raise ValueError(f"gemv_mma: K={k} needs {k * 2} bytes of staged activations, over the "
                         f"48 KB static shared memory limit")
    if t.splits < 1 or t.splits > k // GROUP_SIZE:
        raise ValueError(f"gemv_mma: tiling {t.tag()}: splits must be 1..{k // GROUP_SIZE} (the "
                         f"blocks a tile's {k // GROUP_SIZE} groups are split over)")


@functools.lru_cache(maxsize=None)
def build_kernel(kind: str, n_out: int, k: int, t: Tiling, eps: float = 1e-6):
    """The cuda.jit kernel body and its signature.  o_proj / down: x (N,) fp32 += W . a, a (K,)
    fp16.  gate_up: out (I,) fp16 = silu(Wg . h) * (Wu . h), h = rmsnorm(x, norm_w), with the
    weights [gate; up] stacked (2I rows): a warp's tile of gate rows and the same rows of up
    share each B fragment."""
    if kind not in KINDS:
        raise ValueError(f"gemv_mma: kind {kind!r} is not one of {KINDS}")
    check_tiling(n_out, k, t)
    KW = t.ks
    TPB = t.threads
    WARPS = TPB // 32
    TILES = WARPS // KW
    G = k // GROUP_SIZE
    NT = n_out // TILE
    NMAT = 2 if kind == "gate_up" else 1
    S = int(t.splits)                 # split-K: blocks a tile's groups are split over
    if S > 1 and NMAT == 2:
        raise ValueError("gemv_mma: splits is for o_proj and down (x += W . a); gate_up's "
                         "SwiGLU needs a row's whole sums")
    GS = -(-G // S)                   # groups of a split (the last may be short)
    PF2 = int(t.prefetch) == 2        # two groups' loads in flight ahead of the math, not one
    NPAIR = -(-GS // (2 * KW))        # two-group iterations of a warp (the last may be short)
    NTRIP = -(-GS // (3 * KW))        # PF2: three-group iterations
    CHS = GS * (GROUP_SIZE // CHUNK)  # k16 chunks a block stages (its split's)
    AW = CHS * 8                      # staged activation words (fp16 pairs)
    RED = TILES * KW * TILE * NMAT    # the warps' row partials
    STAGE = -(-CHS // TPB)            # residual kinds: chunks a thread stages
    NSTAGE = -(-G // WARPS)           # gate_up: groups a warp stages
    EPS = np.float32(eps)
    INV_K = np.float32(1.0 / k)

    def load_group(qw, sc, wbase, sbase, grp):
        # the lane's 8 words of group grp of its tile (words from wbase, 256 a group) and the
        # scale bits of its rows g (scales from sbase) and g + 8 (8 rows of G further)
        base = wbase + grp * 256
        w0, w1, w2, w3 = ld_global_nc_v4_u32(qw, base)
        w4, w5, w6, w7 = ld_global_nc_v4_u32(qw, base + 4)
        s0 = uint32(ld_global_nc_u16(sc, sbase + grp))
        s1 = uint32(ld_global_nc_u16(sc, sbase + 8 * G + grp))
        return (w0, w1, w2, w3, w4, w5, w6, w7, s0, s1)

    def dequant_mma(q, b0, b1, d):
        # one k16 chunk: the word's 8 weights as the A fragment (gemv_int4's dequant), times B
        a0, a1, a2, a3 = dequant(q)
        return mma_sync_m16n8k16_f16_f32(a0, a1, a2, a3, b0, b1, d[0], d[1], d[2], d[3])

    def chunk(qa, qb, baddr, da, db):
        # the chunk's B fragment, loaded once, against the tile (and, gate_up, the up tile)
        b0, b1 = ld_shared_v2_u32_at(baddr)
        da = dequant_mma(qa, b0, b1, da)
        if NMAT == 2:
            db = dequant_mma(qb, b0, b1, db)
        return da, db

    def group_dot(ca, cb, abase, grp, t4):
        """Rows g and g+8 of one group (and of the up tile, gate_up), fp32, times their weight
        scales.  Written out, not looped: tuple elements need literal indices to stay in
        registers.  cb is the up tile's loads (gate_up) or ca again (unused)."""
        z = float32(0.0)
        da = (z, z, z, z)
        db = da
        b = abase + uint32(grp * (GROUP_SIZE // CHUNK) * 32) + uint32(t4 * 8)  # chunk stride 32 B
        da, db = chunk(ca[0], cb[0], b, da, db)
        da, db = chunk(ca[1], cb[1], b + uint32(32), da, db)
        da, db = chunk(ca[2], cb[2], b + uint32(64), da, db)
        da, db = chunk(ca[3], cb[3], b + uint32(96), da, db)
        da, db = chunk(ca[4], cb[4], b + uint32(128), da, db)
        da, db = chunk(ca[5], cb[5], b + uint32(160), da, db)
        da, db = chunk(ca[6], cb[6], b + uint32(192), da, db)
        da, db = chunk(ca[7], cb[7], b + uint32(224), da, db)
        return (da[0] * cvt_f32_f16(ca[8]), da[2] * cvt_f32_f16(ca[9]),
                db[0] * cvt_f32_f16(cb[8]), db[2] * cvt_f32_f16(cb[9]))

    def stage_fp16(a, act, c0, c1):
        # chunks c0..c1-1 (the block's split); chunk c's 8 fp16 pairs p0..p7 stored as
        # (p0 p4)(p1 p5)(p2 p6)(p3 p7) at word 8 (c - c0): lane t's B fragment (b0 = pair t,
        # b1 = pair t + 4) is then 8 contiguous bytes
        for it in range(STAGE):
            c = c0 + it * TPB + cuda.threadIdx.x
            if c < c1:
                p0, p1, p2, p3 = ld_global_nc_v4_u32(a, c * CHUNK)
                p4, p5, p6, p7 = ld_global_nc_v4_u32(a, c * CHUNK + 8)
                w = (c - c0) * 8
                act[w] = p0
                act[w + 1] = p4
                act[w + 2] = p1
                act[w + 3] = p5
                act[w + 4] = p2
                act[w + 5] = p6
                act[w + 6] = p3
                act[w + 7] = p7

    def stage_norm(x, norm_w, act, invf, ssum):
        """gate_up: stage x * norm_w in the same order, each group multiplied by the power of
        two f_g that puts its absmax in [128, 256) (exact; fp16 cannot overflow whatever x
        holds; invf[g] = 1/f_g undoes it in fp32), and return rstd.  A warp stages groups
        warp, warp + WARPS, ...; lane l holds the group's values 4l..4l+3: pairs 2(l%4) and
        2(l%4)+1 of chunk l//4, which land at words 2j (j < 4) or 2(j-4)+1 of the chunk."""
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        ss = float32(0.0)
        for it in range(NSTAGE):
            grp = it * WARPS + warp
            base = min(grp, G - 1) * GROUP_SIZE + lane * 4
            x0, x1, x2, x3 = ld_global_nc_v4_f32(x, base)
            w01, w23 = ld_global_nc_v2_u32(norm_w, base)
            n0, n1 = unpack_f16x2_to_f32(w01)
            n2, n3 = unpack_f16x2_to_f32(w23)
            p0, p1, p2, p3 = x0 * n0, x1 * n1, x2 * n2, x3 * n3
            m = wmax(max(max(abs(p0), abs(p1)), max(abs(p2), abs(p3))))
            f, fi = pow2_scale(m)
            if grp < G:
                ss += x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3
                j = (lane & 3) * 2          # the lane's first pair in its chunk (0, 2, 4, 6)
                w = (grp * (GROUP_SIZE // CHUNK) + (lane >> 2)) * 8 + (2 * j if j < 4 else 2 * j - 7)
                act[w] = pack_f16x2_from_f32(p0 * f, p1 * f)
                act[w + 2] = pack_f16x2_from_f32(p2 * f, p3 * f)   # pair j + 1: two words on
                if lane == 0:
                    invf[grp] = fi
        ss = wsum(ss)
        if lane == 0:
            ssum[warp] = ss
        cuda.syncthreads()
        return rstd_of(ssum, WARPS, INV_K, EPS)

    def add_group(acc, ca, cb, abase, grp, t4, invf, gend):
        # acc + group grp's sums (none from gend, the split's end; gate_up's undo f_g)
        a0, a1, a2, a3 = acc
        if grp < gend:
            v0, v1, v2, v3 = group_dot(ca, cb, abase, grp, t4)
            fi = invf[grp] if NMAT == 2 else float32(1.0)
            a0 += v0 * fi
            a1 += v1 * fi
            a2 += v2 * fi
            a3 += v3 * fi
        return a0, a1, a2, a3

    def load_both(qw, sc, wa, sa, wb, sb, grp):
        # group grp's loads of the warp's tile and (gate_up) of the up tile; else the same twice
        xa = load_group(qw, sc, wa, sa, grp)
        xb = xa
        if NMAT == 2:
            xb = load_group(qw, sc, wb, sb, grp)
        return xa, xb

    def mainloop(qw, sc, abase, wa, sa, wb, sb, kw, t4, ca, cb, invf, gend):
        """The warp's groups kw, kw + KW, ... below gend (kw: absolute, the split's first group
        plus the warp's share), two an iteration, into two register sets that take turns (no
        copies): each group's loads are issued a group ahead of its math.  The conditions are
        the same for the whole warp: the mma sees all 32 lanes.  ca/cb: the first group's
        loads (issued before griddepcontrol.wait)."""
        z = float32(0.0)
        acc = (z, z, z, z)
        for it in range(NPAIR):
            ga = kw + 2 * it * KW
            gb = ga + KW
            na, nb = load_both(qw, sc, wa, sa, wb, sb, min(gb, gend - 1))
            acc = add_group(acc, ca, cb, abase, ga, t4, invf, gend)
            ca, cb = load_both(qw, sc, wa, sa, wb, sb, min(gb + KW, gend - 1))
            acc = add_group(acc, na, nb, abase, gb, t4, invf, gend)
        return acc

    def mainloop_pf2(qw, sc, abase, wa, sa, wb, sb, kw, t4, ca, cb, na, nb, invf, gend):
        """mainloop with two groups' loads in flight at each group's math: three register sets
        (c, n, x) take turns, three groups an iteration.  ca/cb and na/nb: the warp's first two
        groups' loads (issued before griddepcontrol.wait)."""
        z = float32(0.0)
        acc = (z, z, z, z)
        for it in range(NTRIP):
            g0 = kw + 3 * it * KW
            g1 = g0 + KW
            g2 = g1 + KW
            xa, xb = load_both(qw, sc, wa, sa, wb, sb, min(g2, gend - 1))
            acc = add_group(acc, ca, cb, abase, g0, t4, invf, gend)
            ca, cb = load_both(qw, sc, wa, sa, wb, sb, min(g2 + KW, gend - 1))
            acc = add_group(acc, na, nb, abase, g1, t4, invf, gend)
            na, nb = load_both(qw, sc, wa, sa, wb, sb, min(g2 + 2 * KW, gend - 1))
            acc = add_group(acc, xa, xb, abase, g2, t4, invf, gend)
        return acc

    def first_loads(qw, sc, wa, sa, wb, sb, g0, gend):
        # the warp's first group's loads (PF2: and its second's), for before griddepcontrol.wait:
        # weights depend on nothing upstream
        ca, cb = load_both(qw, sc, wa, sa, wb, sb, min(g0, gend - 1))
        na, nb = ca, cb
        if PF2:
            na, nb = load_both(qw, sc, wa, sa, wb, sb, min(g0 + KW, gend - 1))
        return ca, cb, na, nb

    def run_loop(qw, sc, abase, wa, sa, wb, sb, g0, t4, first, invf, gend):
        # the tiling's main loop over the warp's groups g0, g0 + KW, ... below gend
        ca, cb, na, nb = first
        if PF2:
            return mainloop_pf2(qw, sc, abase, wa, sa, wb, sb, g0, t4, ca, cb, na, nb, invf, gend)
        return mainloop(qw, sc, abase, wa, sa, wb, sb, g0, t4, ca, cb, invf, gend)

    def roles():
        # (lane, g, t, the warp's tile in the block, its share kw, the tile clamped into the
        # matrix: the last block's spare tile loads words that exist and is not written, the
        # block's tile block tb and split sl: blocks tb*S .. tb*S + S-1 share the tiles)
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        tl = warp // KW
        tb = cuda.blockIdx.x // S
        tile = min(tb * TILES + tl, NT - 1)
        return lane, lane >> 2, lane & 3, tl, warp - tl * KW, tile, tb, cuda.blockIdx.x - tb * S

    def tile_bases(tile, lane, g):
        # where the lane's words of a tile start (256 a group) and its row g's scales
        return (tile * G * 32 + lane) * 8, (tile * TILE + g) * G

    def out_row(tb):
        # the epilogue's thread: (tile in the block, row in the tile, row of the output); only
        # threads below TILES * TILE have one (row -1 otherwise, or past the matrix)
        tid = cuda.threadIdx.x
        tl2 = tid // TILE
        r = tid % TILE
        row = (tb * TILES + tl2) * TILE + r
        return tl2, r, row if tid < TILES * TILE and row < n_out else -1

    def put_partials(red, tl, kw, g, t4, acc):
        # lane t = 0 of each row pair: the warp's sums of rows g, g+8 (and the up tile's)
        if t4 == 0:
            o = (tl * KW + kw) * TILE * NMAT + g
            red[o] = acc[0]
            red[o + 8] = acc[1]
            if NMAT == 2:
                red[o + TILE] = acc[2]
                red[o + TILE + 8] = acc[3]

    def row_sum(red, tl, r, m):
        # row r of tile tl (matrix m: 0, or 1 for up): the KW warps' partials in a fixed order
        s = float32(0.0)
        for w_ in range(KW):
            s += red[(tl * KW + w_) * TILE * NMAT + m * TILE + r]
        return s

    dequant, pow2_scale = dev(dequant_word), dev(pow2_scale_f32)
    wsum, wmax, rstd_of = dev(warp_sum), dev(warp_max), dev(block_rstd)
    load_group, load_both, dequant_mma, chunk, group_dot, stage_fp16, stage_norm, add_group, \
        mainloop, mainloop_pf2, first_loads, run_loop, roles, tile_bases, out_row, \
        put_partials, row_sum = (
            dev(f) for f in (load_group, load_both, dequant_mma, chunk, group_dot, stage_fp16,
                             stage_norm, add_group, mainloop, mainloop_pf2, first_loads,
                             run_loop, roles, tile_bases, out_row, put_partials, row_sum))

    def residual_sums(a, qw, sc, act, red):
        """o_proj / down up to the warps' partials in `red`: (row, tl2, r, tb, sl) for
        row_sum(red, tl2, r, 0), the row's sum over the block's split; row -1 for threads
        without one."""
        lane, g, t4, tl, kw, tile, tb, sl = roles()
        gbeg = sl * GS                  # the block's split: groups gbeg .. gend - 1
        gend = min(gbeg + GS, G)
        wa, sa = tile_bases(tile, lane, g)
        first = first_loads(qw, sc, wa, sa, wa, sa, gbeg + kw, gend)
        griddepcontrol_wait()
        griddepcontrol_launch_dependents()
        stage_fp16(a, act, gbeg * (GROUP_SIZE // CHUNK), gend * (GROUP_SIZE // CHUNK))
        cuda.syncthreads()
        # group_dot addresses absolute groups; the block staged only its split's
        abase = cvta_to_shared_u32(act) - uint32(gbeg * (GROUP_SIZE // CHUNK) * 32)
        # (red stands in for invf, which only gate_up reads)
        acc = run_loop(qw, sc, abase, wa, sa, wa, sa, gbeg + kw, t4, first, red, gend)
        put_partials(red, tl, kw, g, t4, acc)
        cuda.syncthreads()
        tl2, r, row = out_row(tb)
        return row, tl2, r, tb, sl

    residual_sums = dev(residual_sums)

    if NMAT == 1 and S == 1:
        def kernel(a, qw, sc, x):
            act = cuda.shared.array(AW, uint32, alignment=None if SIMULATOR else 16)
            red = cuda.shared.array(RED, float32)
            row, tl2, r, tb, sl = residual_sums(a, qw, sc, act, red)
            if row >= 0:
                x[row] += row_sum(red, tl2, r, 0)
        sig = "void(float16[::1], uint32[::1], float16[::1], float32[::1])"
    elif NMAT == 1:
        def kernel(a, qw, sc, x, part, count):
            """Split-K: part (S, N) fp32 scratch, count (TB,) int32 arrival counters (zero
            between launches).  As attn_mma's fused combine: every thread's partial store is
            ordered before thread 0's release fence by the barrier, thread 0 counts the block
            in; the last of a tile block's S blocks fences again (acquire), zeroes the counter
            for the next launch, and its threads add the S partials to x in split order, so
            the result does not depend on which block finished last."""
            act = cuda.shared.array(AW, uint32, alignment=None if SIMULATOR else 16)
            red = cuda.shared.array(RED, float32)
            flag = cuda.shared.array(1, int32)
            row, tl2, r, tb, sl = residual_sums(a, qw, sc, act, red)
            if row >= 0:
                part[sl * n_out + row] = row_sum(red, tl2, r, 0)
            cuda.syncthreads()
            if cuda.threadIdx.x == 0:
                last = int32(0)
                cuda.threadfence()   # release: the block's partials, before its arrival
                if cuda.atomic.add(count, tb, 1) == S - 1:
                    count[tb] = 0
                    cuda.threadfence()   # acquire: the other splits' partials
                    last = int32(1)
                flag[0] = last
            cuda.syncthreads()       # and the barrier passes the acquire on to every thread
            if flag[0] != 0 and row >= 0:
                tot = part[row]
                for j in range(1, S):
                    tot += part[j * n_out + row]
                x[row] += tot
        sig = ("void(float16[::1], uint32[::1], float16[::1], float32[::1], float32[::1], "
               "int32[::1])")
    else:
        def kernel(x, norm_w, qw, sc, out):
            act = cuda.shared.array(AW, uint32, alignment=None if SIMULATOR else 16)
            red = cuda.shared.array(RED, float32)
            invf = cuda.shared.array(G, float32)
            ssum = cuda.shared.array(WARPS, float32)
            lane, g, t4, tl, kw, tile, tb, sl = roles()
            wa, sa = tile_bases(tile, lane, g)               # gate rows: tile
            wb, sb = tile_bases(tile + NT, lane, g)          # up rows: the same rows, NT tiles on
            first = first_loads(qw, sc, wa, sa, wb, sb, kw, G)
            griddepcontrol_wait()
            griddepcontrol_launch_dependents()
            rstd = stage_norm(x, norm_w, act, invf, ssum)   # ends with a __syncthreads
            acc = run_loop(qw, sc, cvta_to_shared_u32(act), wa, sa, wb, sb, kw, t4, first, invf,
                           G)
            put_partials(red, tl, kw, g, t4, acc)
            cuda.syncthreads()
            tl2, r, row = out_row(tb)
            if row >= 0:
                gt = row_sum(red, tl2, r, 0) * rstd
                up = row_sum(red, tl2, r, 1) * rstd
                y = gt / (float32(1.0) + math.exp(-gt)) * up     # gemv_int4's put_swiglu
                st_global_u16(out, row, cvt_rn_f16_f32(y))
        sig = "void(float32[::1], float16[::1], uint32[::1], float16[::1], float16[::1])"

    kernel.__name__ = f"gemv_mma_{kind}_n{n_out}_k{k}_{t.tag()}"
    kernel.__qualname__ = kernel.__name__
    return kernel, sig


@functools.lru_cache(maxsize=None)
def _compiled(kind, n_out, k, t, eps):
    pyfunc, sig = build_kernel(kind, n_out, k, t, eps)
    if SIMULATOR:
        return cuda.jit(pyfunc)
    bounds = (t.threads, t.min_blocks) if t.min_blocks else (t.threads,)
    return cuda.jit(sig, launch_bounds=bounds)(pyfunc)


class _MmaGemv:
    """A compiled tensor-core GEMV: gemv_int4's launcher interface (prepare once on the host,
    then call), with its own weight layout (`mma_layout`; upload: `retile.retile_mma`)."""

    kind = ""

    def __init__(self, cfg: ModelConfig, n_out: int, k: int, tiling: Tiling):
        check_tiling(n_out, k, tiling)
        self.n_out, self.k, self.tiling = n_out, k, tiling
        self.n_rows = n_out * (2 if self.kind == "gate_up" else 1)   # weight rows
        self.kernel = _compiled(self.kind, n_out, k, tiling, float(cfg.rms_norm_eps))
        self.block = tiling.threads
        self.smem = 0
        self.tile_blocks = -(-n_out // tiling.rows_per_block())
        self.grid = self.tile_blocks * tiling.splits     # split-K: S blocks a tile block
        self.name = f"gemv_mma_{self.kind}_n{n_out}_k{k}_{tiling.tag()}"

    def prepare(self, parts):
        """[(qweight (Ni, K/8) uint32, scales (Ni, K/128) fp16), ...] in file layout, stacked
        along the rows (gate_up: [gate; up]) -> (qw, sc) to upload."""
        qs, ss = [np.asarray(q) for q, _ in parts], [np.asarray(s) for _, s in parts]
        for q, s in zip(qs, ss):
            if q.dtype != np.uint32 or q.ndim != 2 or q.shape[1] * 8 != self.k:
                raise ValueError(f"{self.name}: qweight must be uint32 (N, {self.k // 8}), got "
                                 f"{q.dtype} {q.shape}")
            if s.dtype != np.float16 or s.shape != (q.shape[0], self.k // GROUP_SIZE):
                raise ValueError(f"{self.name}: scales must be fp16 "
                                 f"{(q.shape[0], self.k // GROUP_SIZE)}, got {s.dtype} {s.shape}")
        q, s = np.concatenate(qs), np.concatenate(ss)
        if q.shape[0] != self.n_rows:
            raise ValueError(f"{self.name}: {q.shape[0]} weight rows, expected {self.n_rows}")
        return mma_layout(q), np.ascontiguousarray(s)

    def _weights(self, qw, sc):
        _need(qw, f"{self.name} qweight", np.uint32, (self.n_rows, self.k // 8))
        _need(sc, f"{self.name} scales", np.float16, (self.n_rows, self.k // GROUP_SIZE), 2)
        return qw.reshape(qw.size), sc.reshape(sc.size)


class ResidualMmaGemv(_MmaGemv):
    """o_proj / down: `g(a, qw, sc, x, stream)`, x fp32 (N,) += W . a, a fp16 (K,)."""

    def __init__(self, kind: str, cfg: ModelConfig, n_out: int, k: int, tiling: Tiling):
        self.kind = kind
        super().__init__(cfg, n_out, k, tiling)
        # split-K: the partials' scratch and the arrival counters, made here (not inside a graph
        # capture) and shared by every launch of this GEMV: launches on one stream run in
        # order, and the last block of a tile block leaves its counter at zero again.  Not
        # for launches of one object on two streams at once.
        self._split = None
        if tiling.splits > 1:
            self._split = (cuda.device_array(tiling.splits * n_out, np.float32),
                           cuda.to_device(np.zeros(self.tile_blocks, np.int32)))

    def __call__(self, a, qw, sc, x, stream=0):
        qw, sc = self._weights(qw, sc)
        _need(a, f"{self.name} a", np.float16, (self.k,), 16)
        _need(x, f"{self.name} x", np.float32, (self.n_out,), 4)
        if self.tiling.splits == 1:
            self.kernel[self.grid, self.block, stream, 0](a, qw, sc, x)
            return
        self.kernel[self.grid, self.block, stream, 0](a, qw, sc, x, *self._split)


class GateUpMmaGemv(_MmaGemv):
    """gate_up: `g(x, norm_w, qw, sc, out, stream)`, out fp16 (I,) = silu(Wg . h) * (Wu . h),
    h = rmsnorm(x, norm_w); prepare([(gate_qw, gate_sc), (up_qw, up_sc)])."""

    kind = "gate_up"

    def __call__(self, x, norm_w, qw, sc, out, stream=0):
        qw, sc = self._weights(qw, sc)
        _need(x, f"{self.name} x", np.float32, (self.k,))
        _need(norm_w, f"{self.name} norm_w", np.float16, (self.k,), 8)
        _need(out, f"{self.name} out", np.float16, (self.n_out,), 2)
        self.kernel[self.grid, self.block, stream, 0](x, norm_w, qw, sc, out)
