"""gate_up fed by the copy engine (`MmaTiling.feed` = stages): the weights reach shared memory by
`cp.async.bulk`, issued by one producer lane, and the consumer warps do only the dequant-mma.

Why (docs/PERF.md 0.20, scripts/bench_stream.py `--bulk`): gemv_mma's register loop issues a
group's loads one group ahead of its math, so ~2-3 us of a 7B layer's gate_up (21.5 us in the
step against 16.5 of bytes) is the math holding back the next loads.  bench_stream's stand-in
with 128 dependent FMAs a group ran 20.4 us a launch in the register loop and 18.3 through
shared memory with copies of 14-28 KB; with no math both streamed at ~3.9 TB/s.  The retired
`ring` (1 KB a copy, a ring a warp) lost because its copies were small and its rings many.

Shape: one block an SM (grid min(tiles, SMs)); block b walks the gate/up tile pairs b, b + grid,
...  It has `warps` = C consumer warps, a producer warp and a reducer warp.  A stage is C
consecutive groups of one tile pair: the gate tile's C KB and the up tile's C KB (the mma
layout keeps a tile's groups contiguous, 1 KB each), two bulk copies counted off the stage's
`full` mbarrier.  The producer lane issues the first `early` stages (0..feed) before
griddepcontrol.wait (the weights wait for nothing), stages rmsnorm(x) with everyone, then
issues the rest and refills each stage once its C consumers have arrived on its `empty`
mbarrier.  Consumer warp w takes group w of every stage: its lane's 32 bytes of the gate and
the up group from the slot (the two 16-byte halves in a lane-dependent order, so a load's 32
lanes touch each bank once a wavefront), its rows' scales from global memory one stage ahead,
the same dequant-mma (`add_group`) as gemv_mma.  After a tile pair's last stage each consumer
leaves its row sums in one of two partial buffers (by the pair's parity) and arrives on the
buffer's `full` mbarrier without waiting; the reducer warp, a pair behind, adds the C
partials of each row in warp order (lane l: gate row l, lane 16 + l: up row l), applies rstd
and SwiGLU, stores the fp16 rows and frees the buffer.  A consumer waits only if the reducer
is two pairs behind.

Sums: a row's groups in the order group_dot takes them within a warp, the warps' partials in
warp order -- deterministic, and equal to gemv_mma's gate_up with `warps` = C (the same warp
holds the same groups: warp w has groups w, w + C, ...) but where rstd, summed over more
warps, differs in its last bit.

Dynamic shared memory (`feed_smem`): the mbarriers (full and empty a stage, full and empty a
partial buffer) in the first 1 KB, then the stages, 2 C KB each.  hilo and l2ahead are not taken
(check_tiling refuses them); `early` means the stages issued before the wait.
"""
from __future__ import annotations

import math

from numba import cuda, float32, uint32, uint64  # module globals: the simulator swaps cuda

from nq.kernels.common import dev

FULL = 0xFFFFFFFF
from nq.kernels.int4.gemv_mma_shape import MmaShape
from nq.kernels.int4.tiling import TILE, MmaTiling
from nq.ptx import (SIMULATOR, cp_async_bulk_g2s, cp_async_bulk_prefetch_l2, cvt_rn_f16_f32,
                    cvta_to_shared_u32, fence_mbarrier_init, griddepcontrol_launch_dependents,
                    griddepcontrol_wait, ld_shared_v4_u32_at, mbarrier_arrive,
                    mbarrier_arrive_expect_tx, mbarrier_init, mbarrier_wait_parity,
                    st_global_u16)

BARRIERS_B = 1024    # the mbarriers' bytes at the start of the dynamic array (stages 1 KB aligned)
MAX_FEED = 8         # stages


def feed_smem(t: MmaTiling) -> int:
    """Dynamic shared memory the feed kernel takes: its mbarriers, then `feed` stages of the
    C = t.warps groups of a gate tile and of its up tile (1 KB a group)."""
    return BARRIERS_B + t.feed * 2 * t.warps * 1024 if t.feed else 0


def feed_kernel(s: MmaShape, t: MmaTiling, w, a_, k: int):
    """gate_up's kernel and signature with the copy-engine feed (module doc); w and a_ are
    gemv_mma's weight and activation paths (add_group, load_scales; stage_norm)."""
    C, NST, GROUPS, N_TILES = s.TILE_WARPS, t.feed, s.GROUPS, s.N_TILES
    PRE = t.early                      # stages issued before griddepcontrol.wait
    ACT_ALLOC, WARPS = s.ACT_ALLOC, s.WARPS
    NCH = -(-GROUPS // C)              # stages a tile pair
    STAGE_B = 2 * C * 1024             # a stage: gate's C groups, then up's
    UP_B = C * 1024
    RED = C * 32                       # a parity's partials: [warp][gate rows 16 | up rows 16]
    RED2 = 2 * RED                     # both parities
    EMPTY_B = 8 * NST
    RFULL_B = 16 * NST                 # the partials' two buffers: full (C arrivals) and
    REMPTY_B = RFULL_B + 16            # empty (the reducer's one), a buffer a tile's parity
    if REMPTY_B + 16 > BARRIERS_B:
        raise ValueError(f"gemv_mma feed: {NST} stages' barriers pass {BARRIERS_B} bytes")
    add_group, load_scales = w.add_group, w.load_scales
    stage_norm = a_.stage_norm

    def issue(qw, base, it, b, grid):
        # (the producer lane) stage it % NST <- groups j*C.. of the block's kk-th tile pair
        kk = it // NCH
        j = it - kk * NCH
        tile = b + kk * grid
        g0 = j * C
        nb = min(C, GROUPS - g0) * 1024
        st = it % NST
        full = base + uint32(8 * st)
        mbarrier_arrive_expect_tx(full, uint32(2 * nb))
        dst = base + uint32(BARRIERS_B + st * STAGE_B)
        cp_async_bulk_g2s(dst, qw, (tile * GROUPS + g0) * 256, uint32(nb), full)
        cp_async_bulk_g2s(dst + uint32(UP_B), qw, ((tile + N_TILES) * GROUPS + g0) * 256,
                          uint32(nb), full)

    def scales_of(sc, it, b, grid, warp, g):
        # the scale bits of iteration it's group (clamped into the matrix) for rows g, g + 8
        # of the gate tile, then of the up tile
        kk = it // NCH
        j = it - kk * NCH
        tile = b + kk * grid
        grp = min(j * C + warp, GROUPS - 1)
        s0, s1 = load_scales(sc, (tile * TILE + g) * GROUPS, grp)
        s2, s3 = load_scales(sc, ((tile + N_TILES) * TILE + g) * GROUPS, grp)
        return s0, s1, s2, s3

    def put_rows(red, par, tile, lane, rstd, out):
        # (the reducer warp) lane l < 16: gate row l, lane 16 + l: up row l, each the C warps'
        # partials in warp order; then SwiGLU on lanes < 16
        v = float32(0.0)
        for w_ in range(C):
            v += red[par * RED + w_ * 32 + lane]
        v *= rstd
        up = cuda.shfl_xor_sync(FULL, v, TILE)      # lane l < 16: lane 16 + l's
        if lane < TILE:
            y = v / (float32(1.0) + math.exp(-v)) * up     # gemv.py's put_swiglu
            st_global_u16(out, tile * TILE + lane, cvt_rn_f16_f32(y))

    def slot_words(a, h):
        # a lane's 8 words at a, its two 16-byte halves read in the order h (0 or 1): lanes
        # 4..7 of each 8 read the second half first, so one load of a warp's 32 lanes touches
        # every bank once a wavefront (in memory order, 8 lanes shared 4 banks)
        p0, p1, p2, p3 = ld_shared_v4_u32_at(a + uint32(16 * h))
        q0, q1, q2, q3 = ld_shared_v4_u32_at(a + uint32(16 - 16 * h))
        if h:
            return q0, q1, q2, q3, p0, p1, p2, p3
        return p0, p1, p2, p3, q0, q1, q2, q3

    issue, scales_of, put_rows, slot_words = (dev(f) for f in (issue, scales_of, put_rows,
                                                                 slot_words))

    def kernel(x, norm_w, qw, sc, out):
        act = cuda.shared.array(ACT_ALLOC, uint32, alignment=None if SIMULATOR else 16)
        red = cuda.shared.array(RED2, float32)
        invf = cuda.shared.array(GROUPS, float32)
        ssum = cuda.shared.array(WARPS, float32)
        dyn = cuda.shared.array(0, uint32)
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        t4 = lane & 3
        h = (lane >> 2) & 1
        b = cuda.blockIdx.x
        grid = cuda.gridDim.x
        total = (N_TILES - b + grid - 1) // grid * NCH    # the block's stages
        base = cvta_to_shared_u32(dyn)
        if tid == 0:
            for st in range(NST):
                mbarrier_init(base + uint32(8 * st), uint32(1))
                mbarrier_init(base + uint32(EMPTY_B + 8 * st), uint32(C))
            for p_ in range(2):
                mbarrier_init(base + uint32(RFULL_B + 8 * p_), uint32(C))
                mbarrier_init(base + uint32(REMPTY_B + 8 * p_), uint32(1))
            fence_mbarrier_init()
            cp_async_bulk_prefetch_l2(norm_w, 0, 2 * k)  # the staging below waits on L2
        cuda.syncthreads()
        if warp == C and lane == 0:
            for it in range(min(PRE, total)):             # before the wait: weights only
                issue(qw, base, it, b, grid)
        s0, s1, s2, s3 = scales_of(sc, 0, b, grid, warp, g)
        griddepcontrol_wait()
        griddepcontrol_launch_dependents()
        rstd = stage_norm(x, norm_w, act, invf, ssum)     # every warp; ends with a barrier
        if warp == C:
            if lane == 0:
                for it in range(PRE, total):              # a fresh stage's wait: none
                    st = it % NST
                    mbarrier_wait_parity(base + uint32(EMPTY_B + 8 * st),
                                         uint32(((it // NST) & 1) ^ 1))
                    issue(qw, base, it, b, grid)
            return
        if warp == C + 1:                                 # the reducer, a tile pair behind
            for kk in range(total // NCH):
                par = kk & 1
                mbarrier_wait_parity(base + uint32(RFULL_B + 8 * par), uint32((kk >> 1) & 1))
                put_rows(red, par, b + kk * grid, lane, rstd, out)
                cuda.syncwarp()
                if lane == 0:
                    mbarrier_arrive(base + uint32(REMPTY_B + 8 * par))
            return
        abase = uint64(cvta_to_shared_u32(act))
        z = float32(0.0)
        acc = (z, z, z, z)
        for it in range(total):
            kk = it // NCH
            j = it - kk * NCH
            grp = j * C + warp
            n0, n1, n2, n3 = scales_of(sc, min(it + 1, total - 1), b, grid, warp, g)
            st = it % NST
            mbarrier_wait_parity(base + uint32(8 * st), uint32((it // NST) & 1))
            a = base + uint32(BARRIERS_B + st * STAGE_B + warp * 1024 + lane * 32)
            w0, w1, w2, w3, w4, w5, w6, w7 = slot_words(a, h)
            u0, u1, u2, u3, u4, u5, u6, u7 = slot_words(a + uint32(UP_B), h)
            cuda.syncwarp()
            if lane == 0:                 # the slot's words are in registers: release it
                mbarrier_arrive(base + uint32(EMPTY_B + 8 * st))
            acc = add_group(acc, (w0, w1, w2, w3, w4, w5, w6, w7, s0, s1),
                            (u0, u1, u2, u3, u4, u5, u6, u7, s2, s3), abase, grp, t4, invf)
            s0, s1, s2, s3 = n0, n1, n2, n3
            if j == NCH - 1:              # the tile pair's last stage: its partials
                par = kk & 1              # (the reducer has done the pair two before)
                mbarrier_wait_parity(base + uint32(REMPTY_B + 8 * par),
                                     uint32(((kk >> 1) & 1) ^ 1))
                if t4 == 0:
                    o = par * RED + warp * 32 + g
                    red[o] = acc[0]
                    red[o + 8] = acc[1]
                    red[o + TILE] = acc[2]
                    red[o + TILE + 8] = acc[3]
                cuda.syncwarp()
                if lane == 0:
                    mbarrier_arrive(base + uint32(RFULL_B + 8 * par))
                acc = (z, z, z, z)

    return kernel, "void(float32[::1], float16[::1], uint32[::1], float16[::1], float16[::1])"
