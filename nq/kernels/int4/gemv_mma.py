"""The INT4 GEMVs on the tensor cores: o_proj and down, x (N,) fp32 += W . a, a fp16; gate_up,
out (I,) fp16 = silu(Wg . h) * (Wu . h), h = rmsnorm(x, norm_w) (gemv.py's contracts, fp32
sums).  All three by default (NQ_MMA_GATE_UP=0 moves gate_up back to the CUDA cores).

Why: ncu read the CUDA-core GEMV (gemv.py) for down as issue-bound, not memory-bound (0.61
instructions issued a cycle per scheduler, DRAM at 38 % of peak; docs/KERNELS_GEMV.md).  Per 8
weights it spends 9 instructions turning nibbles into fp16 pairs and 4 fma.f16x2 multiplying
them with activations it read from shared memory (one 16-byte load a word).  Here the same 9
dequant instructions build the A fragment of one `mma.sync.m16n8k16` (fp16 in, fp32 out),
which replaces the 4 fmas, and one 8-byte B fragment of activations serves the 16 rows of the
tile: ~10 instructions per 8 weights instead of ~14 (o_proj's and down's default: -0.14 ms).

gate_up here is the default since d292fd2 (NQ_MMA_GATE_UP=0 turns it off): the prefill GEMMs
read its layout ~1.3x faster (a 512-token prompt 22.0 -> 18.9 ms on the H200, 2026-12-01), its
sums are fp32, and with i8 (below) its decode step beats the CUDA-core kernel's.

early (`MmaTiling.early=P`, o_proj and down; down's 7B default is P = 1): before
griddepcontrol.wait, lane 0 of each warp bulk-copies its first P groups (1 KB each) into slots
of shared memory counted off an mbarrier a slot, and the tile's warps copy its scale block
(cp.async); after the wait the warp takes those groups from its slots, then the rest through
the register loop, whose first loads are issued before the wait as without.  It is what is
left of the ring (below): a persistent step's essence -- weights in flight before the inputs
are -- inside the kernel as it is.  H200, 2026-12-02, ms a step at 512 / 8K / 32K: down P = 1
-0.016 / -0.018 / -0.016, P = 3 +0.017; o_proj P = 1 +0.009 (docs/PERF.md).

l2ahead (`MmaTiling.l2ahead=P`; the 7B's gate_up P = 1, o_proj P = 2): when a warp issues the
loads of its group g, lane 0 (lane 1: gate_up's up tile) asks L2 for the same tile's group
g + P * warps (`to_l2`, one cp.async.bulk.prefetch.L2 of its contiguous 1 KB), and the
prologue for the first P after `first`, before the wait.  H200, 2026-12-03: both -0.010 /
-0.018 / -0.018 ms; down lost at every P, P > 2 everywhere (docs/PERF.md 0.16).

xacc (`MmaTiling.xacc`, gate_up and down; opt-in with attn_o_proj's acc form, the step's
`attn.fuse_o=2`): x's value is x + xacc * 2^-32, xacc (N,) int64 as 2N uint32 words into which
attn_o_proj added its heads' shares of o_proj (red.add.u64: integer sums in any order give the
same bits, so no block waits for the others).  gate_up stages rmsnorm(x + xacc * 2^-32) (its
loads beside x's, gemv_mma_stage.scaled_group); down reads xacc beside x after the wait, writes
x + xacc * 2^-32 + its sums and zeroes xacc for the next layer: one writer an element.  Each
int64 is rounded once to fp32, then scaled exactly (dequant.fixed_to_f32); docs/PERF.md 0.23.

Retired, each after it lost in the 7B step (docs/KERNELS_GEMV.md, "Retired variants"):
prefetch=2 and splits (13c221c), preload=2 (c936f73), ring (805e084, 6362a1e), a down block
beside gate_up's (0f4633d), gate_up's sets=3 and apart (a8a7e72), gate_up and down as one
kernel (bc19524), the copy-engine feed (3ba57e0), stream-K down (c922c89), down asking L2
for the next layer's qkv (`l2next`) and the weights' loads with an evict_first policy
(`evict`), both at bb95d7a (docs/PERF.md 0.39).  And the
"fp32-accurate step" (NQ_MMA_QKV=1; tiling.py's epitaph), as accurate as the default since
docs/PERF.md 0.30 and ~0.07 ms a step slower (H100 SXM, 2026-12-07), code at 29184bc:
qkv / qkv_rope here, rows in RoPE-pair order: +0.043..+0.053 ms a step at 512 (H200, 2026-12-02);
hilo, gate_up's and qkv's h as fp16 hi + lo in B's even / odd columns: +0.008..+0.025 ms.

The fragment layout decides the weight layout (`layout.mma_layout`, a NumPy model; the
kernel's loads mirror it).  With g = lane // 4 and t = lane % 4, lane (g, t) of a 16-row tile
holds for each 16-column chunk of K the word whose nibble slots are

    slot 0, 4: W[g,   2t], W[g,   2t+1]      -> (q & 0x000F000F) ^ 0x64086408 - 1032  = a0
    slot 1, 5: W[g+8, 2t], W[g+8, 2t+1]      -> (q & 0x00F000F0) ^ 0x64806480, fma    = a1
    slot 2, 6: W[g,   2t+8], W[g,   2t+9]    -> the same on q >> 8                    = a2
    slot 3, 7: W[g+8, 2t+8], W[g+8, 2t+9]                                             = a3

so the dequant is gemv.py's, instruction for instruction (nq/ptx/mma.py has the fragment
coordinates).  Memory order: [tile][group][lane][8 words] -- a group (128 columns = 8 chunks)
of a tile is 1 KB, each lane's 32 bytes of it two 16-byte loads.  Scales stay in the file's
(N, K/128) layout (a lane reads rows g and g+8).

A block is threads / 32 / warps row tiles of 16 rows (`MmaTiling`); the `warps` warps of a
tile split its groups (warp w: groups w, w + warps, ...), each accumulating fp32
`mma(A, B) * scale` per group (the products of fp16 are exact, the sums fp32: closer to the
fp64 reference than gemv.py's fp16 partials).  The block stages `a` in shared memory once, in
B-fragment order: chunk c, lane t reads the 8 bytes (a[16c+2t : 16c+2t+2],
a[16c+2t+8 : 16c+2t+10]).  B's 8 columns are all `a` (lanes with the same t load the same
bytes), so every column of D is the dot product and lane (g, t) holds rows g (d0) and g+8
(d2).  The warps' partials meet in shared memory and one thread a row adds them in a fixed
order: deterministic, one writer per x element.

gate_up (13c221c's kernel, ported): a warp holds a tile of gate rows and the same rows of up
(the stacked [gate; up] matrix's tile + I/16), so each B fragment serves 32 rows.  Its
activations are staged as gemv.py's gate_up stages them, value for value: x * norm_w times a
power of two f_g per group that puts the group's absmax in [128, 256) (exact; fp16 cannot
overflow whatever x holds), each group's sums scaled by 1/f_g, the rows by rstd, then
silu(g) * u in fp32 and one fp16 store, as gemv.py's put_swiglu.  rstd is gemv.py's
arithmetic too (a lane's sum of squares over its groups, the warp's butterfly, the warps' sums
in order), equal to the bit where the two kernels have as many warps.

i8 (`MmaTiling.i8`, every kind; gate_up's default, down's lost: tiling.py's epitaph): the
weights' nibbles moved to the top of their bytes (16 n as a signed byte, 3 instructions a word
against the fp16 dequant's 9) times the activations as integers, x = rni(v * 2^14) staged as
three signed-byte digits in three planes (stage_digits), on `mma.sync.m16n8k32.s8`: lane (g, t)
reads plane min(g, 2), so D's columns 0-2 are the exact int32 dot products with hi, mid and lo,
which lanes t = 0 and 1 weigh and join after the loop (`lo_to_t0`).  22 bits of each group's
absmax, ~fp32 accuracy, a third fewer instructions a group; a group is 384 bytes of digits (the
7B's down stages 57 KB, in dynamic shared memory).  gemv_mma_weights.kstep / group_dot_i8 have
the arithmetic, docs/KERNELS_GEMV.md "i8" the measurements (gate_up won, down lost).

Where the body lives: build_kernel (here) checks the shape, takes its constants from
gemv_mma_shape.py, a warp's weights (tile, loads, dequant-mma, the loop, early, l2ahead) from
gemv_mma_weights.py and the staged activations from gemv_mma_stage.py, and assembles the
kernels with the row sums and epilogues.
"""
from __future__ import annotations

import dataclasses
import functools
import math

from numba import cuda, float32, uint32, uint64  # module globals: the simulator swaps cuda

from nq.kernels.build import compile_kernel, kernel_name
from nq.kernels.common import FULL, dev
from nq.kernels.int4.dequant import fixed_to_f32
# check_tiling, dynamic_smem and launch_smem are this module's API too (launch.py, the tests)
from nq.kernels.int4.gemv_mma_shape import check_tiling, dynamic_smem, launch_smem, shape_of
from nq.kernels.int4.gemv_mma_stage import act_path
from nq.kernels.int4.gemv_mma_weights import weight_path
from nq.kernels.int4.tiling import TILE, MmaTiling
from nq.ptx import (SIMULATOR, cp_async_bulk_prefetch_l2, cp_async_wait_group, cvt_rn_f16_f32,
                    cvta_to_shared_u32, griddepcontrol_launch_dependents, griddepcontrol_wait,
                    st_global_u16)

__all__ = ["build_kernel", "check_tiling", "compile_gemv_mma", "dynamic_smem", "gemv_mma_name",
           "launch_smem"]


def gemv_mma_name(kind: str, n_out: int, k: int, t: MmaTiling, eps: float | None = None) -> str:
    """The kernel's name (profiles, launcher errors): every constant build_kernel bakes in
    (gate_up: RMSNorm's eps too)."""
    fields = dataclasses.asdict(t)
    for f in ("early", "l2ahead", "xacc", "i8"):
        if not fields[f]:
            del fields[f]                  # the names of the kernels before them stand
    extra = {} if eps is None else {"eps": eps}
    return kernel_name(f"gemv_mma_{kind}", n=n_out, k=k, **fields, **extra)


@functools.cache
def compile_gemv_mma(kind: str, n_out: int, k: int, t: MmaTiling, eps: float | None = None):
    """The compiled kernel (or the simulator's), once per process for each set of constants."""
    body, sig = build_kernel(kind, n_out, k, t, eps)
    bounds = (t.threads, t.min_blocks) if t.min_blocks else (t.threads,)
    return compile_kernel(body, sig, gemv_mma_name(kind, n_out, k, t, eps), launch_bounds=bounds)


@functools.cache
def build_kernel(kind: str, n_out: int, k: int, t: MmaTiling, eps: float | None = None):
    """The kernel body and its signature: o_proj / down, x (N,) fp32 += W . a, a (K,) fp16;
    gate_up (eps: RMSNorm's), out (N,) fp16 = silu(Wg . h) * (Wu . h), h = rmsnorm(x, norm_w),
    the weights [gate; up] stacked (2N rows)."""
    check_tiling(kind, n_out, k, t)
    if (kind == "gate_up") != (eps is not None):
        raise ValueError(f"gemv_mma: eps is RMSNorm's, for gate_up only (kind {kind!r}, eps {eps})")
    s = shape_of(kind, n_out, k, t, eps)   # the constants (gemv_mma_shape.py says what each is)
    TILE_WARPS, WARPS, TILES, GROUPS = s.TILE_WARPS, s.WARPS, s.TILES, s.GROUPS
    MATS, PARTIALS, ACT_ALLOC = s.MATS, s.PARTIALS, s.ACT_ALLOC
    EARLY, L2AHEAD, XACC = s.EARLY, s.L2AHEAD, s.XACC
    I8 = s.I8
    # the body's two halves: a warp's weights (gemv_mma_weights.py), the staged activations
    # (gemv_mma_stage.py); the names below are the device functions the rest calls
    w, a_ = weight_path(s), act_path(s)
    roles, tile_bases, load_both, mainloop = w.roles, w.tile_bases, w.load_both, w.mainloop
    ahead_prologue, early_prologue, early_loop = w.ahead_prologue, w.early_prologue, w.early_loop
    b_lane = w.b_lane
    stage, stage_norm, stage_digits = a_.stage, a_.stage_norm, a_.stage_digits

    def out_row():
        # the epilogue's thread: (tile in the block, row in the tile, row of the output); only
        # threads below TILES * TILE have one (row -1 otherwise, or past the matrix)
        tid = cuda.threadIdx.x
        tl2 = tid // TILE
        r = tid % TILE
        row = (cuda.blockIdx.x * TILES + tl2) * TILE + r
        return tl2, r, row if tid < TILES * TILE and row < n_out else -1

    def lo_to_t0(acc):
        # i8: each accumulator plus lane ^ 1's (t = 1's into t = 0; put_partials reads t = 0)
        return (acc[0] + cuda.shfl_xor_sync(FULL, acc[0], 1),
                acc[1] + cuda.shfl_xor_sync(FULL, acc[1], 1),
                acc[2] + cuda.shfl_xor_sync(FULL, acc[2], 1),
                acc[3] + cuda.shfl_xor_sync(FULL, acc[3], 1))

    def put_partials(red, tl, kw, g, t4, acc):
        # lane t = 0 of each row pair: the warp's sums of rows g and g+8 (and the up tile's)
        if t4 == 0:
            o = (tl * TILE_WARPS + kw) * TILE * MATS + g
            red[o] = acc[0]
            red[o + 8] = acc[1]
            if MATS == 2:
                red[o + TILE] = acc[2]
                red[o + TILE + 8] = acc[3]

    def row_sum(red, tl, r, m):
        # row r of tile tl (m: 0, or 1 for the up tile): the TILE_WARPS warps' partials in a
        # fixed order
        s = float32(0.0)
        for w_ in range(TILE_WARPS):
            s += red[(tl * TILE_WARPS + w_) * TILE * MATS + m * TILE + r]
        return s

    def block_sums(a, qw, sc, x, xa, act, red, dyn):
        """o_proj / down up to the warps' partials in `red`: (row, tl2, r, xr) for
        row_sum(red, tl2, r, 0), the thread's output row (-1 for threads without one) and
        x[row] as it was, read right after the wait so that the epilogue's x += waits on no L2.
        With EARLY, the warp's first EARLY groups come from their slots in `dyn` (copied
        before the wait), mainloop's from group kw + EARLY * TILE_WARPS on; else dyn is a
        stand-in never read.  xa: xacc's words (XACC: xr is x + xacc * 2^-32), else a
        stand-in never read.  With I8, red holds the groups' 1/f_g after the partials."""
        lane, g, t4, tl, kw, tile = roles()
        invf = red        # (a stand-in without i8: only gate_up and i8 read invf)
        if I8:
            invf = red[PARTIALS:]
        bases = tile_bases(tile, lane, g)
        if EARLY:
            early_prologue(qw, sc, dyn, bases, tile, tl, kw, lane, cuda.threadIdx.x >> 5)
        kr = kw + EARLY * TILE_WARPS      # the register loop's first group
        first = load_both(qw, sc, bases, min(kr, GROUPS - 1))  # weights wait for nothing
        if L2AHEAD:
            ahead_prologue(qw, bases, kr)
        griddepcontrol_wait()
        griddepcontrol_launch_dependents()
        tl2, r, row = out_row()
        xr = float32(0.0)
        if row >= 0:
            xr = x[row]
            if XACC:
                xr += fixed_f32(xa[2 * row], xa[2 * row + 1])
        if I8:
            stage_digits(a, act, invf)
        else:
            stage(a, act)
        if EARLY:
            cp_async_wait_group(0)      # this thread's scale copies; the barrier: everyone's
        cuda.syncthreads()
        # widened here, once: the chunk offsets added to it are 64-bit sums anyway (kept as a
        # 32-bit value the PTX comes out in another order)
        abase = b_lane(uint64(cvta_to_shared_u32(act)), g, t4)
        if EARLY:
            a0, a1, a2, a3 = early_loop(dyn, abase, t4, invf)
            b0, b1, b2, b3 = mainloop(qw, sc, abase, bases, kr, t4, first, invf)
            acc = (a0 + b0, a1 + b1, a2 + b2, a3 + b3)
        else:
            acc = mainloop(qw, sc, abase, bases, kr, t4, first, invf)
        if I8:     # lane t = 1's lo column to lane t = 0's hi and mid
            acc = lo_to_t0(acc)
        put_partials(red, tl, kw, g, t4, acc)
        cuda.syncthreads()
        return row, tl2, r, xr

    def norm_to_l2(norm_w):
        # gemv.py's: the norm's weights into L2 before the wait, so that the staging after it
        # waits on L2, not DRAM
        if cuda.threadIdx.x == 0:
            cp_async_bulk_prefetch_l2(norm_w, 0, 2 * k)

    def gate_up_sums(x, xa, norm_w, qw, sc, act, red, invf, ssum):
        """gate_up up to the warps' partials in `red`: (row, tl2, r, rstd) for
        row_sum(red, tl2, r, 0 / 1), the thread's output row; row -1 for threads without one."""
        lane, g, t4, tl, kw, tile = roles()
        bases = tile_bases(tile, lane, g)
        first = load_both(qw, sc, bases, min(kw, GROUPS - 1))
        if L2AHEAD:
            ahead_prologue(qw, bases, kw)
        norm_to_l2(norm_w)
        griddepcontrol_wait()
        griddepcontrol_launch_dependents()
        rstd = stage_norm(x, xa, norm_w, act, invf, ssum)   # ends with a __syncthreads
        abase = b_lane(uint64(cvta_to_shared_u32(act)), g, t4)
        acc = mainloop(qw, sc, abase, bases, kw, t4, first, invf)
        if I8:     # lane t = 1's lo column to lane t = 0's hi and mid
            acc = lo_to_t0(acc)
        put_partials(red, tl, kw, g, t4, acc)
        cuda.syncthreads()
        tl2, r, row = out_row()
        return row, tl2, r, rstd

    lo_to_t0 = dev(lo_to_t0)
    out_row, put_partials, row_sum, block_sums, norm_to_l2, gate_up_sums = (
        dev(f) for f in (out_row, put_partials, row_sum, block_sums, norm_to_l2, gate_up_sums))
    fixed_f32 = dev(fixed_to_f32)

    if kind == "gate_up":
        def swiglu(x, xa, norm_w, qw, sc, out):
            # xa: xacc's words (XACC: h of x + xacc * 2^-32), else x, never read
            act = cuda.shared.array(ACT_ALLOC, uint32, alignment=None if SIMULATOR else 16)
            red = cuda.shared.array(PARTIALS, float32)
            invf = cuda.shared.array(GROUPS, float32)
            ssum = cuda.shared.array(WARPS, float32)
            row, tl2, r, rstd = gate_up_sums(x, xa, norm_w, qw, sc, act, red, invf, ssum)
            if row >= 0:
                gt = row_sum(red, tl2, r, 0) * rstd
                up = row_sum(red, tl2, r, 1) * rstd
                y = gt / (float32(1.0) + math.exp(-gt)) * up     # gemv.py's put_swiglu
                st_global_u16(out, row, cvt_rn_f16_f32(y))

        swiglu = dev(swiglu)
        if XACC:
            def kernel(x, xa, norm_w, qw, sc, out):
                swiglu(x, xa, norm_w, qw, sc, out)
            return kernel, ("void(float32[::1], uint32[::1], float16[::1], uint32[::1], "
                            "float16[::1], float16[::1])")

        def kernel(x, norm_w, qw, sc, out):
            swiglu(x, x, norm_w, qw, sc, out)
        return kernel, "void(float32[::1], float16[::1], uint32[::1], float16[::1], float16[::1])"
    # o_proj and down: x = x (+ xacc * 2^-32, XACC: then xacc zeroed) + the row's sums.  Four
    # bodies for where the activations and early's slots live (static or dynamic shared
    # memory), each a device function the kernel below calls with xacc's words or x as their
    # stand-in (the default kernels' PTX as before: ptx_hashes)
    def put_residual(x, xa, row, tl2, r, xr, red):
        if row >= 0:
            x[row] = xr + row_sum(red, tl2, r, 0)
            if XACC:
                xa[2 * row] = uint32(0)
                xa[2 * row + 1] = uint32(0)

    put_residual = dev(put_residual)
    # i8: invf (1/f_g a group) after the partials in `red` (block_sums)
    RED_N = PARTIALS + GROUPS if I8 else PARTIALS
    if EARLY and not dynamic_smem(k, t):
        def residual(a, qw, sc, x, xa):
            act = cuda.shared.array(ACT_ALLOC, uint32, alignment=None if SIMULATOR else 16)
            red = cuda.shared.array(RED_N, float32)
            dyn = cuda.shared.array(0, uint32)   # launch_smem bytes: slots, scales, barriers
            row, tl2, r, xr = block_sums(a, qw, sc, x, xa, act, red, dyn)
            put_residual(x, xa, row, tl2, r, xr, red)
    elif EARLY:
        def residual(a, qw, sc, x, xa):  # the activations at the start of the dynamic array
            dyn = cuda.shared.array(0, uint32)
            red = cuda.shared.array(RED_N, float32)
            row, tl2, r, xr = block_sums(a, qw, sc, x, xa, dyn, red, dyn)
            put_residual(x, xa, row, tl2, r, xr, red)
    elif not dynamic_smem(k, t):
        def residual(a, qw, sc, x, xa):
            act = cuda.shared.array(ACT_ALLOC, uint32, alignment=None if SIMULATOR else 16)
            red = cuda.shared.array(RED_N, float32)
            row, tl2, r, xr = block_sums(a, qw, sc, x, xa, act, red, red)  # (red: dyn's stand-in)
            put_residual(x, xa, row, tl2, r, xr, red)
    else:
        def residual(a, qw, sc, x, xa):  # the same body, the activations in dynamic shared memory
            act = cuda.shared.array(0, uint32)  # ACT_ALLOC at launch; 16-byte aligned base
            red = cuda.shared.array(RED_N, float32)
            row, tl2, r, xr = block_sums(a, qw, sc, x, xa, act, red, red)  # (red: dyn's stand-in)
            put_residual(x, xa, row, tl2, r, xr, red)

    residual = dev(residual)
    if XACC:   # down with xacc folded into x and zeroed
        def kernel(a, qw, sc, x, xa):
            residual(a, qw, sc, x, xa)
        return kernel, "void(float16[::1], uint32[::1], float16[::1], float32[::1], uint32[::1])"

    def kernel(a, qw, sc, x):
        residual(a, qw, sc, x, x)

    return kernel, "void(float16[::1], uint32[::1], float16[::1], float32[::1])"
