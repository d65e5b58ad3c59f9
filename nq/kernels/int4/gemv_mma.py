"""The INT4 GEMVs on the tensor cores: o_proj and down, x (N,) fp32 += W . a, a fp16; gate_up,
out (I,) fp16 = silu(Wg . h) * (Wu . h), h = rmsnorm(x, norm_w); and qkv and qkv_rope
(gemv.py's contracts, fp32 sums).  o_proj, down and gate_up by default (NQ_MMA_GATE_UP=0 moves
gate_up back to the CUDA cores); qkv with NQ_MMA_QKV=1, the fp32-accurate step.

Why: ncu read the CUDA-core GEMV (gemv.py) for down as issue-bound, not memory-bound (0.61
instructions issued a cycle per scheduler, DRAM at 38 % of peak; docs/KERNELS_GEMV.md).  Per 8
weights it spends 9 instructions turning nibbles into fp16 pairs and 4 fma.f16x2 multiplying
them with activations it read from shared memory (one 16-byte load a word).  Here the same 9
dequant instructions build the A fragment of one `mma.sync.m16n8k16` (fp16 in, fp32 out),
which replaces the 4 fmas, and one 8-byte B fragment of activations serves the 16 rows of the
tile: ~10 instructions per 8 weights instead of ~14.  The default for o_proj and down
(`tiling.mma_tiling`; the 7B step -0.14 ms, docs/KERNELS_GEMV.md).

gate_up here costs +0.036 ms a decode step against the CUDA-core kernel, and is the default
since d292fd2 (NQ_MMA_GATE_UP=0 turns it off) because the prefill GEMMs read its layout ~1.3x
faster (a 512-token prompt 22.0 -> 18.9 ms on the H200, 2026-12-01); its sums are fp32.

qkv and qkv_rope (NQ_MMA_QKV=1, the fp32-accurate step with hilo below; +0.053 ms a decode
step at 512 on the H200, 2026-12-02, so not the default; tiling.py has the figures): gemv.py's
qkv_rope wants one thread to own a RoPE pair, rows i and i + D/2 of a head, and a lane holds
tile rows g and g + 8; so qkv's mma layout reorders each head's rows (layout.rope_row: tile j
of a head holds rows 8j..8j+7 and their partners 8j+D/2..), the tiling carries the head_dim
(`MmaTiling.rope`), and scales stay in file order (a lane reads rows r0 and r0 + D/2).  The
activations are staged as gate_up's (stage_norm: x * norm_w * f_g, rstd), the warps' partials
meet in shared memory as o_proj's, and one thread a pair (threads < 8 * tiles) sums rows g and
g + 8 and runs rope_epilogue.py's epilogue unchanged: q_out in natural order, the K/V slot, v
as it is -- qkv_rope's outputs with fp32 sums instead of fp16 partials; kind "qkv" writes the
pair's two natural rows + bias.  One tile a block is possible (a pair never leaves its tile):
the 7B's qkv runs o_proj's 14 warps a tile, 288 blocks.  The prefill GEMMs read this layout
("mma_rope", D) and put their output columns back in order in the epilogue.

early (`MmaTiling.early=P`, o_proj and down; down's 7B default is P = 1): before
griddepcontrol.wait, lane 0 of each warp bulk-copies its first P groups (1 KB each) into slots
of shared memory counted off an mbarrier a slot, and the tile's warps copy its scale block
(cp.async); after the wait the warp takes those groups from its slots, then the rest through
the register loop, whose first loads are issued before the wait as without.  It is what is
left of the ring (below): a persistent step's essence -- weights in flight before the inputs
are -- inside the kernel as it is.  In the step on the H200 (2026-12-02) down P = 1 -0.016 /
-0.018 / -0.016 ms at 512 / 8K / 32K, P = 2 about the same, P = 3 +0.017, P = 4 +0.051; o_proj
P = 1 +0.009, P = 2 +0.026 (docs/PERF.md).

l2ahead (`MmaTiling.l2ahead=P`; the 7B's gate_up P = 1, o_proj P = 2): when a warp issues the
loads of its group g, lane 0 (lane 1: gate_up's up tile) asks L2 for the same tile's group
g + P * warps (`to_l2`, one cp.async.bulk.prefetch.L2 of its contiguous 1 KB), and the
prologue for the first P after `first`, before the wait.  In the step on the H200 (2026-12-03)
both together -0.010 / -0.018 / -0.018 ms at 512 / 8K / 32K; down lost at every P, and P > 2
loses everywhere (docs/PERF.md 0.16).

Retired, each after it lost in the 7B step graph on the H200 (docs/KERNELS_GEMV.md, "Retired
variants", has their figures): prefetch=2 and splits (code at 13c221c), preload=2 (c936f73),
ring=R, the weights through shared memory, R groups a warp refilled as they were used
(per-lane cp.async 805e084, cp.async.bulk 6362a1e; early keeps its prologue).  And a down
block small enough to be resident beside gate_up's (128 threads, 2 warps a tile, early=42:
57 % of down's weights copied into shared memory while gate_up streams; MAX_EARLY raised,
code at 0f4633d): +0.59..+0.67 ms a step, +0.47..+0.51 at 192 threads -- four or six warps
an SM cannot do down's math, wherever its weights wait (docs/PERF.md 0.14).  And for gate_up
(a8a7e72 holds both; docs/PERF.md 0.17): sets=3, three register sets so a group's loads go
out two groups ahead (96 registers + 12 B spilled at 576 threads), +0.066 / +0.065 / +0.078;
apart=1, a warp computing gate or up alone (56 registers, three 384-thread blocks an SM, 36
warps instead of 18), -0.014 / -0.004 / +0.007 for 21 % more instructions.

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

hilo (`MmaTiling.hilo`, gate_up's and qkv's with NQ_MMA_QKV=1): B has 8 columns and a GEMV
needs one, so the columns carry the activations twice over: lanes of even g load hi =
fp16(v), lanes of odd g load lo = fp16(v - hi) (staged 8 words past hi, other banks), and a
lane's d0 + d1 (d2 + d3) is row g's (g+8's) dot product with v to ~2^-22 of each value
instead of 2^-11: the fp32 activations at no extra mma.  Only gate_up and qkv can: they stage
rmsnorm(x) from the fp32 residual themselves, while o_proj and down read fp16 that earlier
kernels wrote.  On a 2-layer
model of the 7B width the decode tier's error went 1.19e-3 -> 4.82e-4 of the logit spread with
qkv on the tensor cores (H200, 2026-12-02; a NumPy model of the roundings had put h's share
at ~40 %, the KV cache's fp16 at ~30 %, the attention output's and SwiGLU's at the rest).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
from numba import cuda, float32, uint32, uint64

from nq.config import GROUP_SIZE
from nq.kernels.build import compile_kernel, kernel_name
from nq.kernels.common import (SMEM_OPTIN_LIMIT, STATIC_SMEM_LIMIT, block_rstd, dev, warp_max,
                               warp_sum)
from nq.kernels.int4.dequant import dequant_word, pow2_scale_f32
from nq.kernels.int4.layout import CHUNK
from nq.kernels.int4.rope_epilogue import put_rope_body
from nq.kernels.int4.tiling import MMA_KINDS, ROPE_KINDS, TILE, MmaTiling, hilo_bytes
from nq.paged import PAGE, STATE_POS
from nq.ptx import (SIMULATOR, cp_async_bulk_g2s, cp_async_bulk_prefetch_l2,
                    cp_async_cg_shared_global_16,
                    cp_async_commit_group, cp_async_wait_group, cvt_f32_f16, cvt_rn_f16_f32,
                    cvta_to_shared_u32, fence_mbarrier_init,
                    griddepcontrol_launch_dependents, griddepcontrol_wait, ld_global_nc_u16,
                    ld_global_nc_v2_u32, ld_global_nc_v4_f32, ld_global_nc_v4_u32,
                    ld_shared_v2_u32_at, ld_shared_v4_u32_at, mma_sync_m16n8k16_f16_f32,
                    mbarrier_arrive, mbarrier_arrive_expect_tx, mbarrier_init,
                    mbarrier_wait_parity, pack_f16x2_from_f32, st_global_u16,
                    unpack_f16x2_to_f32)


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
    if t.hilo and kind not in NORM_KINDS:
        raise ValueError(f"gemv_mma: tiling {t.tag()}: hilo (h staged as fp16 hi + lo) is for "
                         f"{NORM_KINDS}, which stage rmsnorm(x) themselves; {kind}'s activations "
                         f"arrive in fp16")
    if t.hilo and hilo_bytes(k) > STATIC_SMEM_LIMIT:
        raise ValueError(f"gemv_mma: tiling {t.tag()}: K={k} staged as hi + lo needs "
                         f"{hilo_bytes(k)} bytes, over the {STATIC_SMEM_LIMIT} bytes of static "
                         f"shared memory; use hilo=0")
    if k * 2 + partials > SMEM_OPTIN_LIMIT:
        raise ValueError(f"gemv_mma: K={k} needs {k * 2} bytes of staged activations, over the "
                         f"{SMEM_OPTIN_LIMIT}-byte shared memory of a block")
    if kind in NORM_KINDS and dynamic_smem(k):
        raise ValueError(f"gemv_mma: {kind}'s K={k} (the hidden size) needs {k * 2} bytes of "
                         f"staged activations, over the {STATIC_SMEM_LIMIT} bytes of static "
                         f"shared memory it stages in; use the CUDA-core {kind} (a Tiling)")
    if (kind in ROPE_KINDS) != bool(t.rope):
        raise ValueError(f"gemv_mma: tiling {t.tag()}: rope (the head_dim whose RoPE pairs the "
                         f"layout puts in a tile's rows g, g + 8) is for qkv and qkv_rope, "
                         f"which need it (mma_tiling(kind, n, k, head_dim))")
    if t.early and (kind not in ("o_proj", "down") or not 1 <= t.early <= MAX_EARLY):
        raise ValueError(f"gemv_mma: tiling {t.tag()}: early (a warp's first groups copied to "
                         f"shared memory before the wait) is 1..{MAX_EARLY}, for o_proj and "
                         f"down; 0 copies none")
    if t.early and early_smem(k, t) + k * 2 * (not dynamic_smem(k)) + partials \
            > SMEM_OPTIN_LIMIT:
        raise ValueError(f"gemv_mma: tiling {t.tag()} needs {early_smem(k, t)} bytes of "
                         f"early groups and scales beside {k * 2} of activations, over the "
                         f"{SMEM_OPTIN_LIMIT}-byte shared memory of a block: a smaller early "
                         f"or fewer threads")
    if not 0 <= t.l2ahead <= MAX_L2AHEAD:
        raise ValueError(f"gemv_mma: tiling {t.tag()}: l2ahead (groups a warp asks L2 for ahead "
                         f"of its loads) is 0..{MAX_L2AHEAD}")
    if t.rope and (t.rope % TILE or n_out % t.rope):
        raise ValueError(f"gemv_mma: rope={t.rope} (head_dim) must be a multiple of {TILE} "
                         f"dividing N={n_out}")


NORM_KINDS = ("gate_up", "qkv", "qkv_rope")   # RMSNorm in the prologue (stage_norm)
FULL = 0xFFFFFFFF
MAX_EARLY = 6     # early slots a warp (shared memory: 32 warps x 6 KB is most of a block's)
MAX_L2AHEAD = 8   # a warp's groups in flight to L2 (past that, L2 holds them for too long)


def dynamic_smem(k: int) -> int:
    """Bytes of dynamic shared memory a launch needs: 0 while the staged activations (2K
    bytes) fit the 48 KB of static shared memory (every shape up to the 14B), else all of
    them (the 32B's down, K = 27,648: 55 KB), with the kernel opted in (`allow_smem`)."""
    return 0 if k * 2 <= STATIC_SMEM_LIMIT else k * 2


def early_smem(k: int, t: MmaTiling) -> int:
    """Bytes of dynamic shared memory `early` takes (0 without): each warp's `early` slots of
    1 KB, the block's tiles' scales, then an mbarrier a slot."""
    if not t.early:
        return 0
    warps, groups = t.threads // 32, k // GROUP_SIZE
    tiles = warps // t.warps
    return warps * t.early * (1024 + 8) + tiles * TILE * groups * 2


def launch_smem(k: int, t: MmaTiling) -> int:
    """Dynamic shared memory a launch passes: the activations where they outgrow static
    shared memory (dynamic_smem), then the early groups (early_smem)."""
    return dynamic_smem(k) + early_smem(k, t)


def gemv_mma_name(kind: str, n_out: int, k: int, t: MmaTiling, eps: float | None = None,
                  heads=None) -> str:
    """The kernel's name (profiles, launcher errors): every constant build_kernel bakes in
    (gate_up, qkv: RMSNorm's eps too; qkv_rope: the heads)."""
    fields = dataclasses.asdict(t)
    for f in ("rope", "hilo", "early", "l2ahead"):
        if not fields[f]:
            del fields[f]                  # the names of the kernels before them stand
    extra = {} if eps is None else {"eps": eps}
    if heads is not None:
        extra.update(zip(("heads", "kv_heads"), heads[:2]))
    return kernel_name(f"gemv_mma_{kind}", n=n_out, k=k, **fields, **extra)


@functools.cache
def compile_gemv_mma(kind: str, n_out: int, k: int, t: MmaTiling, eps: float | None = None,
                     heads=None):
    """The compiled kernel (or the simulator's), once per process for each set of constants."""
    body, sig = build_kernel(kind, n_out, k, t, eps, heads)
    bounds = (t.threads, t.min_blocks) if t.min_blocks else (t.threads,)
    return compile_kernel(body, sig, gemv_mma_name(kind, n_out, k, t, eps, heads),
                          launch_bounds=bounds)


@functools.cache
def build_kernel(kind: str, n_out: int, k: int, t: MmaTiling, eps: float | None = None,
                 heads=None):
    """The kernel body and its signature: o_proj / down, x (N,) fp32 += W . a, a (K,) fp16;
    gate_up (eps: RMSNorm's), out (N,) fp16 = silu(Wg . h) * (Wu . h), h = rmsnorm(x, norm_w),
    the weights [gate; up] stacked (2N rows); qkv (eps), out (N,) fp32 = W . h + bias;
    qkv_rope (eps, heads = (num_heads, num_kv_heads, head_dim)): qkv, then gemv.py's RoPE
    epilogue (q_out, the K/V page slot).  qkv's weights in the rope-ordered layout (t.rope)."""
    check_tiling(kind, n_out, k, t)
    if (kind in NORM_KINDS) != (eps is not None):
        raise ValueError(f"gemv_mma: eps is RMSNorm's, for {NORM_KINDS} only (kind {kind!r}, "
                         f"eps {eps})")
    if (kind == "qkv_rope") != (heads is not None):
        raise ValueError(f"gemv_mma: heads=(num_heads, num_kv_heads, head_dim) is for qkv_rope "
                         f"only, which needs it (kind {kind!r}, heads {heads})")
    HQ = HKV = 1
    if heads is not None:
        HQ, HKV, hd = (int(h) for h in heads)
        if hd != t.rope or n_out != (HQ + 2 * HKV) * hd:
            raise ValueError(f"gemv_mma: qkv_rope N={n_out}, heads {heads}: N must be "
                             f"(num_heads + 2*num_kv_heads)*head_dim and head_dim the tiling's "
                             f"rope ({t.rope})")
    # The constants the body closes over (numba freezes them):
    #   TILE_WARPS   warps a tile's groups are split over (MmaTiling.warps)
    #   THREADS, WARPS, TILES      a block's threads, warps and 16-row tiles
    #   GROUPS, N_TILES            a row's groups, the matrix's tiles (gate_up: of gate)
    #   MATS         weight matrices a warp's tile reads: 2 for gate_up (gate, up), else 1
    #   PAIRS        two-group iterations of a warp's loop (the last may be short)
    #   CHUNKS, ACT_WORDS          k16 chunks of `a`, and its staged uint32 words
    #   PARTIALS     the warps' row partials in shared memory
    #   NORM_ITERS   gate_up, qkv: groups a warp stages (warp w: w, w + WARPS, ...)
    #   D, HALF, TPH qkv: head_dim (t.rope; 0 elsewhere), D / 2, a head's tiles (D / 16)
    #   PARTNER      the file row of a tile's row g + 8, from row g's: 8, or qkv's D / 2
    #   HILO         gate_up, qkv: h staged twice, hi = fp16(v) and lo = fp16(v - hi) at
    #                word LO_WORDS on; lanes of odd g read lo (B's odd columns), so a D row's
    #                even + odd columns are the fp32-accurate h's dot product (module doc).
    #                LO_WORDS is 8 words past ACT_WORDS (a multiple of 32; tiling.hilo_bytes
    #                counts both halves): a warp's B load
    #                then reads hi from banks 0-7 and lo from 8-15, one wavefront (unpadded,
    #                the same banks: 2-way conflicts); stage_group stores both
    #   ACT_ALLOC    the staged words: ACT_WORDS, twice that with HILO
    TILE_WARPS = t.warps
    THREADS = t.threads
    WARPS = THREADS // 32
    TILES = WARPS // TILE_WARPS
    GROUPS = k // GROUP_SIZE
    N_TILES = n_out // TILE
    MATS = 2 if kind == "gate_up" else 1
    PAIRS = -(-GROUPS // (2 * TILE_WARPS))
    CHUNKS = GROUPS * (GROUP_SIZE // CHUNK)
    ACT_WORDS = CHUNKS * 8
    PARTIALS = TILES * TILE_WARPS * TILE * MATS
    STAGE_ITERS = -(-CHUNKS // THREADS)
    NORM_ITERS = -(-GROUPS // WARPS)
    EPS = np.float32(eps or 0.0)
    INV_K = np.float32(1.0 / k)
    NORM = kind in NORM_KINDS
    ROPE = kind == "qkv_rope"
    D = t.rope
    HALF = max(D // 2, 1)
    TPH = max(D // TILE, 1)
    PARTNER = HALF if D else 8
    HILO = bool(t.hilo)
    LO_WORDS = ACT_WORDS + 8 if HILO else 0
    ACT_ALLOC = ACT_WORDS + LO_WORDS
    # early (t.early > 0, o_proj and down; "early" in the module doc), in the dynamic shared
    # array `dyn`:
    #   EARLY        a warp's slots, each its next group (1 KB: the file's bytes, the lane's
    #                32 at 32 * lane), filled once, before griddepcontrol.wait
    #   ITERS        the iterations of the warp with the most groups
    #   PAIRS_MAIN   mainloop's iterations: PAIRS, or those left after the early groups
    #   ACT_DYN      words of activations at the start of dyn (the 32B's down), else 0
    #   SLOTS_B, SC_W  the slots' byte offset in dyn, the scales' word offset after them
    #   SC_CHUNKS    16-byte copies of a tile's scale block (16 rows x GROUPS fp16, contiguous)
    #   BAR_B        the slots' mbarriers (8 bytes each, [warp][slot]) after the scales
    #   SLOT_TX      bytes a slot's copy delivers
    EARLY = t.early
    ITERS = -(-GROUPS // TILE_WARPS)
    PAIRS_MAIN = PAIRS if not EARLY else max(0, -(-(ITERS - EARLY) // 2))
    ACT_DYN = ACT_WORDS if dynamic_smem(k) else 0
    SLOTS_B = ACT_DYN * 4
    SC_W = ACT_DYN + WARPS * EARLY * MATS * 256
    SC_CHUNKS = TILE * GROUPS * 2 // 16
    SC_ITERS = -(-SC_CHUNKS // (32 * TILE_WARPS))
    BAR_B = SC_W * 4 + TILES * MATS * TILE * GROUPS * 2
    SLOT_TX = MATS * 1024
    # l2ahead (t.l2ahead > 0): when a warp issues the loads of its group grp, lane 0 (and lane
    # 1, gate_up's up tile) asks L2 for the same tile's group grp + L2AHEAD * TILE_WARPS -- 1 KB
    # a tile, contiguous -- so the loads find it in L2 (a round trip of ~0.6 us instead of
    # DRAM's ~1.2 under load) while no register holds it; the prologue asks for the first
    # L2AHEAD groups after `first` before griddepcontrol.wait
    L2AHEAD = t.l2ahead

    def load_words(qw, base):
        # the lane's 8 words of one group: two 16-byte loads (32 contiguous bytes)
        w0, w1, w2, w3 = ld_global_nc_v4_u32(qw, base)
        w4, w5, w6, w7 = ld_global_nc_v4_u32(qw, base + 4)
        return w0, w1, w2, w3, w4, w5, w6, w7

    def load_scales(sc, sbase, grp):
        # the scale bits of the lane's rows g (scales from sbase) and g + 8 (8 rows further)
        return (uint32(ld_global_nc_u16(sc, sbase + grp)),
                uint32(ld_global_nc_u16(sc, sbase + PARTNER * GROUPS + grp)))

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
        if HILO:   # columns 2t (hi) + 2t+1 (lo) of rows g and g+8
            return ((da[0] + da[1]) * cvt_f32_f16(ca[8]), (da[2] + da[3]) * cvt_f32_f16(ca[9]),
                    (db[0] + db[1]) * cvt_f32_f16(cb[8]), (db[2] + db[3]) * cvt_f32_f16(cb[9]))
        return (da[0] * cvt_f32_f16(ca[8]), da[2] * cvt_f32_f16(ca[9]),
                db[0] * cvt_f32_f16(cb[8]), db[2] * cvt_f32_f16(cb[9]))

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

    def stage_norm(x, norm_w, act, invf, ssum):
        """gate_up: stage x * norm_w in stage's order, each group times f_g (module doc;
        invf[g] = 1/f_g), and return rstd.  Warp w stages groups w, w + WARPS, ...; lane l
        holds a group's values 4l..4l+3: pairs 2(l%4) and 2(l%4)+1 of chunk l//4, which land
        at words 2j (j < 4) or 2(j-4)+1 of the chunk.  gemv.py's piece_put, value for value."""
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        ss = float32(0.0)
        if HILO:   # the groups written out, up to 8 (stage_group says why)
            ss += stage_group(x, norm_w, act, invf, warp, lane)
            if NORM_ITERS > 1:
                ss += stage_group(x, norm_w, act, invf, WARPS + warp, lane)
            if NORM_ITERS > 2:
                ss += stage_group(x, norm_w, act, invf, 2 * WARPS + warp, lane)
            if NORM_ITERS > 3:
                ss += stage_group(x, norm_w, act, invf, 3 * WARPS + warp, lane)
            if NORM_ITERS > 4:
                ss += stage_group(x, norm_w, act, invf, 4 * WARPS + warp, lane)
            if NORM_ITERS > 5:
                ss += stage_group(x, norm_w, act, invf, 5 * WARPS + warp, lane)
            if NORM_ITERS > 6:
                ss += stage_group(x, norm_w, act, invf, 6 * WARPS + warp, lane)
            if NORM_ITERS > 7:
                ss += stage_group(x, norm_w, act, invf, 7 * WARPS + warp, lane)
            for it in range(8, NORM_ITERS):
                ss += stage_group(x, norm_w, act, invf, it * WARPS + warp, lane)
        else:
            for it in range(NORM_ITERS):
                grp = it * WARPS + warp
                base = min(grp, GROUPS - 1) * GROUP_SIZE + lane * 4   # a spare load beats a branch
                x0, x1, x2, x3 = ld_global_nc_v4_f32(x, base)
                w01, w23 = ld_global_nc_v2_u32(norm_w, base)
                n0, n1 = unpack_f16x2_to_f32(w01)
                n2, n3 = unpack_f16x2_to_f32(w23)
                p0, p1, p2, p3 = x0 * n0, x1 * n1, x2 * n2, x3 * n3
                m = wmax(max(max(abs(p0), abs(p1)), max(abs(p2), abs(p3))))
                f, fi = pow2_scale(m)
                if grp < GROUPS:
                    ss += x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3
                    j = (lane & 3) * 2          # the lane's first pair in its chunk (0, 2, 4, 6)
                    w = (grp * (GROUP_SIZE // CHUNK) + (lane >> 2)) * 8
                    w += 2 * j if j < 4 else 2 * j - 7
                    act[w] = pack_f16x2_from_f32(p0 * f, p1 * f)
                    act[w + 2] = pack_f16x2_from_f32(p2 * f, p3 * f)   # pair j + 1: two words on
                    if lane == 0:
                        invf[grp] = fi
        ss = wsum(ss)
        if lane == 0:
            ssum[warp] = ss
        cuda.syncthreads()
        return rstd_of(ssum, WARPS, INV_K, EPS)

    def stage_group(x, norm_w, act, invf, grp, lane):
        """stage_norm's group grp with hilo: hi = fp16(v) and lo = fp16(v - hi) (exact in
        fp32 before its rounding) of each v = x * norm_w * f_g; returns the lane's sum of
        squares of x (0 past the last group).  Called once a group, written out: as a loop
        body the lo made it too long for NVVM to unroll, and the groups' loads then waited on
        each other after griddepcontrol.wait (+0.035 ms a step for gate_up, H200)."""
        base = min(grp, GROUPS - 1) * GROUP_SIZE + lane * 4
        x0, x1, x2, x3 = ld_global_nc_v4_f32(x, base)
        w01, w23 = ld_global_nc_v2_u32(norm_w, base)
        n0, n1 = unpack_f16x2_to_f32(w01)
        n2, n3 = unpack_f16x2_to_f32(w23)
        p0, p1, p2, p3 = x0 * n0, x1 * n1, x2 * n2, x3 * n3
        m = wmax(max(max(abs(p0), abs(p1)), max(abs(p2), abs(p3))))
        f, fi = pow2_scale(m)
        ss = float32(0.0)
        if grp < GROUPS:
            ss = x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3
            j = (lane & 3) * 2
            w = (grp * (GROUP_SIZE // CHUNK) + (lane >> 2)) * 8
            w += 2 * j if j < 4 else 2 * j - 7
            v0, v1, v2, v3 = p0 * f, p1 * f, p2 * f, p3 * f
            hi01 = pack_f16x2_from_f32(v0, v1)
            hi23 = pack_f16x2_from_f32(v2, v3)
            act[w] = hi01
            act[w + 2] = hi23
            h0, h1 = unpack_f16x2_to_f32(hi01)
            h2, h3 = unpack_f16x2_to_f32(hi23)
            act[LO_WORDS + w] = pack_f16x2_from_f32(v0 - h0, v1 - h1)
            act[LO_WORDS + w + 2] = pack_f16x2_from_f32(v2 - h2, v3 - h3)
            if lane == 0:
                invf[grp] = fi
        return ss

    def add_group(acc, ca, cb, abase, grp, t4, invf):
        # acc + group grp's sums (none past the last group; gate_up's and qkv's undo f_g)
        a0, a1, a2, a3 = acc
        if grp < GROUPS:
            v0, v1, v2, v3 = group_dot(ca, cb, abase, grp, t4)
            if NORM:
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

    def file_row(tile, g):
        # the file row of a tile's row g (qkv: rope-ordered, layout.rope_row; its row g + 8 is
        # PARTNER rows further)
        r = tile * TILE + g
        if D:
            r = tile // TPH * D + tile % TPH * 8 + g
        return r

    def tile_bases(tile, lane, g):
        # where the lane's words of a tile start (256 a group) and its row g's scales; then
        # the same of its up tile (gate_up: the same rows, N_TILES tiles on; else repeated)
        # (file_row, written out: one more device function changes o_proj's and down's PTX)
        wa = (tile * GROUPS * 32 + lane) * 8
        r = tile * TILE + g
        if D:
            r = tile // TPH * D + tile % TPH * 8 + g
        sa = r * GROUPS
        wb, sb = wa, sa
        if MATS == 2:
            up = tile + N_TILES
            wb, sb = (up * GROUPS * 32 + lane) * 8, (up * TILE + g) * GROUPS
        return wa, sa, wb, sb

    def out_row():
        # the epilogue's thread: (tile in the block, row in the tile, row of the output); only
        # threads below TILES * TILE have one (row -1 otherwise, or past the matrix)
        tid = cuda.threadIdx.x
        tl2 = tid // TILE
        r = tid % TILE
        row = (cuda.blockIdx.x * TILES + tl2) * TILE + r
        return tl2, r, row if tid < TILES * TILE and row < n_out else -1

    def pair_row(tid):
        # qkv's epilogue thread (one a RoPE pair, tid < TILES * 8): (tile in the block, row g
        # of the tile, the file row of g: its pair is PARTNER rows further; -1 past the matrix)
        tl2 = tid >> 3
        g = tid & 7
        tile = cuda.blockIdx.x * TILES + tl2
        r0 = file_row(tile, g)
        return tl2, g, r0 if tid < TILES * 8 and tile < N_TILES else -1

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

    def block_sums(a, qw, sc, x, act, red, dyn):
        """o_proj / down up to the warps' partials in `red`: (row, tl2, r, xr) for
        row_sum(red, tl2, r, 0), the thread's output row (-1 for threads without one) and
        x[row] as it was, read right after the wait so that the epilogue's x += waits on no L2.
        With EARLY, the warp's first EARLY groups come from their slots in `dyn` (copied
        before the wait), mainloop's from group kw + EARLY * TILE_WARPS on; else dyn is a
        stand-in never read."""
        lane, g, t4, tl, kw, tile = roles()
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
        stage(a, act)
        if EARLY:
            cp_async_wait_group(0)      # this thread's scale copies; the barrier: everyone's
        cuda.syncthreads()
        # widened here, once: the chunk offsets added to it are 64-bit sums anyway (kept as a
        # 32-bit value the PTX comes out in another order)
        abase = uint64(cvta_to_shared_u32(act))
        # (red stands in for invf, which only gate_up reads)
        if EARLY:
            a0, a1, a2, a3 = early_loop(dyn, abase, t4, red)
            b0, b1, b2, b3 = mainloop(qw, sc, abase, bases, kr, t4, first, red)
            acc = (a0 + b0, a1 + b1, a2 + b2, a3 + b3)
        else:
            acc = mainloop(qw, sc, abase, bases, kr, t4, first, red)
        put_partials(red, tl, kw, g, t4, acc)
        cuda.syncthreads()
        return row, tl2, r, xr

    def qkv_sums(x, norm_w, qw, sc, bias, act, red, invf, ssum, state, inv_freq, table):
        """qkv up to the warps' partials in `red`: (rstd, pre), pre put_rope's (biases, cos,
        sin, position, page; qkv: the biases).  The biases before the wait (weights); the
        position and frequency right after it, the page after the prologue, cos and sin in
        the epilogue -- not gemv.py's rope_setup before the wait: held across this kernel's
        loop they took it from 66 to 76 registers (ptxas, sm_90), one 448-thread block an SM
        instead of two, and the step +0.035 ms (H200, 2026-12-02)."""
        lane, g, t4, tl, kw, tile = roles()
        bases = tile_bases(tile, lane, g)
        first = load_both(qw, sc, bases, min(kw, GROUPS - 1))
        if L2AHEAD:
            ahead_prologue(qw, bases, kw)
        norm_to_l2(norm_w)
        _, _, r0 = pair_row(cuda.threadIdx.x)
        row0 = 2 * (r0 // D * HALF + r0 % D)   # the pair's row0 (weight_row's convention)
        b0 = float32(0.0)
        b1 = float32(0.0)
        if r0 >= 0:
            b0, b1 = bias_pair(bias, row0)
        griddepcontrol_wait()
        griddepcontrol_launch_dependents()
        pos = 0
        fr = float32(0.0)
        if ROPE:
            pos = state[STATE_POS]
            fr = inv_freq[pair_i(cuda.threadIdx.x)]
        rstd = stage_norm(x, norm_w, act, invf, ssum)   # ends with a __syncthreads
        page = 0
        if ROPE:
            page = table[pos // PAGE]
        abase = uint64(cvta_to_shared_u32(act))
        if HILO:   # lanes of odd g hold B's odd columns: lo
            abase += uint64((g & 1) * LO_WORDS * 4)
        acc = mainloop(qw, sc, abase, bases, kw, t4, first, invf)
        put_partials(red, tl, kw, g, t4, acc)
        cuda.syncthreads()
        cos_a = float32(1.0)
        sin_a = float32(0.0)
        if ROPE:
            cos_a, sin_a = cos_sin(pos, fr)
        return rstd, (b0, b1, cos_a, sin_a, pos, page)

    def norm_to_l2(norm_w):
        # gemv.py's: the norm's weights into L2 before the wait, so that the staging after it
        # waits on L2, not DRAM
        if cuda.threadIdx.x == 0:
            cp_async_bulk_prefetch_l2(norm_w, 0, 2 * k)

    def pair_i(tid):
        # the pair's index i in its head (rows i, i + D/2; < D/2 for every thread)
        return (cuda.blockIdx.x * TILES + (tid >> 3)) % TPH * 8 + (tid & 7)

    def weight_row(row0, m):
        # rope_epilogue's view of a pair (gemv.py's qkv_rope): row0 = 2p for pair p, rows i and
        # i + D/2 of head p // (D/2), i = p % (D/2)
        p = row0 >> 1
        return (p // HALF) * D + p % HALF + m * HALF

    def put_qkv(out, b, row, v):
        out[row] = v + b

    def gate_up_sums(x, norm_w, qw, sc, act, red, invf, ssum):
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
        rstd = stage_norm(x, norm_w, act, invf, ssum)   # ends with a __syncthreads
        abase = uint64(cvta_to_shared_u32(act))
        if HILO:   # lanes of odd g hold B's odd columns: lo
            abase += uint64((g & 1) * LO_WORDS * 4)
        acc = mainloop(qw, sc, abase, bases, kw, t4, first, invf)
        put_partials(red, tl, kw, g, t4, acc)
        cuda.syncthreads()
        tl2, r, row = out_row()
        return row, tl2, r, rstd

    dequant, pow2_scale = dev(dequant_word), dev(pow2_scale_f32)
    wsum, wmax, rstd_of = dev(warp_sum), dev(warp_max), dev(block_rstd)
    load_words, load_scales, load_group, load_both, dequant_mma, chunk, group_dot, stage, \
        stage_norm, stage_group, add_group, mainloop, roles, file_row, tile_bases, out_row, \
        pair_row, put_partials, row_sum, block_sums, qkv_sums, norm_to_l2, pair_i, weight_row, \
        put_qkv, gate_up_sums, to_l2, ahead_prologue = (
            dev(f) for f in (load_words, load_scales, load_group, load_both, dequant_mma, chunk,
                             group_dot, stage, stage_norm, stage_group, add_group, mainloop, roles,
                             file_row, tile_bases, out_row, pair_row, put_partials, row_sum,
                             block_sums, qkv_sums, norm_to_l2, pair_i, weight_row, put_qkv,
                             gate_up_sums, to_l2, ahead_prologue))
    put_rope, _, cos_sin, bias_pair = put_rope_body(n_out, HQ, HKV, max(D, 2), weight_row)
    put_rope = dev(put_rope)
    early_issue, early_prologue, early_scale, early_read, early_loop = (
        dev(f) for f in (early_issue, early_prologue, early_scale, early_read, early_loop))

    if kind in ROPE_KINDS:
        def qkv_body(x, norm_w, qw, sc, bias, state, inv_freq, table, kv, q_out, act, red,
                     invf, ssum):
            # a thread a RoPE pair: rows g, g + 8 of a tile = file rows r0, r0 + D/2.
            # qkv: q_out is its output (N,), state, inv_freq, table and kv stand-ins never read
            rstd, pre = qkv_sums(x, norm_w, qw, sc, bias, act, red, invf, ssum, state,
                                 inv_freq, table)
            tl2, g, r0 = pair_row(cuda.threadIdx.x)
            if r0 >= 0:
                v0 = row_sum(red, tl2, g, 0) * rstd
                v1 = row_sum(red, tl2, g + 8, 0) * rstd
                if ROPE:   # row0 = 2p, p the pair's index (weight_row's convention)
                    put_rope(kv, q_out, 2 * (r0 // D * HALF + r0 % D), v0, v1, pre)
                else:
                    put_qkv(q_out, pre[0], r0, v0)
                    put_qkv(q_out, pre[1], r0 + HALF, v1)

        qkv_body = dev(qkv_body)
        if ROPE:
            def kernel(x, norm_w, qw, sc, bias, state, inv_freq, table, kv, q_out):
                act = cuda.shared.array(ACT_ALLOC, uint32, alignment=None if SIMULATOR else 16)
                red = cuda.shared.array(PARTIALS, float32)
                invf = cuda.shared.array(GROUPS, float32)
                ssum = cuda.shared.array(WARPS, float32)
                qkv_body(x, norm_w, qw, sc, bias, state, inv_freq, table, kv, q_out, act, red,
                         invf, ssum)
            return kernel, ("void(float32[::1], float16[::1], uint32[::1], float16[::1], "
                            "float16[::1], int32[::1], float32[::1], int32[::1], "
                            "float16[:, :, :, :, ::1], float32[::1])")

        def kernel(x, norm_w, qw, sc, bias, out):
            act = cuda.shared.array(ACT_ALLOC, uint32, alignment=None if SIMULATOR else 16)
            red = cuda.shared.array(PARTIALS, float32)
            invf = cuda.shared.array(GROUPS, float32)
            ssum = cuda.shared.array(WARPS, float32)
            qkv_body(x, norm_w, qw, sc, bias, out, out, out, out, out, act, red, invf, ssum)
        return kernel, ("void(float32[::1], float16[::1], uint32[::1], float16[::1], "
                        "float16[::1], float32[::1])")

    if kind == "gate_up":
        def kernel(x, norm_w, qw, sc, out):
            act = cuda.shared.array(ACT_ALLOC, uint32, alignment=None if SIMULATOR else 16)
            red = cuda.shared.array(PARTIALS, float32)
            invf = cuda.shared.array(GROUPS, float32)
            ssum = cuda.shared.array(WARPS, float32)
            row, tl2, r, rstd = gate_up_sums(x, norm_w, qw, sc, act, red, invf, ssum)
            if row >= 0:
                gt = row_sum(red, tl2, r, 0) * rstd
                up = row_sum(red, tl2, r, 1) * rstd
                y = gt / (float32(1.0) + math.exp(-gt)) * up     # gemv.py's put_swiglu
                st_global_u16(out, row, cvt_rn_f16_f32(y))
        return kernel, "void(float32[::1], float16[::1], uint32[::1], float16[::1], float16[::1])"
    if EARLY and not dynamic_smem(k):
        def kernel(a, qw, sc, x):
            act = cuda.shared.array(ACT_WORDS, uint32, alignment=None if SIMULATOR else 16)
            red = cuda.shared.array(PARTIALS, float32)
            dyn = cuda.shared.array(0, uint32)   # launch_smem bytes: slots, scales, barriers
            row, tl2, r, xr = block_sums(a, qw, sc, x, act, red, dyn)
            if row >= 0:
                x[row] = xr + row_sum(red, tl2, r, 0)
    elif EARLY:
        def kernel(a, qw, sc, x):  # the activations at the start of the dynamic array
            dyn = cuda.shared.array(0, uint32)
            red = cuda.shared.array(PARTIALS, float32)
            row, tl2, r, xr = block_sums(a, qw, sc, x, dyn, red, dyn)
            if row >= 0:
                x[row] = xr + row_sum(red, tl2, r, 0)
    elif not dynamic_smem(k):
        def kernel(a, qw, sc, x):
            act = cuda.shared.array(ACT_WORDS, uint32, alignment=None if SIMULATOR else 16)
            red = cuda.shared.array(PARTIALS, float32)
            row, tl2, r, xr = block_sums(a, qw, sc, x, act, red, red)   # (red: dyn's stand-in)
            if row >= 0:
                x[row] = xr + row_sum(red, tl2, r, 0)
    else:
        def kernel(a, qw, sc, x):  # the same body, the activations in dynamic shared memory
            act = cuda.shared.array(0, uint32)  # ACT_WORDS at launch; 16-byte aligned base
            red = cuda.shared.array(PARTIALS, float32)
            row, tl2, r, xr = block_sums(a, qw, sc, x, act, red, red)   # (red: dyn's stand-in)
            if row >= 0:
                x[row] = xr + row_sum(red, tl2, r, 0)

    return kernel, "void(float16[::1], uint32[::1], float16[::1], float32[::1])"
