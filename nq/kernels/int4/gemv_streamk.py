"""down as a stream-K GEMV into xacc (`MmaTiling.sk`; the step's experiment "down.sk=1").

Why: down's 7B grid is 112 blocks of two 16-row tiles, so 20 of the H200's 132 SMs stream
none of its 35 MB a layer, and it reaches 63 % of its byte floor where gate_up, on every SM,
reaches 77 % (docs/PERF.md 0.21).  A tile's K could be split across blocks, but its partial
sums in fp32 then need a second, ordered pass, which lost (split-K, docs/PERF.md 0.5).  xacc
removes that pass: attn_o_proj already adds its shares into it as int64 fixed point (units of
2^-32 of x, `red.relaxed.gpu.global.add.u64`), and integer adds give the same bits in any
order, so any block may add any part of any row.

So the work is cut as stream-K cuts a GEMM: the units are the weights' 1 KB (tile, group)
blocks in memory order, u = tile * GROUPS + group (layout.mma_layout: [tile][group][lane][8
words]), L = N_TILES * GROUPS of them.  Block b of B takes units [b L / B, (b + 1) L / B) --
equal shares on every SM, whatever the tile count -- and warp w of W its own equal, contiguous
part of those.  A warp's part is at most GROUPS units, so it touches at most two tiles: it keeps
two row sums (segments 0 and 1) and puts both in shared memory; one thread a (tile, row) of
the block adds the warps' sums of that row in warp order (deterministic) and adds the total
into xacc, once a block and row.

What it asks of the step: x is not written.  Every layer's down adds into xacc beside
attn_o_proj, qkv_rope and gate_up read x + xacc * 2^-32 (Tiling.xacc / MmaTiling.xacc), and
the last layer's down is the folding kernel (gemv_mma.py "xacc": x + xacc + its sums into x,
xacc zeroed), so lm_head reads x as before and the next step finds xacc zero.

A warp's loads: its first two units before griddepcontrol.wait (two register sets, as
gemv_mma's loop takes turns with them), then each unit's loads two units ahead of its math.
The dequant-mma is gemv_mma's (gemv_mma_weights.group_dot), the staged activations
gemv_mma_stage.stage's.  The NumPy model of the split is `warp_units`; `reference_streamk` is
the result the kernel must give.

Measured (docs/PERF.md 0.24; an H100 SXM of 132 SMs, the H200 not starting, 2026-12-07): in
the 7B step +0.196 ms at 512 as first built, +0.110 at two 512-thread blocks an SM, +0.395 at
one (16 warps an SM are too few for down's loads).  Its epilogue then recomputed every warp's
range in each thread, ~4 us a layer of 64-bit integer math; now the warps' first tiles wait
in shared memory (`first`), not yet measured.  Why little is left to win even so: the
tile-per-block down already gives each of 112 SMs two whole tiles, and the 20 SMs it leaves
are where qkv_rope's first blocks start under PDL; a 1024-thread block here leaves them none.
So it is an experiment (`down.sk=1`), not the default.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int32, int64, uint32, uint64  # module globals: the simulator swaps cuda

from nq.config import GROUP_SIZE
from nq.kernels.build import compile_kernel, kernel_name
from nq.kernels.common import SMEM_OPTIN_LIMIT, dev
from nq.kernels.int4.gemv_mma_shape import dynamic_smem, shape_of
from nq.kernels.int4.dequant import FIXED_ONE
from nq.kernels.int4.gemv_mma_stage import act_path
from nq.kernels.int4.gemv_mma_weights import weight_path
from nq.kernels.int4.tiling import TILE, MmaTiling
from nq.ptx import (SIMULATOR, cvta_to_shared_u32, griddepcontrol_launch_dependents,
                    griddepcontrol_wait, red_relaxed_gpu_add_u64)

SIG = "void(float16[::1], uint32[::1], float16[::1], uint32[::1])"   # a, qw, sc, xacc words


def warp_units(n_out: int, k: int, blocks: int, warps: int) -> np.ndarray:
    """The split, (blocks, warps, 2) int64: each warp's units [u0, u1) (the kernel's
    arithmetic, integer for integer)."""
    n_units = (n_out // TILE) * (k // GROUP_SIZE)
    b = np.arange(blocks, dtype=np.int64)[:, None]
    w = np.arange(warps, dtype=np.int64)[None, :]
    ub0, ub1 = b * n_units // blocks, (b + 1) * n_units // blocks
    n = ub1 - ub0
    return np.stack([ub0 + w * n // warps, ub0 + (w + 1) * n // warps], -1)


def block_tiles(n_out: int, k: int, blocks: int) -> int:
    """The most tiles one block's units touch (its epilogue's tiles)."""
    groups, n_units = k // GROUP_SIZE, (n_out // TILE) * (k // GROUP_SIZE)
    b = np.arange(blocks, dtype=np.int64)
    ub0, ub1 = b * n_units // blocks, (b + 1) * n_units // blocks
    return int(np.max(np.where(ub1 > ub0, (ub1 - 1) // groups - ub0 // groups + 1, 0)))


def check_streamk(n_out: int, k: int, threads: int, blocks: int) -> None:
    """Refuse what the kernel cannot do, with what to do instead."""
    if n_out % TILE or k % GROUP_SIZE:
        raise ValueError(f"down stream-K: N={n_out} must be a multiple of {TILE} and K={k} of "
                         f"{GROUP_SIZE}")
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"down stream-K: threads={threads} must be a multiple of 32 in "
                         f"32..1024")
    if blocks < 1:
        raise ValueError(f"down stream-K: blocks={blocks}; at least one")
    units = warp_units(n_out, k, blocks, threads // 32)
    if int((units[..., 1] - units[..., 0]).max()) > k // GROUP_SIZE:
        raise ValueError(f"down stream-K: {blocks} blocks of {threads // 32} warps give a warp "
                         f"more than a tile's {k // GROUP_SIZE} groups (it would touch three "
                         f"tiles); use more blocks or threads")
    if block_tiles(n_out, k, blocks) * TILE > threads:
        raise ValueError(f"down stream-K: a block's units touch "
                         f"{block_tiles(n_out, k, blocks)} tiles, more than its {threads} "
                         f"threads can sum a row each; use more blocks or threads")
    if k * 2 + threads // 32 * 2 * TILE * 4 > SMEM_OPTIN_LIMIT:
        raise ValueError(f"down stream-K: K={k} needs {k * 2} bytes of staged activations, over "
                         f"a block's {SMEM_OPTIN_LIMIT} bytes of shared memory")


def streamk_name(n_out: int, k: int, threads: int, blocks: int) -> str:
    return kernel_name("gemv_mma_down_sk", n=n_out, k=k, t=threads, b=blocks)


@functools.cache
def build_streamk(n_out: int, k: int, threads: int, blocks: int):
    """The kernel body and its signature (SIG): xacc (N int64 as 2N uint32 words) += W . a in
    units of 2^-32, a (K,) fp16, the weights in the mma layout (flat), scales (N, K/128) flat."""
    check_streamk(n_out, k, threads, blocks)
    s = shape_of("down", n_out, k, MmaTiling(warps=1, threads=threads), None)
    GROUPS, WARPS, ACT_WORDS = s.GROUPS, s.WARPS, s.ACT_WORDS
    L = s.N_TILES * GROUPS      # units
    B = blocks
    units = warp_units(n_out, k, blocks, WARPS)
    PAIRS = -(-int((units[..., 1] - units[..., 0]).max()) // 2)   # two units an iteration
    ET = block_tiles(n_out, k, blocks)   # the epilogue's tiles
    RED = WARPS * 2 * TILE               # [warp][segment][row] fp32
    DYN = bool(dynamic_smem(k))
    FIX = float32(FIXED_ONE)
    w, a_ = weight_path(s), act_path(s)
    load_group, group_dot, stage = w.load_group, w.group_dot, a_.stage

    def warp_range(b, wp):
        # warp wp of block b: its units [u0, u1) (warp_units)
        ub0 = b * L // B
        n = (b + 1) * L // B - ub0
        return ub0 + wp * n // WARPS, ub0 + (wp + 1) * n // WARPS

    def load_unit(qw, sc, u, u0, u1, lane, g):
        # unit u's 8 words and 2 scales of the lane, u clamped into [u0, u1) and the matrix
        # (a spare load beats a branch; its sums are never taken)
        u = min(max(u0, min(u, u1 - 1)), L - 1)
        tile = u // GROUPS
        return load_group(qw, sc, (tile * GROUPS * 32 + lane) * 8, (tile * TILE + g) * GROUPS,
                          u - tile * GROUPS)

    def add_unit(acc, c, u, t0, abase, t4):
        # unit u's sums of rows g and g + 8 into its segment (0: the warp's first tile)
        p0, p1, q0, q1 = acc
        tile = u // GROUPS
        v = group_dot(c, c, abase, u - tile * GROUPS, t4)
        if tile == t0:
            p0 += v[0]
            p1 += v[1]
        else:
            q0 += v[0]
            q1 += v[1]
        return p0, p1, q0, q1

    def body(a, qw, sc, xa, act, red, first):
        # first (WARPS,) int32 in shared memory: each warp's first tile, -1 for a warp with no
        # unit (the epilogue reads these instead of recomputing every warp's range: 32 of those
        # a thread, 64-bit multiplies each, were microseconds of serial integer math)
        tid = cuda.threadIdx.x
        lane = tid & 31
        wp = tid >> 5
        g = lane >> 2
        t4 = lane & 3
        b = cuda.blockIdx.x
        u0, u1 = warp_range(b, wp)
        t0 = min(u0, L - 1) // GROUPS
        if lane == 0:
            first[wp] = t0 if u1 > u0 else -1
        ca = load_unit(qw, sc, u0, u0, u1, lane, g)        # weights wait for nothing
        cb = load_unit(qw, sc, u0 + 1, u0, u1, lane, g)
        griddepcontrol_wait()
        griddepcontrol_launch_dependents()
        stage(a, act)
        cuda.syncthreads()
        abase = uint64(cvta_to_shared_u32(act))
        z = float32(0.0)
        acc = (z, z, z, z)
        for it in range(PAIRS):
            ua = u0 + 2 * it
            if ua < u1:
                acc = add_unit(acc, ca, ua, t0, abase, t4)
            if it + 1 < PAIRS:
                ca = load_unit(qw, sc, ua + 2, u0, u1, lane, g)
            if ua + 1 < u1:
                acc = add_unit(acc, cb, ua + 1, t0, abase, t4)
            if it + 1 < PAIRS:
                cb = load_unit(qw, sc, ua + 3, u0, u1, lane, g)
        if t4 == 0:
            o = wp * 2 * TILE + g
            red[o] = acc[0]
            red[o + 8] = acc[1]
            red[o + TILE] = acc[2]
            red[o + TILE + 8] = acc[3]
        cuda.syncthreads()
        if tid < ET * TILE:
            ub0 = b * L // B
            ub1 = (b + 1) * L // B
            r = tid & (TILE - 1)
            tile = ub0 // GROUPS + (tid >> 4)
            if ub1 > ub0 and tile <= (ub1 - 1) // GROUPS:
                tot = float32(0.0)
                for w_ in range(WARPS):   # the warps' sums of the row, in warp order
                    f = first[w_]
                    d = tile - f
                    if f >= 0 and d >= 0 and d <= 1:
                        tot += red[(w_ * 2 + d) * TILE + r]
                red_relaxed_gpu_add_u64(xa, 2 * (tile * TILE + r), uint64(int64(tot * FIX)))

    warp_range, load_unit, add_unit, body = (dev(f) for f in (warp_range, load_unit, add_unit,
                                                              body))
    if DYN:
        def kernel(a, qw, sc, xa):   # the 32B's K: the activations in dynamic shared memory
            act = cuda.shared.array(0, uint32)
            red = cuda.shared.array(RED, float32)
            first = cuda.shared.array(WARPS, int32)
            body(a, qw, sc, xa, act, red, first)
    else:
        def kernel(a, qw, sc, xa):
            act = cuda.shared.array(ACT_WORDS, uint32, alignment=None if SIMULATOR else 16)
            red = cuda.shared.array(RED, float32)
            first = cuda.shared.array(WARPS, int32)
            body(a, qw, sc, xa, act, red, first)
    return kernel, SIG


@functools.cache
def compile_streamk(n_out: int, k: int, threads: int, blocks: int):
    """The compiled kernel (or the simulator's), once per process for each shape and grid."""
    body, sig = build_streamk(n_out, k, threads, blocks)
    return compile_kernel(body, sig, streamk_name(n_out, k, threads, blocks),
                          launch_bounds=(threads,))


def reference_streamk(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """What the kernel adds to xacc, in units of x, float64: the dequantized (N, K) weights
    times a."""
    return np.asarray(w, np.float64) @ np.asarray(a, np.float64)


def streamk_tiling(t: MmaTiling) -> MmaTiling:
    """t as the stream-K down reads it: sk and threads are its own, xacc on, and the fields
    of the tile-per-block kernel (warps a tile, early, l2ahead) cleared, so that an
    experiment may write "down.sk=1" over down's default tiling."""
    import dataclasses
    return dataclasses.replace(t, warps=1, early=0, l2ahead=0, xacc=1, min_blocks=0)
