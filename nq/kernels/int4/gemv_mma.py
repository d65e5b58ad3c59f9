"""The INT4 residual GEMVs on the tensor cores: o_proj and down, x (N,) fp32 += W . a, a fp16.

Why: ncu read the CUDA-core GEMV (gemv.py) for down as issue-bound, not memory-bound (0.61
instructions issued a cycle per scheduler, DRAM at 38 % of peak; docs/KERNELS_GEMV.md).  Per 8
weights it spends 9 instructions turning nibbles into fp16 pairs and 4 fma.f16x2 multiplying
them with activations it read from shared memory (one 16-byte load a word).  Here the same 9
dequant instructions build the A fragment of one `mma.sync.m16n8k16` (fp16 in, fp32 out),
which replaces the 4 fmas, and one 8-byte B fragment of activations serves the 16 rows of the
tile: ~10 instructions per 8 weights instead of ~14.  The default for o_proj and down
(`tiling.mma_tiling`; the 7B step -0.14 ms, docs/KERNELS_GEMV.md).

Retired, each after it lost in the 7B step graph on the H200 (docs/PERF.md, 0.5 rows):
    gate_up on the tensor cores: +0.017 ms a step (ks2 t256), ks4 t256 +0.084, ks1 t128 +0.51; code at 13c221c
    prefetch=2 (two groups' loads in flight): down +0.039 / +0.037 ms a step at 512 / 8K; code at 13c221c
    splits (split-K, the last block adds the partials): down +0.042..+0.167 ms a step; code at 13c221c

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
"""
from __future__ import annotations

import dataclasses
import functools

from numba import cuda, float32, uint32, uint64

from nq.config import GROUP_SIZE
from nq.kernels.build import compile_kernel, kernel_name
from nq.kernels.common import SMEM_OPTIN_LIMIT, STATIC_SMEM_LIMIT, dev
from nq.kernels.int4.dequant import dequant_word
from nq.kernels.int4.layout import CHUNK
from nq.kernels.int4.tiling import MMA_KINDS, TILE, MmaTiling
from nq.ptx import (SIMULATOR, cvt_f32_f16, cvta_to_shared_u32, griddepcontrol_launch_dependents,
                    griddepcontrol_wait, ld_global_nc_u16, ld_global_nc_v4_u32,
                    ld_shared_v2_u32_at, mma_sync_m16n8k16_f16_f32)


def check_tiling(kind: str, n_out: int, k: int, t: MmaTiling) -> None:
    """Refuse what the kernel cannot do, with what to use instead."""
    if kind not in MMA_KINDS:
        raise ValueError(f"gemv_mma: kind {kind!r} is not one of {MMA_KINDS} (the CUDA-core "
                         f"kernel, gemv.py, takes the others)")
    if not isinstance(t, MmaTiling):
        raise ValueError(f"gemv_mma: {t} is not an MmaTiling (a Tiling is gemv.py's)")
    if n_out % TILE or k % GROUP_SIZE:
        raise ValueError(f"gemv_mma: N={n_out} must be a multiple of {TILE} (an mma tile) and "
                         f"K={k} of {GROUP_SIZE}")
    if t.warps < 1 or t.threads % (32 * t.warps) or t.threads > 1024:
        raise ValueError(f"gemv_mma: tiling {t.tag()}: threads must be a multiple of 32*warps "
                         f"(warps = those a tile's groups are split over) and at most 1024")
    partials = (t.threads // 32) * TILE * 4
    if k * 2 + partials > SMEM_OPTIN_LIMIT:
        raise ValueError(f"gemv_mma: K={k} needs {k * 2} bytes of staged activations, over the "
                         f"{SMEM_OPTIN_LIMIT}-byte shared memory of a block")


def dynamic_smem(k: int) -> int:
    """Bytes of dynamic shared memory a launch needs: 0 while the staged activations (2K
    bytes) fit the 48 KB of static shared memory (every shape up to the 14B), else all of
    them (the 32B's down, K = 27,648: 55 KB), with the kernel opted in (`allow_smem`)."""
    return 0 if k * 2 <= STATIC_SMEM_LIMIT else k * 2


def gemv_mma_name(kind: str, n_out: int, k: int, t: MmaTiling) -> str:
    """The kernel's name (profiles, launcher errors): every constant build_kernel bakes in."""
    return kernel_name(f"gemv_mma_{kind}", n=n_out, k=k, **dataclasses.asdict(t))


@functools.cache
def compile_gemv_mma(kind: str, n_out: int, k: int, t: MmaTiling):
    """The compiled kernel (or the simulator's), once per process for each set of constants."""
    body, sig = build_kernel(kind, n_out, k, t)
    bounds = (t.threads, t.min_blocks) if t.min_blocks else (t.threads,)
    return compile_kernel(body, sig, gemv_mma_name(kind, n_out, k, t), launch_bounds=bounds)


@functools.cache
def build_kernel(kind: str, n_out: int, k: int, t: MmaTiling):
    """The kernel body (x (N,) fp32 += W . a, a (K,) fp16) and its signature."""
    check_tiling(kind, n_out, k, t)
    # The constants the body closes over (numba freezes them):
    #   TILE_WARPS   warps a tile's groups are split over (MmaTiling.warps)
    #   THREADS, WARPS, TILES      a block's threads, warps and 16-row tiles
    #   GROUPS, N_TILES            a row's groups, the matrix's tiles
    #   PAIRS        two-group iterations of a warp's loop (the last may be short)
    #   CHUNKS, ACT_WORDS          k16 chunks of `a`, and its staged uint32 words
    #   PARTIALS     the warps' row partials in shared memory
    TILE_WARPS = t.warps
    THREADS = t.threads
    WARPS = THREADS // 32
    TILES = WARPS // TILE_WARPS
    GROUPS = k // GROUP_SIZE
    N_TILES = n_out // TILE
    PAIRS = -(-GROUPS // (2 * TILE_WARPS))
    CHUNKS = GROUPS * (GROUP_SIZE // CHUNK)
    ACT_WORDS = CHUNKS * 8
    PARTIALS = TILES * TILE_WARPS * TILE
    STAGE_ITERS = -(-CHUNKS // THREADS)

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

    def dequant_mma(q, b0, b1, d):
        # one k16 chunk: the word's 8 weights as the A fragment (gemv.py's dequant), times B
        a0, a1, a2, a3 = dequant(q)
        return mma_sync_m16n8k16_f16_f32(a0, a1, a2, a3, b0, b1, d[0], d[1], d[2], d[3])

    def chunk(q, baddr, d):
        # one k16 chunk: its B fragment from shared memory, then the mma
        b0, b1 = ld_shared_v2_u32_at(baddr)
        return dequant_mma(q, b0, b1, d)

    def group_dot(c, abase, grp, t4):
        """Rows g and g+8 of one group, fp32, times their weight scales; then two zeros
        (mainloop says why).  Written out, not looped: tuple elements need literal indices to
        stay in registers."""
        z = float32(0.0)
        d = (z, z, z, z)
        b = abase + uint32(grp * (GROUP_SIZE // CHUNK) * 32) + uint32(t4 * 8)  # chunk stride 32 B
        d = chunk(c[0], b, d)
        d = chunk(c[1], b + uint32(32), d)
        d = chunk(c[2], b + uint32(64), d)
        d = chunk(c[3], b + uint32(96), d)
        d = chunk(c[4], b + uint32(128), d)
        d = chunk(c[5], b + uint32(160), d)
        d = chunk(c[6], b + uint32(192), d)
        d = chunk(c[7], b + uint32(224), d)
        return (d[0] * cvt_f32_f16(c[8]), d[2] * cvt_f32_f16(c[9]),
                z * cvt_f32_f16(c[8]), z * cvt_f32_f16(c[9]))

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

    def add_group(acc, c, abase, grp, t4):
        # acc + group grp's sums (none past the last group)
        a0, a1, a2, a3 = acc
        if grp < GROUPS:
            v0, v1, v2, v3 = group_dot(c, abase, grp, t4)
            a0 += v0
            a1 += v1
            a2 += v2
            a3 += v3
        return a0, a1, a2, a3

    def mainloop(qw, sc, abase, wbase, sbase, kw, t4, c):
        """The warp's groups kw, kw + TILE_WARPS, ..., two an iteration, into two register
        sets that take turns (no copies): each group's loads are issued a group ahead of its
        math.  The conditions are the same for the whole warp: the mma sees all 32 lanes.
        c: the first group's loads (issued before griddepcontrol.wait).

        acc is rows g and g+8, then two sums that stay zero: the retired gate_up kernel's
        up-tile rows.  In a loop LLVM does not unroll (down's) their adds survive as 2 dead
        fma.f32 a group, never stored; dropping them changes the default kernels' PTX, so
        that is left to a deliberate change measured on the device."""
        z = float32(0.0)
        acc = (z, z, z, z)
        for it in range(PAIRS):
            ga = kw + 2 * it * TILE_WARPS
            gb = ga + TILE_WARPS
            n = load_group(qw, sc, wbase, sbase, min(gb, GROUPS - 1))
            acc = add_group(acc, c, abase, ga, t4)
            c = load_group(qw, sc, wbase, sbase, min(gb + TILE_WARPS, GROUPS - 1))
            acc = add_group(acc, n, abase, gb, t4)
        return acc

    def first_loads(qw, sc, wbase, sbase, kw):
        # the warp's first group's loads, for before griddepcontrol.wait: weights depend on
        # nothing upstream
        return load_group(qw, sc, wbase, sbase, min(kw, GROUPS - 1))

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
        # where the lane's words of a tile start (256 a group) and its row g's scales
        return (tile * GROUPS * 32 + lane) * 8, (tile * TILE + g) * GROUPS

    def out_row():
        # the epilogue's thread: (tile in the block, row in the tile, row of the output); only
        # threads below TILES * TILE have one (row -1 otherwise, or past the matrix)
        tid = cuda.threadIdx.x
        tl2 = tid // TILE
        r = tid % TILE
        row = (cuda.blockIdx.x * TILES + tl2) * TILE + r
        return tl2, r, row if tid < TILES * TILE and row < n_out else -1

    def put_partials(red, tl, kw, g, t4, acc):
        # lane t = 0 of each row pair: the warp's sums of rows g and g+8
        if t4 == 0:
            o = (tl * TILE_WARPS + kw) * TILE + g
            red[o] = acc[0]
            red[o + 8] = acc[1]

    def row_sum(red, tl, r):
        # row r of tile tl: the TILE_WARPS warps' partials in a fixed order
        s = float32(0.0)
        for w_ in range(TILE_WARPS):
            s += red[(tl * TILE_WARPS + w_) * TILE + r]
        return s

    def block_sums(a, qw, sc, act, red):
        """Everything up to the warps' partials in `red`: (row, tl2, r) for
        row_sum(red, tl2, r), the thread's output row; row -1 for threads without one."""
        lane, g, t4, tl, kw, tile = roles()
        wbase, sbase = tile_bases(tile, lane, g)
        first = first_loads(qw, sc, wbase, sbase, kw)
        griddepcontrol_wait()
        griddepcontrol_launch_dependents()
        stage(a, act)
        cuda.syncthreads()
        # widened here, once: the chunk offsets added to it are 64-bit sums anyway (kept as a
        # 32-bit value the PTX comes out in another order)
        abase = uint64(cvta_to_shared_u32(act))
        acc = mainloop(qw, sc, abase, wbase, sbase, kw, t4, first)
        put_partials(red, tl, kw, g, t4, acc)
        cuda.syncthreads()
        tl2, r, row = out_row()
        return row, tl2, r

    dequant = dev(dequant_word)
    load_words, load_scales, load_group, dequant_mma, chunk, group_dot, stage, add_group, \
        mainloop, first_loads, roles, tile_bases, out_row, put_partials, row_sum, block_sums = (
            dev(f) for f in (load_words, load_scales, load_group, dequant_mma, chunk, group_dot,
                             stage, add_group, mainloop, first_loads, roles, tile_bases, out_row,
                             put_partials, row_sum, block_sums))

    if not dynamic_smem(k):
        def kernel(a, qw, sc, x):
            act = cuda.shared.array(ACT_WORDS, uint32, alignment=None if SIMULATOR else 16)
            red = cuda.shared.array(PARTIALS, float32)
            row, tl2, r = block_sums(a, qw, sc, act, red)
            if row >= 0:
                x[row] += row_sum(red, tl2, r)
    else:
        def kernel(a, qw, sc, x):  # the same body, the activations in dynamic shared memory
            act = cuda.shared.array(0, uint32)  # ACT_WORDS at launch; 16-byte aligned base
            red = cuda.shared.array(PARTIALS, float32)
            row, tl2, r = block_sums(a, qw, sc, act, red)
            if row >= 0:
                x[row] += row_sum(red, tl2, r)

    return kernel, "void(float16[::1], uint32[::1], float16[::1], float32[::1])"
