"""The checks of a tensor-core GEMV's tiling (`check_tiling`, with the shared memory a launch
needs) and the constants its kernel closes over (numba freezes them as constants), computed
once from its kind, shape and tiling: gemv_mma.build_kernel assembles the kernels from
gemv_mma_weights.py (a warp's weights: where its tile lives, its loads, the dequant-mma, the
loop, `early` and `l2ahead`) and gemv_mma_stage.py (the block's activations staged in shared
memory), and each reads the numbers from one MmaShape."""
from __future__ import annotations

import dataclasses

import numpy as np

from nq.config import GROUP_SIZE
from nq.kernels.common import SMEM_OPTIN_LIMIT, STATIC_SMEM_LIMIT
from nq.kernels.int4.layout import CHUNK
from nq.kernels.int4.tiling import MMA_KINDS, TILE, MmaTiling, staged_bytes



def dynamic_smem(k: int, t: MmaTiling | None = None) -> int:
    """Bytes of dynamic shared memory a launch needs: 0 while the staged activations (2K
    bytes, 3K with i8) fit the 48 KB of static shared memory (every shape up to the 14B), else
    all of them (the 32B's down, K = 27,648: 55 KB; the 7B's down with i8, 57 KB), with the
    kernel opted in (`allow_smem`)."""
    b = staged_bytes(k, t)
    return 0 if b <= STATIC_SMEM_LIMIT else b


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
    if staged_bytes(k, t) + partials > SMEM_OPTIN_LIMIT:
        raise ValueError(f"gemv_mma: K={k} needs {staged_bytes(k, t)} bytes of staged "
                         f"activations, over the {SMEM_OPTIN_LIMIT}-byte shared memory of a "
                         f"block")
    if kind == "gate_up" and dynamic_smem(k):
        raise ValueError(f"gemv_mma: {kind}'s K={k} (the hidden size) needs {k * 2} bytes of "
                         f"staged activations, over the {STATIC_SMEM_LIMIT} bytes of static "
                         f"shared memory it stages in; use the CUDA-core {kind} (a Tiling)")
    if t.early and (kind not in ("o_proj", "down") or not 1 <= t.early <= MAX_EARLY):
        raise ValueError(f"gemv_mma: tiling {t.tag()}: early (a warp's first groups copied to "
                         f"shared memory before the wait) is 1..{MAX_EARLY}, for o_proj and "
                         f"down; 0 copies none")
    if t.early and early_smem(k, t) + staged_bytes(k, t) * (not dynamic_smem(k, t)) \
            + partials > SMEM_OPTIN_LIMIT:
        raise ValueError(f"gemv_mma: tiling {t.tag()} needs {early_smem(k, t)} bytes of "
                         f"early groups and scales beside {staged_bytes(k, t)} of activations, "
                         f"over the {SMEM_OPTIN_LIMIT}-byte shared memory of a block: a smaller "
                         f"early or fewer threads")
    if t.xacc and kind not in ("gate_up", "down"):
        raise ValueError(f"gemv_mma: tiling {t.tag()}: xacc (attn_o_proj's int64 sums beside x) "
                         f"is read by gate_up and folded by down; {kind} takes x alone")
    if t.i8 not in (0, 1):
        raise ValueError(f"gemv_mma: tiling {t.tag()}: i8={t.i8}: 0 (fp16 activations) or 1 "
                         f"(digits; the words form, 2, lost and is retired: docs/PERF.md 0.29)")
    if t.i8 and kind == "gate_up" and dynamic_smem(k, t):
        raise ValueError(f"gemv_mma: tiling {t.tag()}: K={k} staged as three bytes a value "
                         f"needs {staged_bytes(k, t)} bytes, over the {STATIC_SMEM_LIMIT} bytes "
                         f"of static shared memory; use i8=0")
    if not 0 <= t.l2ahead <= MAX_L2AHEAD:
        raise ValueError(f"gemv_mma: tiling {t.tag()}: l2ahead (groups a warp asks L2 for ahead "
                         f"of its loads) is 0..{MAX_L2AHEAD}")


MAX_EARLY = 6     # early slots a warp (shared memory: 32 warps x 6 KB is most of a block's)
MAX_L2AHEAD = 8   # a warp's groups in flight to L2 (past that, L2 holds them for too long)


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
    return dynamic_smem(k, t) + early_smem(k, t)


@dataclasses.dataclass(frozen=True)
class MmaShape:
    """The kernel's constants (`shape_of` has what each one means)."""
    TILE_WARPS: int
    THREADS: int
    WARPS: int
    TILES: int
    GROUPS: int
    N_TILES: int
    MATS: int
    PAIRS: int
    CHUNKS: int
    ACT_WORDS: int
    PARTIALS: int
    STAGE_ITERS: int
    NORM_ITERS: int
    EPS: np.float32
    INV_K: np.float32
    NORM: bool
    ACT_ALLOC: int
    EARLY: int
    ITERS: int
    PAIRS_MAIN: int
    ACT_DYN: int
    SLOTS_B: int
    SC_W: int
    SC_CHUNKS: int
    SC_ITERS: int
    BAR_B: int
    SLOT_TX: int
    L2AHEAD: int
    XACC: bool
    I8: bool


def shape_of(kind: str, n_out: int, k: int, t: MmaTiling, eps: float | None) -> MmaShape:
    """The constants of the kernel for (kind, n_out, k, t, eps)."""
    # The constants the body closes over (numba freezes them):
    #   TILE_WARPS   warps a tile's groups are split over (MmaTiling.warps)
    #   THREADS, WARPS, TILES      a block's threads, warps and 16-row tiles
    #   GROUPS, N_TILES            a row's groups, the matrix's tiles (gate_up: of gate)
    #   MATS         weight matrices a warp's tile reads: 2 for gate_up (gate, up), else 1
    #   PAIRS        two-group iterations of a warp's loop (the last may be short)
    #   CHUNKS, ACT_WORDS          k16 chunks of `a`, and its staged uint32 words
    #   PARTIALS     the warps' row partials in shared memory
    #   NORM_ITERS   gate_up: groups a warp stages (warp w: w, w + WARPS, ...)
    #   NORM         gate_up: RMSNorm in the prologue (stage_norm), each group's sums times 1/f_g
    #   ACT_ALLOC    the staged words: ACT_WORDS (GROUPS * 96 with I8)
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
    NORM = kind == "gate_up"
    ACT_ALLOC = ACT_WORDS
    # i8 (t.i8): each staged value v (gate_up: x * norm_w * f_g; o_proj, down: a * f_g,
    # f_g a power of two putting the group's absmax in [128, 256)) becomes the integer
    # x = rni(v * 2^14), |x| <= 2^22, written as three signed bytes (hi, mid, lo;
    # x = 65536 hi + 256 mid + lo) in three planes of shared memory; a lane's B fragment reads
    # plane min(g, 2), so D's columns 0, 1, 2 are the weights' dot products with hi, mid and
    # lo, exact in int32, and lanes t = 0 (columns 0, 1) and t = 1 (column 2) hold them.
    # A group is 3 planes x 4 lanes t x 8 words (4 k32 steps x b0, b1): 384 bytes
    # i8=2, the digits stored as whole words (3 shared stores a lane, not 12 byte stores), lost
    # (docs/PERF.md 0.29: down +0.045 ms a step against fp16, gate_up +0.007 against i8=1);
    # code at 2c215a2
    I8 = bool(t.i8)
    if I8:
        ACT_ALLOC = GROUPS * 96
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
    ACT_DYN = ACT_ALLOC if dynamic_smem(k, t) else 0
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
    # xacc (t.xacc, gate_up and down): x's true value is x + xacc * 2^-32, xacc (N,) int64 (as
    # 2N uint32 words) holding attn_o_proj's heads' shares in fixed point; gate_up stages the
    # sum, down adds it to x with its own sums and zeroes xacc
    XACC = bool(t.xacc)

    here = locals()
    return MmaShape(**{f.name: here[f.name] for f in dataclasses.fields(MmaShape)})
