"""A layer's MLP in one kernel: gate_up and SwiGLU, then down, with a grid barrier between
them instead of a kernel boundary (x (H,) fp32 += Wd . (silu(Wg . h) * (Wu . h)), h =
rmsnorm(x, norm_w)).  Opt-in (`MlpTiling`, step_variants "mlp.slots=8"); the step's default
is still the two kernels of gemv_mma.py.

Why (docs/PERF.md 0.17-0.18): in the step the 7B's gate_up and down cost 22.6 + 12.7 us a
layer for 103.5 MB that a read-only stream moves in ~22.5 us.  Measured without their math
(scripts/bench_stream.py), each big kernel pays ~3 us of fill and drain, and down's blocks
(1024 threads x 61 registers: a whole SM) can only start on an SM once gate_up's block has
left it, so none of down's bytes move before gate_up ends.  Here one block an SM does both:

1. Before griddepcontrol.wait: gate_up's first group a warp (gemv_mma's gate_up_head), then
   down's ring -- each warp's first `slots` groups of down (1 KB each) bulk-copied into its
   slots of shared memory (gemv_mma_weights' early_prologue, with the block's down scales):
   ~144 KB an SM of down's weights move while gate_up streams, which has DRAM to spare
   (gate_up alone streams ~3.2 of the ~4.6 TB/s).
2. gate_up as gemv_mma's (gate_up_tail; 2 warps a 16-row tile, the same sums bit for bit),
   SwiGLU's fp16 into `a` (global: every block reads all of it).
3. The grid barrier (`grid_barrier`): each block's thread 0 adds one to bar[0]; the last
   resets it and publishes bar[1] + 1; the others spin on bar[1].  The generation word keeps
   counting across launches and graph replays, so nothing re-zeroes it.  Every block must be
   resident at once: one block an SM (the shared memory takes an SM's) and a grid of at most
   the SM count, which the launcher checks.
4. down: `a` staged through L2 (ld.global.cg: other blocks wrote it in this kernel), then a
   warp's groups through its slots as a ring (ring_loop: a slot, once read, is refilled with
   the group `slots` further on), x += the tile's sums in a fixed warp order.

Under the simulator a grid's blocks run one after another, so nothing may wait for another
block: the kernel's `phases` argument (3 on the GPU) runs phase 1 (gate_up, SwiGLU) and phase
2 (down) as two launches there (phases 1, then 2), with no barrier; the GPU tests run both.
"""
from __future__ import annotations

import dataclasses
import functools
import math

from numba import cuda, float32, uint32, uint64  # module globals: the simulator swaps cuda

from nq.kernels.build import compile_kernel, kernel_name
from nq.kernels.common import SMEM_OPTIN_LIMIT, STATIC_SMEM_LIMIT, dev
from nq.kernels.int4.gemv_mma import sums_path
from nq.kernels.int4.gemv_mma_shape import check_tiling, launch_smem, shape_of
from nq.kernels.int4.gemv_mma_stage import act_path
from nq.kernels.int4.gemv_mma_weights import weight_path
from nq.kernels.int4.tiling import TILE, MmaTiling
from nq.ptx import (SIMULATOR, atom_add_acq_rel_gpu_u32, cp_async_wait_group, cvt_rn_f16_f32,
                    cvta_to_shared_u32, fence_acq_rel_gpu, griddepcontrol_launch_dependents,
                    griddepcontrol_wait, ld_acquire_gpu_u32, nanosleep_u32, st_global_u16,
                    st_release_gpu_u32)


@dataclasses.dataclass(frozen=True)
class MlpTiling:
    """The fused MLP's split: a block of `threads` does gate_up's tiles as gemv_mma's gate_up
    with 2 warps a tile (threads / 64 tiles a block), then `down_tiles` of down's 16-row
    tiles, its warps split evenly over them; each warp holds `slots` of down's groups in
    shared memory."""
    threads: int = 576    # 18 warps: 9 gate_up tiles a block, 132 blocks for the 7B
    down_tiles: int = 2   # down's tiles a block (the 7B: 224 tiles on 112 of the blocks)
    slots: int = 8        # 1 KB down groups a warp keeps in flight (its ring)
    l2ahead: int = 1      # gate_up's (MmaTiling.l2ahead)
    fill: int = 1         # 1: down's first fill goes out before the wait, beside gate_up's
    #                       stream; 0: after the grid barrier (down as a phase of its own)

    def gate_up(self) -> MmaTiling:
        return MmaTiling(warps=2, threads=self.threads, l2ahead=self.l2ahead)

    def down(self) -> MmaTiling:
        return MmaTiling(warps=self.threads // 32 // self.down_tiles, threads=self.threads,
                         early=self.slots)

    def tag(self) -> str:
        return (f"mlp_t{self.threads}_d{self.down_tiles}_s{self.slots}_l2a{self.l2ahead}"
                + ("" if self.fill else "_late"))


def mlp_grid(inter: int, hidden: int, t: MlpTiling) -> int:
    """Blocks of the fused kernel: enough for gate_up's tiles and for down's."""
    gate_tiles, down_tiles = inter // TILE, hidden // TILE
    return max(-(-gate_tiles // (t.threads // 64)), -(-down_tiles // t.down_tiles))


def static_smem(inter: int, hidden: int, t: MlpTiling, eps: float = 1e-6) -> int:
    """Bytes of static shared memory the kernel declares."""
    g = shape_of("gate_up", inter, hidden, t.gate_up(), eps)
    d = shape_of("down", hidden, inter, t.down(), None)
    return 4 * (g.ACT_ALLOC + max(g.PARTIALS, d.PARTIALS) + g.GROUPS + g.WARPS
                + (0 if d.ACT_DYN else d.ACT_WORDS))


def check_mlp(inter: int, hidden: int, t: MlpTiling, sms: int, eps: float = 1e-6) -> None:
    """Refuse what the fused kernel cannot do, with what to change."""
    if t.threads % 64 or not 64 <= t.threads <= 1024:
        raise ValueError(f"gemv_mlp: {t.tag()}: threads must be a multiple of 64 (gate_up's "
                         f"2-warp tiles), 64..1024")
    if t.down_tiles < 1 or (t.threads // 32) % t.down_tiles:
        raise ValueError(f"gemv_mlp: {t.tag()}: down_tiles must divide the block's "
                         f"{t.threads // 32} warps")
    if t.slots < 1:
        raise ValueError(f"gemv_mlp: {t.tag()}: slots (down's groups a warp holds) must be >= 1")
    check_tiling("gate_up", inter, hidden, t.gate_up())
    check_tiling("down", hidden, inter, dataclasses.replace(t.down(), early=0))
    grid = mlp_grid(inter, hidden, t)
    if grid > sms:
        raise ValueError(f"gemv_mlp: {t.tag()} needs {grid} blocks, all resident at once for "
                         f"its grid barrier, on {sms} SMs; more threads or down_tiles a block")
    st, dyn = static_smem(inter, hidden, t, eps), launch_smem(inter, t.down())
    if st > STATIC_SMEM_LIMIT:
        raise ValueError(f"gemv_mlp: {t.tag()}: {st} bytes of static shared memory, over "
                         f"{STATIC_SMEM_LIMIT}")
    if st + dyn > SMEM_OPTIN_LIMIT:
        raise ValueError(f"gemv_mlp: {t.tag()}: {st} + {dyn} bytes of shared memory (static + "
                         f"down's slots and scales), over the {SMEM_OPTIN_LIMIT} of a block; "
                         f"fewer slots")


def gemv_mlp_name(inter: int, hidden: int, t: MlpTiling, eps: float, grid: int) -> str:
    return kernel_name("gemv_mlp", i=inter, h=hidden, **dataclasses.asdict(t), eps=eps,
                       grid=grid)


@functools.cache
def compile_gemv_mlp(inter: int, hidden: int, t: MlpTiling, eps: float, grid: int):
    body, sig = build_mlp_kernel(inter, hidden, t, eps, grid)
    return compile_kernel(body, sig, gemv_mlp_name(inter, hidden, t, eps, grid),
                          launch_bounds=(t.threads,))


@functools.cache
def build_mlp_kernel(inter: int, hidden: int, t: MlpTiling, eps: float, grid: int):
    """The kernel body and its signature (module doc): x (H,) fp32, norm_w (H,) fp16, gate_up's
    weights ([gate; up] in the mma layout) and scales, down's, a (I,) fp16 (SwiGLU's output,
    written then read), bar (2,) uint32 (the barrier's count and generation), phases."""
    g_s = shape_of("gate_up", inter, hidden, t.gate_up(), eps)
    d_s = shape_of("down", hidden, inter, t.down(), None)
    gw, ga = weight_path(g_s), act_path(g_s)
    dw, da = weight_path(d_s), act_path(d_s)
    gu, du = sums_path(g_s, gw, ga, inter, hidden), sums_path(d_s, dw, da, hidden, inter)
    G_ACT, G_GROUPS, WARPS = g_s.ACT_ALLOC, g_s.GROUPS, g_s.WARPS
    RED = max(g_s.PARTIALS, d_s.PARTIALS)
    D_TILES, D_N_TILES, D_ACT, ACT_DYN = d_s.TILES, d_s.N_TILES, d_s.ACT_WORDS, d_s.ACT_DYN
    NB = grid
    FILL = t.fill
    # numba reads no attributes of a namespace: the device functions the body calls, by name
    roles, tile_bases, early_prologue, ring_loop = (dw.roles, dw.tile_bases, dw.early_prologue,
                                                    dw.ring_loop)
    gate_up_head, gate_up_tail, g_row_sum = gu.gate_up_head, gu.gate_up_tail, gu.row_sum
    out_row, put_partials, row_sum, stage_cg = du.out_row, du.put_partials, du.row_sum, da.stage_cg

    def grid_barrier(bar):
        """Every block's stores before it are seen by every block after it (module doc)."""
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            gen = ld_acquire_gpu_u32(bar, 1)
            fence_acq_rel_gpu()
            if atom_add_acq_rel_gpu_u32(bar, 0, uint32(1)) == uint32(NB - 1):
                bar[0] = uint32(0)                   # the next launch counts from zero
                st_release_gpu_u32(bar, 1, gen + uint32(1))
            else:
                while ld_acquire_gpu_u32(bar, 1) == gen:
                    nanosleep_u32(uint32(64))
            fence_acq_rel_gpu()
        cuda.syncthreads()

    def body(x, norm_w, gqw, gsc, dqw, dsc, a, bar, phases, gact, red, invf, ssum, dact, dyn):
        down = cuda.blockIdx.x * D_TILES < D_N_TILES and (phases & 2) != 0   # block-uniform
        lane, g, t4, tl, kw, tile = roles()
        dbases = tile_bases(tile, lane, g)
        if phases & 1:
            who, bases, first = gate_up_head(gqw, gsc, norm_w)
            if down and FILL:   # down's ring fills while gate_up streams
                early_prologue(dqw, dsc, dyn, dbases, tile, tl, kw, lane,
                                  cuda.threadIdx.x >> 5)
            row, tl2, r, rstd = gate_up_tail(x, norm_w, gqw, gsc, gact, red, invf, ssum,
                                                who, bases, first)
            if row >= 0:   # gemv_mma's gate_up epilogue (gemv.py's put_swiglu)
                gt = g_row_sum(red, tl2, r, 0) * rstd
                up = g_row_sum(red, tl2, r, 1) * rstd
                y = gt / (float32(1.0) + math.exp(-gt)) * up
                st_global_u16(a, row, cvt_rn_f16_f32(y))
        else:
            if down:
                early_prologue(dqw, dsc, dyn, dbases, tile, tl, kw, lane,
                                  cuda.threadIdx.x >> 5)
            griddepcontrol_wait()
            griddepcontrol_launch_dependents()
        if phases == 3:
            grid_barrier(bar)
        if down and not FILL and (phases & 1):
            early_prologue(dqw, dsc, dyn, dbases, tile, tl, kw, lane, cuda.threadIdx.x >> 5)
        if down:
            tl2, r, row = out_row()
            xr = float32(0.0)
            if row >= 0:
                xr = x[row]
            stage_cg(a, dact)
            cp_async_wait_group(0)    # this thread's scale copies; the barrier: everyone's
            cuda.syncthreads()
            abase = uint64(cvta_to_shared_u32(dact))
            # (red: invf's stand-in; gate_up's epilogue read it before the barrier's sync)
            acc = ring_loop(dqw, dyn, abase, dbases, t4, red)
            put_partials(red, tl, kw, g, t4, acc)
            cuda.syncthreads()
            if row >= 0:
                x[row] = xr + row_sum(red, tl2, r, 0)

    grid_barrier, body = dev(grid_barrier), dev(body)
    align = None if SIMULATOR else 16
    if ACT_DYN:
        def kernel(x, norm_w, gqw, gsc, dqw, dsc, a, bar, phases):
            gact = cuda.shared.array(G_ACT, uint32, alignment=align)
            red = cuda.shared.array(RED, float32)
            invf = cuda.shared.array(G_GROUPS, float32)
            ssum = cuda.shared.array(WARPS, float32)
            dyn = cuda.shared.array(0, uint32)   # down's activations first, then its slots
            body(x, norm_w, gqw, gsc, dqw, dsc, a, bar, phases, gact, red, invf, ssum, dyn, dyn)
    else:
        def kernel(x, norm_w, gqw, gsc, dqw, dsc, a, bar, phases):
            gact = cuda.shared.array(G_ACT, uint32, alignment=align)
            red = cuda.shared.array(RED, float32)
            invf = cuda.shared.array(G_GROUPS, float32)
            ssum = cuda.shared.array(WARPS, float32)
            dact = cuda.shared.array(D_ACT, uint32, alignment=align)
            dyn = cuda.shared.array(0, uint32)   # down's slots, scales, mbarriers
            body(x, norm_w, gqw, gsc, dqw, dsc, a, bar, phases, gact, red, invf, ssum, dact,
                 dyn)
    return kernel, ("void(float32[::1], float16[::1], uint32[::1], float16[::1], uint32[::1], "
                    "float16[::1], float16[::1], uint32[::1], int32)")
