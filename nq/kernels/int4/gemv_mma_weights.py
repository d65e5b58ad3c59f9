"""A warp's weights in the tensor-core GEMV (gemv_mma.py's module doc has the why): where
its tile lives (`roles`, `tile_bases`), its group's loads (two 16-byte loads of its 32 bytes
and its rows' two scales), the dequant-mma of a group, the loop over its groups with each
group's loads issued one group ahead, and the two ways of having weights on their way before
griddepcontrol.wait: `early` (a warp's first groups bulk-copied into shared memory) and
`l2ahead` (a warp's next groups asked of L2).  `weight_path(shape)` returns them as device
functions for gemv_mma.build_kernel."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from numba import cuda, float32, int32, uint32, uint64  # module globals: the simulator swaps cuda

from nq.config import GROUP_SIZE
from nq.kernels.common import dev
from nq.kernels.int4.dequant import dequant_word
from nq.kernels.int4.gemv_mma_shape import MmaShape
from nq.kernels.int4.layout import CHUNK
from nq.kernels.int4.tiling import TILE
from nq.ptx import (cp_async_bulk_g2s, cp_async_bulk_prefetch_l2, cp_async_cg_shared_global_16,
                    cp_async_commit_group, cvt_f32_f16, cvta_to_shared_u32, fence_mbarrier_init,
                    ld_global_nc_u16, ld_global_nc_v4_u32, ld_shared_v2_u32_at,
                    ld_shared_v4_u32_at, mbarrier_arrive, mbarrier_arrive_expect_tx,
                    mbarrier_init, mbarrier_wait_parity, mma_sync_m16n8k16_f16_f32,
                    mma_sync_m16n8k32_s8_s32)

FULL = 0xFFFFFFFF
SH4 = np.uint32(4)
HIGH_NIBBLES = np.uint32(0xF0F0F0F0)   # i8: a byte's top nibble, the weight times 16


def weight_path(s: MmaShape) -> SimpleNamespace:
    """The weight side of one kernel's body, as device functions (names as in the body)."""
    TILE_WARPS, TILES, GROUPS, N_TILES, MATS = s.TILE_WARPS, s.TILES, s.GROUPS, s.N_TILES, s.MATS
    NORM, EARLY, I8 = s.NORM, s.EARLY, s.I8
    PAIRS_MAIN, SLOTS_B, SC_W, SC_CHUNKS = s.PAIRS_MAIN, s.SLOTS_B, s.SC_W, s.SC_CHUNKS
    SC_ITERS, BAR_B, SLOT_TX, L2AHEAD = s.SC_ITERS, s.BAR_B, s.SLOT_TX, s.L2AHEAD

    def load_words(qw, base):
        # the lane's 8 words of one group: two 16-byte loads (32 contiguous bytes)
        w0, w1, w2, w3 = ld_global_nc_v4_u32(qw, base)
        w4, w5, w6, w7 = ld_global_nc_v4_u32(qw, base + 4)
        return w0, w1, w2, w3, w4, w5, w6, w7

    def load_scales(sc, sbase, grp):
        # the scale bits of the lane's rows g (scales from sbase) and g + 8 (8 rows further)
        return (uint32(ld_global_nc_u16(sc, sbase + grp)),
                uint32(ld_global_nc_u16(sc, sbase + 8 * GROUPS + grp)))

    def load_group(qw, sc, wbase, sbase, grp):
        # group grp of the lane's tile (words from wbase, 256 a group): 8 words, 2 scales' bits
        w0, w1, w2, w3, w4, w5, w6, w7 = load_words(qw, wbase + grp * 256)
        s0, s1 = load_scales(sc, sbase, grp)
        return (w0, w1, w2, w3, w4, w5, w6, w7, s0, s1)

    def load_both(qw, sc, bases, grp):
        # group grp of the warp's tile and (gate_up) of its up tile; else the same loads twice
        wa, sa, wb, sb = bases
        ca = load_group(qw, sc, wa, sa, grp)
        cb = ca
        if MATS == 2:
            cb = load_group(qw, sc, wb, sb, grp)
        return ca, cb

    def dequant_mma(q, b0, b1, d):
        # one k16 chunk: the word's 8 weights as the A fragment (gemv.py's dequant), times B
        a0, a1, a2, a3 = dequant(q)
        return mma_sync_m16n8k16_f16_f32(a0, a1, a2, a3, b0, b1, d[0], d[1], d[2], d[3])

    def chunk(qa, qb, baddr, da, db):
        # one k16 chunk: its B fragment from shared memory, then the mma of the tile (and,
        # gate_up, of the up tile: one B fragment serves both)
        b0, b1 = ld_shared_v2_u32_at(baddr)
        da = dequant_mma(qa, b0, b1, da)
        if MATS == 2:
            db = dequant_mma(qb, b0, b1, db)
        return da, db

    def group_dot(ca, cb, abase, grp, t4):
        """Rows g and g+8 of one group, fp32, times their weight scales; then the same of the
        up tile (gate_up; zeros otherwise: mainloop says why).  Written out, not looped: tuple
        elements need literal indices to stay in registers."""
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

    def b_lane(abase, g, t4):
        """Where lane (g, t)'s B fragments start in the staged activations at abase: with i8
        lane (g, t) reads digit plane min(g, 2) (hi, mid, lo), its run of lane t."""
        if I8:
            abase += uint64((min(g, 2) * 4 + t4) * 32)
        return abase

    def kstep(q0, q1, b0, b1, d):
        """i8: one k32 step, chunks 2s (word q0) and 2s + 1 (q1): each nibble n moved to the
        top of a byte is the signed byte 16 n, rows g (a0, a2: the word shifted left by 4)
        and g + 8 (a1, a3), in the column order (2t, 2t + 8, 2t + 1, 2t + 9) the staged
        digits follow; D += A . B in int32."""
        return mma_sync_m16n8k32_s8_s32((q0 << SH4) & HIGH_NIBBLES, q0 & HIGH_NIBBLES,
                                        (q1 << SH4) & HIGH_NIBBLES, q1 & HIGH_NIBBLES, b0, b1,
                                        d[0], d[1], d[2], d[3])

    def digits_dot(c, b0, b1, b2, b3, b4, b5, b6, b7):
        # i8: a group of one tile, four k32 steps (the lane's eight words), int32 sums
        z = int32(0)
        d = (z, z, z, z)
        d = kstep(c[0], c[1], b0, b1, d)
        d = kstep(c[2], c[3], b2, b3, d)
        d = kstep(c[4], c[5], b4, b5, d)
        return kstep(c[6], c[7], b6, b7, d)

    def group_dot_i8(ca, cb, abase, grp, t4):
        """group_dot for i8: rows g and g+8 (and the up tile's), fp32, times their scales.
        D's column 0 (hi digits) and 1 (mid) are lane t = 0's d0, d1 (d2, d3 for row g + 8),
        column 2 (lo) lane t = 1's d0; each lane weighs its two columns, so that lanes t = 0
        and t = 1 together hold 16 * dot(w, rni(v 2^14)) * 2^-18 (mainloop's caller adds
        them); the int32 sums are exact (|D| <= 128 * 128 * 128) and so is each product
        before the one fp32 add."""
        b = abase + uint32(grp * 384)
        b0, b1, b2, b3 = ld_shared_v4_u32_at(b)
        b4, b5, b6, b7 = ld_shared_v4_u32_at(b + uint32(16))
        wa = float32(0.0)
        wb = float32(0.0)
        if t4 == 0:
            wa = float32(2.0 ** -2)
            wb = float32(2.0 ** -10)
        elif t4 == 1:
            wa = float32(2.0 ** -18)
        da = digits_dot(ca, b0, b1, b2, b3, b4, b5, b6, b7)
        db = da
        if MATS == 2:
            db = digits_dot(cb, b0, b1, b2, b3, b4, b5, b6, b7)
        return ((float32(da[0]) * wa + float32(da[1]) * wb) * cvt_f32_f16(ca[8]),
                (float32(da[2]) * wa + float32(da[3]) * wb) * cvt_f32_f16(ca[9]),
                (float32(db[0]) * wa + float32(db[1]) * wb) * cvt_f32_f16(cb[8]),
                (float32(db[2]) * wa + float32(db[3]) * wb) * cvt_f32_f16(cb[9]))

    def add_group(acc, ca, cb, abase, grp, t4, invf):
        # acc + group grp's sums (none past the last group; gate_up's and i8's undo f_g)
        a0, a1, a2, a3 = acc
        if grp < GROUPS:
            if I8:
                v0, v1, v2, v3 = group_dot_i8(ca, cb, abase, grp, t4)
            else:
                v0, v1, v2, v3 = group_dot(ca, cb, abase, grp, t4)
            if NORM or I8:
                fi = invf[grp]
                v0, v1, v2, v3 = v0 * fi, v1 * fi, v2 * fi, v3 * fi
            a0 += v0
            a1 += v1
            a2 += v2
            a3 += v3
        return a0, a1, a2, a3

    def mainloop(qw, sc, abase, bases, kw, t4, first, invf):
        """The warp's groups kw, kw + TILE_WARPS, ..., two an iteration, into two register
        sets that take turns (no copies): each group's loads are issued a group ahead of its
        math.  The conditions are the same for the whole warp: the mma sees all 32 lanes.
        first: the first group's loads (issued before griddepcontrol.wait).

        acc is rows g and g+8, then those of the up tile (gate_up).  o_proj and down keep the
        last two, zeros: in a loop LLVM does not unroll (down's) their adds survive as 2 dead
        fma.f32 a group, never stored; dropping them changes the default kernels' PTX, so
        that is left to a deliberate change measured on the device."""
        ca, cb = first
        z = float32(0.0)
        acc = (z, z, z, z)
        for it in range(PAIRS_MAIN):
            ga = kw + 2 * it * TILE_WARPS
            gb = ga + TILE_WARPS
            na, nb = load_both(qw, sc, bases, min(gb, GROUPS - 1))
            if L2AHEAD:
                to_l2(qw, bases, gb + L2AHEAD * TILE_WARPS)
            acc = add_group(acc, ca, cb, abase, ga, t4, invf)
            ca, cb = load_both(qw, sc, bases, min(gb + TILE_WARPS, GROUPS - 1))
            if L2AHEAD:
                to_l2(qw, bases, gb + (L2AHEAD + 1) * TILE_WARPS)
            acc = add_group(acc, na, nb, abase, gb, t4, invf)
        return acc

    def to_l2(qw, bases, grp):
        """(lanes 0 and, gate_up, 1) l2ahead: group grp of the warp's tile (lane 1: of its up
        tile) into L2, 1 KB a tile; nothing past the last group."""
        lane = cuda.threadIdx.x & 31
        if lane < MATS and grp < GROUPS:
            wa, _, wb, _ = bases
            w = wa if lane == 0 else wb
            cp_async_bulk_prefetch_l2(qw, w - lane * 8 + grp * 256, 1024)

    def ahead_prologue(qw, bases, g0):
        # l2ahead: groups g0 + TILE_WARPS .. g0 + L2AHEAD * TILE_WARPS (g0: `first`'s group)
        for j in range(L2AHEAD):
            to_l2(qw, bases, g0 + (j + 1) * TILE_WARPS)

    def early_issue(qw, dyn, bases, grp, slot, warp):
        """(lane 0) Group grp's 1 KB of the warp's tile into the warp's slot: one
        cp.async.bulk, counted off the slot's mbarrier.  Past the last group only an arrival,
        so the slot's phase still completes for the lanes that wait on it."""
        wa, sa, wb, sb = bases
        base = cvta_to_shared_u32(dyn)
        bar = base + uint32(BAR_B + (warp * EARLY + slot) * 8)
        if grp < GROUPS:
            d = base + uint32(SLOTS_B + (warp * EARLY + slot) * SLOT_TX)
            mbarrier_arrive_expect_tx(bar, uint32(SLOT_TX))
            cp_async_bulk_g2s(d, qw, wa + grp * 256, uint32(1024), bar)   # wa: lane 0's words
        else:
            mbarrier_arrive(bar)

    def early_prologue(qw, sc, dyn, bases, tile, tl, kw, lane, warp):
        """What needs no activations, issued before griddepcontrol.wait: the tile's scale
        block into shared memory by the tile's warps (cp.async, one group: the caller waits
        for it and a block barrier publishes it); lane 0 arms the warp's slot barriers and
        starts the copies of its first EARLY groups."""
        sbase = cvta_to_shared_u32(dyn) + uint32(SC_W * 4)
        tt = kw * 32 + lane
        for m in range(MATS):
            src = (tile + m * N_TILES) * TILE * GROUPS
            dst = sbase + uint32((tl * MATS + m) * TILE * GROUPS * 2)
            for it in range(SC_ITERS):
                c = it * 32 * TILE_WARPS + tt
                if c < SC_CHUNKS:
                    cp_async_cg_shared_global_16(dst + uint32(c * 16), sc, src + c * 8)
        cp_async_commit_group()
        if lane == 0:
            bar = cvta_to_shared_u32(dyn) + uint32(BAR_B + warp * EARLY * 8)
            for s_ in range(EARLY):
                mbarrier_init(bar + uint32(s_ * 8), uint32(1))
            fence_mbarrier_init()
            for s_ in range(EARLY):
                early_issue(qw, dyn, bases, kw + s_ * TILE_WARPS, s_, warp)
        cuda.syncwarp(FULL)

    def early_scale(dyn, tl, m, r, grp):
        # the scale bits of row r of the block's tile tl, group grp (m: 0)
        e = SC_W * 2 + ((tl * MATS + m) * TILE + r) * GROUPS + grp
        return (dyn[e >> 1] >> uint32((e & 1) * 16)) & uint32(0xFFFF)

    def early_read(dyn, slot, lane, warp, tl, g, m, grp):
        # the group in the warp's slot (the lane's 8 words are its 32 bytes at 32 * lane),
        # and its rows' two scales
        d = cvta_to_shared_u32(dyn) + uint32(SLOTS_B + (warp * EARLY + slot) * SLOT_TX
                                             + m * 1024 + lane * 32)
        w0, w1, w2, w3 = ld_shared_v4_u32_at(d)
        w4, w5, w6, w7 = ld_shared_v4_u32_at(d + uint32(16))
        gc = min(grp, GROUPS - 1)
        return (w0, w1, w2, w3, w4, w5, w6, w7, early_scale(dyn, tl, m, g, gc),
                early_scale(dyn, tl, m, g + 8, gc))

    def early_loop(dyn, abase, t4, invf):
        """The sums of the warp's first EARLY groups from their slots: wait for the slot's
        (only) phase -- its bulk copy has landed -- then the group's math as mainloop's."""
        lane, g, t4_, tl, kw, tile = roles()
        warp = cuda.threadIdx.x >> 5
        bar = cvta_to_shared_u32(dyn) + uint32(BAR_B + warp * EARLY * 8)
        z = float32(0.0)
        acc = (z, z, z, z)
        for it in range(EARLY):
            grp = kw + it * TILE_WARPS
            slot = it % EARLY                 # it (written as when slots were refilled: the
            mbarrier_wait_parity(bar + uint32(slot * 8), uint32((it // EARLY) & 1))  # same PTX)
            ca = early_read(dyn, slot, lane, warp, tl, g, 0, grp)
            acc = add_group(acc, ca, ca, abase, grp, t4, invf)
        return acc

    def roles():
        # (lane, g, t, the warp's tile in the block, its share kw, the tile clamped into the
        # matrix: the last block's spare tile loads words that exist and is not written)
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        tl = warp // TILE_WARPS
        tile = min(cuda.blockIdx.x * TILES + tl, N_TILES - 1)
        return lane, lane >> 2, lane & 3, tl, warp - tl * TILE_WARPS, tile

    def tile_bases(tile, lane, g):
        # where the lane's words of a tile start (256 a group) and its row g's scales; then
        # the same of its up tile (gate_up: the same rows, N_TILES tiles on; else repeated)
        wa = (tile * GROUPS * 32 + lane) * 8
        sa = (tile * TILE + g) * GROUPS
        wb, sb = wa, sa
        if MATS == 2:
            up = tile + N_TILES
            wb, sb = (up * GROUPS * 32 + lane) * 8, (up * TILE + g) * GROUPS
        return wa, sa, wb, sb


    dequant = dev(dequant_word)
    b_lane, kstep, digits_dot, group_dot_i8 = (dev(f) for f in (b_lane, kstep, digits_dot,
                                                                group_dot_i8))
    load_words, load_scales, load_group, load_both, dequant_mma, chunk, group_dot, add_group, \
        mainloop, to_l2, ahead_prologue, early_issue, early_prologue, early_scale, early_read, \
        early_loop, roles, tile_bases = (
            dev(f) for f in (load_words, load_scales, load_group, load_both, dequant_mma, chunk,
                             group_dot, add_group, mainloop, to_l2, ahead_prologue, early_issue,
                             early_prologue, early_scale, early_read, early_loop, roles,
                             tile_bases))
    return SimpleNamespace(
        load_words=load_words, load_scales=load_scales, load_group=load_group,
        load_both=load_both, dequant_mma=dequant_mma, chunk=chunk, group_dot=group_dot,
        group_dot_i8=group_dot_i8, b_lane=b_lane,
        add_group=add_group, mainloop=mainloop, to_l2=to_l2, ahead_prologue=ahead_prologue,
        early_issue=early_issue, early_prologue=early_prologue, early_scale=early_scale,
        early_read=early_read, early_loop=early_loop, roles=roles, tile_bases=tile_bases)
