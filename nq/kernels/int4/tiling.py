"""How the INT4 GEMVs split their work, and which split each shape gets.

Two kernels, two small frozen dataclasses, so that no field means two things:

    Tiling      the CUDA-core GEMV (gemv.py): `ks` lanes share a weight row's groups
    MmaTiling   the tensor-core GEMV (gemv_mma.py): `warps` warps share a 16-row tile's groups

`default_tiling(kind, n_out, k)` picks one for a projection: the measured winners for the 7B
(the tables below, each entry with its figure and what lost beside it, so that the next reader
need not re-run the experiment), `mma_tiling`'s rule for o_proj and down at other sizes, and
a rule for the rest.  A tiling fixes the prepared weights' layout (`layout()`): tilings with
equal layouts read the same uploaded weights.

gate_up's default is the tensor-core tiling too (`MMA_GATE_UP`, read once at import;
NQ_MMA_GATE_UP=0 in the environment turns it off), so the upload writes gate_up in the mma
fragment layout, decode runs it on gemv_mma and the prefill GEMMs read that layout, which they
read ~25 % faster: on the H200 (2026-12-01) a 512-token prompt went 22.0 -> 18.9 ms and an 8K
one 354 -> 314 ms, for +0.036 ms a decode step (1.877 -> 1.914 at 512; `mma_tiling` has the
figures), and gate_up's decode sums became fp32.

i8 (`MmaTiling.i8`, gemv_mma.py "i8"): gate_up's and attn_o_proj's activations are staged as
signed-byte digits on the int8 tensor cores, 22 bits of each group's absmax at fewer
instructions a weight word than the fp16 staging; the weights' layout does not change.
Measured in the 7B step (H100, 2026-12-07, scripts/step_variants.py, ms a step at 512 / 8K /
32K): gate_up -0.025 / -0.019 / -0.014, attn_o_proj -0.012 / -0.005 / -0.008, the two
-0.027 / -0.028 / -0.023; down +0.031 / +0.035 / +0.034 lost and stays fp16: its block stages
all of K for two tiles (storing the digits as whole words, i8=2, lost too: docs/PERF.md 0.29).

The CUDA-core qkv and qkv_rope stage digits too (`Tiling.i8`, gemv_digits.py: dp4a sums them
exactly), which makes the default step fp32-accurate: the decode tier at the 7B width 3.56e-4 /
4.78e-4 of the spread (median / max; target 5e-4) against 8.8e-4 / 1.1e-3 with fp16, for
+0.000 ms a step in the 7B (H100, 2026-12-07: `qkv_rope.i8=0` -0.000 / +0.001 / +0.000 at 512 /
8K / 32K) and -0.038 / -0.028 at the 14B's width (docs/PERF.md 0.30).  `NQ_I8` (`I8`, read once
at import) picks: "1" (the default) gate_up, attn_o_proj and the CUDA-core qkv, "0" none.

Retired: NQ_I8=all (every tensor-core tiling with i8 too: down's and o_proj's, the experiment
of docs/PERF.md 0.27).  down with i8 lost in the step on both machines: +0.031..+0.041 ms on
the H100 three times (0.27-0.29), +0.027 / +0.034 at 512 / 8K on the H200 (0.37), because
down's block stages all of K in digits for the two tiles it serves.  `MmaTiling.i8` stays, for
gate_up, and `step_variants.py "down.i8=1"` can still ask for it.

Retired: NQ_MMA_QKV=1 (`--fp32-accurate`), the "fp32-accurate step" of 2026-12-02: qkv and
qkv_rope on the tensor cores (their mma layout's rows in RoPE-pair order, which the prefill
GEMMs un-permuted) and qkv's and gate_up's h staged as fp16 hi + lo (`MmaTiling.hilo`).  With
the digits above the default is as accurate and faster: 1.893 / 2.028 / 2.492 ms a 7B step at
512 / 8K / 32K against its 1.968 / 2.129 / 2.561 (H100 SXM, 2026-12-07; on the H200, 2026-12-02,
qkv on the tensor cores alone cost +0.043..+0.053 ms at 512); its one gain was ~0.1 ms of a
19 ms 512-token prefill.  Retired after 29184bc, which holds the code; the variable now only
warns.
"""
from __future__ import annotations

import dataclasses
import os
import warnings

from nq.config import GROUP_SIZE
from nq.kernels.common import SMEM_OPTIN_LIMIT, STATIC_SMEM_LIMIT

KINDS = ("qkv", "o_proj", "gate_up", "down", "qkv_rope", "lm_head", "lm_head_bound")
MMA_KINDS = ("o_proj", "down", "gate_up")   # kinds the tensor-core kernel takes
MMA_GATE_UP = os.environ.get("NQ_MMA_GATE_UP", "1") != "0"   # gate_up on it (module doc)
if os.environ.get("NQ_MMA_QKV", "0") == "1":   # retired (module doc); old scripts still run
    warnings.warn("NQ_MMA_QKV=1 is retired and ignored: the default decode step is already "
                  "fp32-accurate (qkv's activations as digits summed exactly by dp4a, "
                  "docs/PERF.md 0.30); the tensor-core qkv is at commit 29184bc")
I8 = os.environ.get("NQ_I8", "1")                             # where i8 is default (module doc)
if I8 not in ("0", "1"):
    raise ValueError(f"NQ_I8={I8!r}: use 1 (gate_up, attn_o_proj and qkv, the default) or 0 "
                     f"(no i8); `all` (down and o_proj too) lost on both machines and is retired "
                     f"(docs/PERF.md 0.37)")
I8_KINDS = {"0": (), "1": ("gate_up",)}[I8]                   # default_tiling's i8 kinds
O_I8 = I8 != "0"                                               # attn_o_proj's default
CORE_I8_KINDS = ("qkv", "qkv_rope") if I8 != "0" else ()       # CUDA-core tilings with i8
NORM_KINDS = ("gate_up", "qkv", "qkv_rope", "lm_head",   # RMSNorm in the prologue (they
              "lm_head_bound")                          # stage rmsnorm(x))
TILE = 16                        # rows of an mma tile (m16)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """The CUDA-core GEMV's split: a thread owns `rows` output rows and, of each, the groups
    j, j + ks, j + 2ks, ... (lane j of a segment of pow2(ks) lanes); one such set of ks
    groups is a "step".  Retired fields (l2_steps, ahead, block_major, stream, bulk,
    prefetch=2) lost on the H200, resident on the H100; gemv.py's epitaphs give their
    figures."""
    ks: int              # lanes a row's groups are spread over (1..32)
    rows: int = 1        # output rows per thread (gate_up: gate/up pairs; qkv_rope: 2, a RoPE pair)
    threads: int = 128   # threads per block
    prefetch: int = 1    # 1: step s+1's loads are issued before step s's math; 0: after
    span: int = 32       # weights per fp16 partial sum: 32 (a chunk) or 128 (a group)
    min_blocks: int = 0  # launch_bounds' min blocks per SM (caps registers); 0: not given
    early: int = 0       # 1: step 1's loads go out before griddepcontrol.wait beside step 0's
    #                      (needs prefetch and two steps or more); 0: at the main loop's start
    i8: int = 0          # 1: the activations staged as three signed-byte digits and summed
    #                      exactly by dp4a (gemv_digits.py: fp32-accurate); 0: fp16 partials

    @property
    def lanes(self) -> int:
        """Lanes of a row's segment: ks rounded up to a power of two (the shuffle tree's)."""
        return 1 << (self.ks - 1).bit_length()

    def rows_per_block(self) -> int:
        return (self.threads // self.lanes) * self.rows

    def layout(self) -> tuple:
        """What fixes the prepared weights (layout.tile_rows): ks."""
        return ("rows", self.ks)

    def tag(self) -> str:
        return (f"ks{self.ks}_r{self.rows}_t{self.threads}" + ("_pf" if self.prefetch else "")
                + ("_s128" if self.span == 128 else "")
                + (f"_mb{self.min_blocks}" if self.min_blocks else "")
                + ("_e1" if self.early else "") + ("_i8" if self.i8 else ""))


@dataclasses.dataclass(frozen=True)
class MmaTiling:
    """The tensor-core GEMV's split: a block holds threads / 32 / warps row tiles of 16 rows;
    the `warps` warps of a tile split its groups (warp w: groups w, w + warps, ...).
    Retired: split-K, prefetch=2, preload=2, ring, and gate_up's sets=3 and apart
    (gemv_mma.py's epitaphs); rope and hilo, qkv's RoPE-ordered rows and the hi + lo staging
    (the module doc's NQ_MMA_QKV)."""
    warps: int           # warps a 16-row tile's groups are split over
    threads: int         # threads per block: a multiple of 32 * warps, at most 1024
    min_blocks: int = 0  # launch_bounds' min blocks per SM (caps registers); 0: not given
    early: int = 0       # o_proj / down: a warp's first `early` groups (and its tile's scales)
    #                      copied into shared memory before griddepcontrol.wait (gemv_mma.py)
    l2ahead: int = 0     # a warp asks L2 for its group l2ahead groups ahead of the one it
    #                      loads (cp.async.bulk.prefetch.L2, 1 KB a tile; gemv_mma.py)
    xacc: int = 0        # gate_up / down: x is x + xacc * 2^-32, xacc the int64 sums attn_o_proj
    #                      adds its heads' shares into (gate_up reads it, down folds it into x
    #                      and zeroes it; gemv_mma.py "xacc")
    i8: int = 0          # the staged activations as three signed-byte digits (22 bits of a
    #                      group's absmax) on the int8 tensor cores, 3 instructions a word of
    #                      weights instead of 9 (gemv_mma.py "i8").  (i8=2, the digits
    #                      stored as words, lost: docs/PERF.md 0.29, code at 2c215a2)

    def rows_per_block(self) -> int:
        return TILE * (self.threads // 32 // self.warps)

    def layout(self) -> tuple:
        """What fixes the prepared weights: the mma fragment layout (layout.mma_layout)."""
        return ("mma", TILE)

    def tag(self) -> str:
        return (f"mma_w{self.warps}_t{self.threads}"
                + (f"_mb{self.min_blocks}" if self.min_blocks else "")
                + (f"_early{self.early}" if self.early else "")
                + (f"_l2a{self.l2ahead}" if self.l2ahead else "")
                + ("_xacc" if self.xacc else "") + ("_i8" if self.i8 else ""))


def check_tiling(kind: str, n_out: int, k: int, t: Tiling, heads=None) -> None:
    """Refuse what the CUDA-core GEMV (gemv.py) cannot do, with what to use instead; the
    tensor-core kernel's check is gemv_mma_shape.check_tiling."""
    if kind not in KINDS:
        raise ValueError(f"unknown GEMV kind {kind!r}; one of {KINDS}")
    if not isinstance(t, Tiling):
        raise ValueError(f"{kind}: {t} is not a CUDA-core Tiling (an MmaTiling is gemv_mma's, "
                         f"for {', '.join(MMA_KINDS)}: build it with make_<kind>_gemv)")
    if kind == "qkv_rope":
        if heads is None:
            raise ValueError("qkv_rope: build_kernel needs heads=(num_heads, num_kv_heads, head_dim)")
        hq, hkv, d = (int(h) for h in heads)
        if d <= 0 or d % 2:
            raise ValueError(f"qkv_rope: head_dim={d} is odd; RoPE pairs element i with i + D/2, "
                             f"so a head must split in halves (use kind 'qkv' and rope_kv)")
        if hq <= 0 or hkv <= 0 or n_out != (hq + 2 * hkv) * d:
            raise ValueError(f"qkv_rope: N={n_out} is not (num_heads + 2*num_kv_heads)*head_dim "
                             f"for heads {heads}; the rows must be [q heads | k heads | v heads]")
        if t.rows != 2:
            raise ValueError(f"qkv_rope: tiling {t.tag()} has rows={t.rows}; a thread owns one "
                             f"RoPE pair (rows i and i + D/2 of a head): use rows=2")
    elif heads is not None:
        raise ValueError(f"{kind}: heads= is for qkv_rope only")
    slots = t.rows * (2 if kind == "gate_up" else 1)
    if not (1 <= t.ks <= 32 and t.span in (32, 128) and slots <= 4 and t.threads % 32 == 0
            and int(t.prefetch) in (0, 1) and t.threads % t.lanes == 0 and t.threads <= 1024):
        raise ValueError(f"unsupported tiling {t} for {kind}")
    steps = -(-(k // GROUP_SIZE) // t.ks)
    if t.early and not (int(t.prefetch) == 1 and steps >= 2 and int(t.early) == 1):
        raise ValueError(f"{kind}: tiling {t.tag()}: early=1 loads step 1 before the wait beside "
                         f"step 0, so it needs prefetch=1 and two steps or more (K={k} gives "
                         f"{steps} at ks={t.ks}); use early=0")
    if int(t.i8) not in (0, 1):
        raise ValueError(f"{kind}: tiling {t.tag()}: i8 is 0 (fp16) or 1 (digits; span, the "
                         f"fp16 partials' length, then means nothing)")
    staged = core_staged_bytes(k, t)
    if staged > STATIC_SMEM_LIMIT:
        raise ValueError(f"{kind}: K={k} needs {staged} bytes of staged activations, over the "
                         f"{STATIC_SMEM_LIMIT}-byte static shared memory limit")


def core_staged_bytes(k: int, t: Tiling) -> int:
    """Static shared memory of the CUDA-core GEMV: its staged activations (16-byte units, 16
    a step and lane as fp16, 24 as digits), 1/f_g a group and a word a warp."""
    steps = -(-(k // GROUP_SIZE) // t.ks)
    return (steps * (24 if t.i8 else 16) * t.ks * 16 + (k // GROUP_SIZE) * 4
            + (t.threads // 32) * 4)


def staged_bytes(k: int, t: MmaTiling | None = None) -> int:
    """Bytes of a tensor-core GEMV's staged activations: 2 a value (fp16), 3 with i8 (the
    digits)."""
    return k * (3 if t is not None and t.i8 else 2)


def one_wave_tiles(n_tiles: int, sms: int, most: int) -> int:
    """Tiles a block, 1..most: the fewest waves of blocks (ceil(blocks / sms)), then the fewest
    tiles for the busiest SM (waves x tiles a block), then the fewest blocks.  Under
    programmatic launch a grid of more blocks than SMs piles its early blocks onto the SMs the
    kernel before leaves free, and the SMs holding two or three finish last: on the H200 the
    14B's gate_up at 4 tiles a block (216 blocks) lost 0.27 ms a step against 7 (124), the
    32B's (1728 tiles) ranked 7 > 8 > 6 > 4 > 11 tiles a block, waves first (docs/PERF.md
    0.20).  The 7B's 1184 tiles: 9 (132 blocks, its measured t576); the 14B's 864: 7."""
    def key(b):
        waves = -(-(-(-n_tiles // b)) // sms)
        return waves, waves * b, -b
    return min(range(1, most + 1), key=key)


def mma_tiling(kind: str, n_out: int, k: int, sms: int = 132) -> MmaTiling | None:
    """The tensor-core tiling for o_proj, down or gate_up, or None where gemv_mma cannot take
    the shape (N not a multiple of 16, or K's staged activations over half a block's 227 KB;
    the 32B's down stages 55 KB, over the 48 KB of static shared memory, in dynamic memory).
    o_proj and down: one 16-row tile a block, its groups split over `warps` warps: half the
    groups under 32 of them, else the largest divisor of the group count in 8..16, else 16;
    none under 16 groups (a small o_proj), where the CUDA-core kernel tied or won.  down with
    more tiles than SMs: ceil(tiles / SMs) tiles a block and at most 32 // that warps a tile,
    one wave (the 7B's measured t1024; the 14B's and 32B's 3 tiles of 10 warps, t960).

    Measured in the step graph (scripts/step_variants.py, 32d8702) against the CUDA-core
    tilings, ms a step at 512: 7B o_proj 14 warps -0.048 (beside the mma down), down 16 warps
    -0.069 (t1024, two tiles a block: -0.091, the 7B's measured entry); 1.5B o_proj 6 warps
    0.000, down 14 -0.125 (16: -0.103); 14B o_proj 10 -0.397 (8: -0.359, 20: -0.350), down 12
    t384 -0.244 (16 t512 -0.104); 3B o_proj 8 -0.004, down 16 -0.171; 0.5B down 16 -0.097, but
    o_proj (7 groups) 3 warps +0.012.

    gate_up (the default unless NQ_MMA_GATE_UP=0): 2 warps a tile, `one_wave_tiles` tiles a
    block (the 7B's 9 on 132 SMs, its measured t576; the 14B's and 32B's 7: on the H200 the
    14B step -0.27 ms and the 32B's -0.45 against 4 tiles a block, docs/PERF.md 0.20).
    Before, 256 threads (4 tiles a block) at every size, 13c221c's best in the 7B step
    (32d8702, ms a step at 512 against the CUDA-core default): +0.017 (+0.046 beside the mma
    down), 2 warps t128 +0.018, 4 warps t256 +0.084, 1 warp t128 +0.51, 7 warps t224 +0.19.
    What it buys is in the prefill: the GEMMs read the mma layout faster (H200, 2026-12-01,
    scripts/bench_gemm.py --layout gate_up=mma: 430-490 TFLOP/s at M = 512 and 462-469 at
    8192, against 326-359 and 372 in the row layout; ~-3.5 ms of a 512-token prompt, ~-32 ms
    of an 8K one), and fp32 sums in decode.  In the whole engine (H200, 2026-12-01,
    scripts/prefill_timeline.py and step_variants.py "gate_up.mma=1"): pp512 22.04 -> 18.90
    ms, pp2048 77.7 -> 67.5, pp8192 354.0 -> 313.8; the decode step +0.038 ms at 512 and +0.035
    at 8K.  None where K's activations pass 48 KB of static shared memory (K > 24576).

    qkv / qkv_rope (NQ_MMA_QKV=1, o_proj's rule) lost +0.043 ms a step at 512 (H200,
    2026-12-02); retired after 29184bc (module doc)."""
    if kind not in MMA_KINDS or n_out % TILE or k % GROUP_SIZE or 2 * k > SMEM_OPTIN_LIMIT // 2:
        return None
    if kind == "gate_up":
        if 2 * k > STATIC_SMEM_LIMIT:
            return None
        # 2 warps a tile; from K = 2048 on as many tiles a block as spread the grid one
        # block an SM (one_wave_tiles, at most 10: 640 threads of ~88 registers): the 3B
        # -0.06, 14B -0.27, 32B -0.45 ms a step; below it 4 tiles, which won there (the
        # 1.5B's 5 a block +0.059, the 0.5B's 3 +0.011; H200, 2026-12-03, docs/PERF.md 0.20)
        tiles = 4 if k < 2048 else one_wave_tiles(n_out // TILE, sms, 10)
        return MmaTiling(warps=2, threads=64 * tiles)
    groups = k // GROUP_SIZE
    if groups < 16:
        return None
    if groups < 32:
        warps = max(1, groups // 2)
    else:
        warps = max((d for d in range(8, 17) if groups % d == 0), default=16)
    tiles = 1
    if kind == "down":
        # one wave, one block an SM: ceil(tiles / SMs) tiles a block, 32 // that warps a tile
        # at most (the 7B's measured t1024 is this rule's; the 14B's and 32B's 320 tiles at
        # one a block, 2.4 blocks an SM, lost 0.09-0.22 ms a step against 3 of 10 warps)
        tiles = -(-(n_out // TILE) // sms)
        warps = min(warps, max(1, 32 // tiles))
    return MmaTiling(warps=warps, threads=32 * warps * tiles)


def head_tiling(k: int) -> Tiling:
    """The INT4 lm_head's tiling (gemv.py's lm_head kind; nq/kernels/lm_head_int4.py has the
    why): 4 lanes a row, 1 row a thread, 256 threads, the activations as digits where they fit
    static shared memory (exact sums, as qkv's), at most 128 registers (two blocks an SM; no
    spill on the device for any preset, where 8 lanes spilled at the 0.5B's 7 groups).  H100
    SXM, 2026-12-07, the 7B's head alone: 98.2 us (94.5 % of the copy rate), 8 lanes 101.6,
    two rows a thread at one block an SM 98.7, 14 lanes 108.8, one block a row block 129.0."""
    t = Tiling(ks=4, rows=1, threads=256, min_blocks=2, i8=1)
    return t if core_staged_bytes(k, t) <= STATIC_SMEM_LIMIT else dataclasses.replace(t, i8=0)


def default_tiling(kind: str, n_out: int, k: int, sms: int | None = None,
                   mma: bool = True) -> Tiling | MmaTiling:
    """The tiling for one GEMV shape (`measured_tiling` says how it is chosen); a tensor-core
    tiling of I8_KINDS stages its activations as digits (`with_i8`; NQ_I8, module doc)."""
    if kind in ("lm_head", "lm_head_bound"):
        return head_tiling(k)
    t = measured_tiling(kind, n_out, k, sms, mma)
    if isinstance(t, Tiling):
        return with_core_i8(k, t) if kind in CORE_I8_KINDS else t
    return with_i8(kind, k, t) if kind in I8_KINDS else t


def with_core_i8(k: int, t: Tiling) -> Tiling:
    """A CUDA-core tiling with its activations as digits (gemv_digits.py), where they fit
    static shared memory; min_blocks 1 bounds its registers by one block an SM (the 7B's
    qkv_rope: 384 threads, at most 168 registers)."""
    i8 = dataclasses.replace(t, i8=1, min_blocks=t.min_blocks or 1)
    return i8 if core_staged_bytes(k, i8) <= STATIC_SMEM_LIMIT else t


def with_i8(kind: str, k: int, t: MmaTiling) -> MmaTiling:
    """A tensor-core tiling with i8, unless gate_up's 3 bytes a value pass the static shared
    memory it stages in (gemv_mma_shape.check_tiling refuses that i8): then t."""
    i8 = dataclasses.replace(t, i8=1)
    return t if kind == "gate_up" and staged_bytes(k, i8) > STATIC_SMEM_LIMIT else i8


def measured_tiling(kind: str, n_out: int, k: int, sms: int | None = None,
                    mma: bool = True) -> Tiling | MmaTiling:
    """The tiling for one GEMV shape: measured winners for the 7B, a rule for the rest; sms is
    the device's SM count (`common.sm_count`, 132 offline) unless given: the one-wave rules
    (`one_wave_tiles`, down's tiles a block, qkv's threads) and the 7B's t576 gate_up read it.

    mma=True lets o_proj and down take the tensor-core kernel (`mma_tiling`), which won at
    every size measured, and gate_up where MMA_GATE_UP is on; mma=False gives the CUDA-core
    tiling for the shape.  The CUDA-core
    rule: a single wave whose threads each own >= 1 whole group; spread a row over as many
    lanes as keeps the thread count under ~700 per SM (what 64 registers allow).
    """
    if sms is None:
        from nq.kernels.common import sm_count
        sms = sm_count()
    if kind == "qkv_rope":
        # qkv's tiling (its ks fixes the weight layout both read), a RoPE pair a thread.
        # Same threads and span too: rstd's summation order and the fp16 partials then match
        # qkv's, which is what makes qkv_rope bit-identical to qkv + rope_kv.  No register cap
        # (the H200's JIT took 124 when this was measured, 71 at 2026-12-03; the offline CUDA
        # 13 ptxas ~210 given only .maxntid 256; the 7B's grid is 96 blocks of 384 threads
        # since docs/PERF.md 0.20, 144 of 256 before).  In the 7B step
        # graph (scripts/step_variants.py) the uncapped kernel beat min_blocks=2 at 32K (+0.025
        # against +0.21 ms over qkv + rope_kv); at 512 it saves 0.05 ms.  Alone, graph, no PDL:
        # 9.26 us against qkv 8.89 + rope_kv = 10.95 us (ks14 t128 9.28, ks7 t128 10.04).
        t = dataclasses.replace(default_tiling("qkv", n_out, k, sms, mma=False), rows=2)
        if (n_out, k) == (4608, 3584):
            # the 7B's two steps: step 1's loads before the wait too (docs/PERF.md 0.26; H100,
            # 2026-12-07, three runs of step_variants.py): -0.024 / -0.010 / -0.003 ms a step
            # at 512, -0.017 / -0.008 / -0.000 at 8K, -0.008 / -0.006 / +0.001 at 32K.  159
            # registers offline against 134, still one 384-thread block an SM; at the 14B's and
            # 32B's widths it spills.
            t = dataclasses.replace(t, early=1)
        return t
    groups = k // GROUP_SIZE
    # (kind, n_out, k) -> Tiling, chosen inside the whole decode step on the H200
    # (scripts/step_variants.py; docs/KERNELS_GEMV.md): alone (bench_gemv.py) and in the step
    # rank tilings differently, because with PDL the next kernel's blocks start beside these.
    measured = {
        # 8.3 us alone; L2 prefetch: +0.005 ms.  span 128 (one fp16 partial a group): -0.010 ms
        # a step at 512 and 8K, as qkv_rope, which takes this tiling (946790c).  384 threads
        # (qkv_rope's 96 blocks of 48 rows, where 256 made 144): -0.016 / -0.018 ms at 512 /
        # 8K, 512 threads -0.003 / -0.014 (H200, 2026-12-03, docs/PERF.md 0.20): down's 112
        # blocks leave 20 SMs free, and three 256-thread blocks fit each of them early
        ("qkv", 4608, 3584): Tiling(ks=14, threads=384, span=128),
        # the 14B's and 32B's: 512 threads, qkv_rope's 56 blocks (-0.062 / -0.073 ms at 512 /
        # 8K against the rule's 256, 112 blocks, which beat 128's 224 by 0.05; H200,
        # 2026-12-03): one block, not three, beside down on each SM its 107 blocks leave free.
        # With the digits (CORE_I8_KINDS) 384, qkv_rope's 75 blocks: -0.046 / -0.033 against
        # 512, whose 128-register cap the digits' loop fills (H100, 2026-12-07, 14B step;
        # 256 -0.046 / -0.014, 1024 +1.5; at the 32B 512 +0.054 / +0.040: docs/PERF.md 0.31)
        ("qkv", 7168, 5120): Tiling(ks=8, threads=384 if CORE_I8_KINDS else 512),
        ("o_proj", 3584, 3584): Tiling(ks=14, threads=256),  # 6.8 us alone; (both, in the step)
        # 3 blocks of 192 an SM: -0.08 ms a step against t128 (80 registers, 6 blocks), -0.06
        # for t128 capped at 5 blocks; t64 +0.12, t256 -0.04; then prefetch -0.02 (95 regs).
        ("gate_up", 18944, 3584): Tiling(ks=4, threads=192, span=128, min_blocks=3),
        # gate_up on the tensor cores lost in the step (32d8702): ks2 t256 +0.017 ms (+0.046
        # beside the mma down), ks2 t128 +0.018, ks4 t256 +0.084, ks1 t128 +0.51, ks7 t224 +0.19
        # (the default all the same, for the prefill's sake: MMA_GATE_UP, mma_tiling)
        ("down", 3584, 18944): Tiling(ks=16, threads=512),  # 18.9 us; every other grid loses
        # Lost in the step graph: blocks sized to one whole wave (qkv t576, o_proj t448,
        # gate_up t576, down t448: 128-132 blocks, one an SM) were faster alone (7.25 / 6.62 /
        # 25.2 / 19.0 us; regions -0.19 ms) but the whole step went 2.17 -> 2.38 ms (kernel_gap
        # 0.02 -> 0.32 ms): a next kernel's blocks no longer fit beside the running one.
    }
    # on the tensor cores, against the CUDA-core entries above, in the 7B step (32d8702):
    measured_mma = {
        # a 16-row tile a block, 14 warps splitting its 28 groups: -0.048 ms a step at 512
        # beside the mma down (7 warps t448, two tiles a block: -0.007; 14 warps t896: +0.030).
        # Then l2ahead=2 (a warp's group two ahead asked of L2), with gate_up's l2ahead=1
        # below: -0.011 / -0.018 / -0.017 and -0.009 / -0.018 / -0.019 ms at 512 / 8K / 32K
        # (H200, 2026-12-03, two runs); o_proj alone l2ahead 1 / 2 / 3 -0.006 / -0.006 /
        # -0.008 at 512 (docs/PERF.md 0.16)
        ("o_proj", 3584, 3584): MmaTiling(warps=14, threads=448, l2ahead=2),
        # two tiles a block of 32 warps, 16 a tile: -0.091 ms at 512 and 8K against the
        # CUDA-core down, which ncu read as issue-bound; 16 warps t512 -0.069, 32 t1024 +0.022,
        # 8 t512 +0.11, 8 t256 +0.16, 4 t256 +0.61.  Then early=1 (a warp's first group and
        # the tile's scales copied to shared memory before griddepcontrol.wait; H200,
        # 2026-12-02): -0.0165 / -0.0182 / -0.0156 ms at 512 / 8K / 32K (early 2 -0.0145 /
        # -0.0174 / -0.0160, early 3 +0.017, early 4 +0.051)
        ("down", 3584, 18944): MmaTiling(warps=16, threads=1024, early=1),
    }
    if sms >= 132:
        # 9 tiles a block (576 threads): 132 blocks, one an SM (t256's 296 blocks are 2.24 an
        # SM, the last of them a tail): -0.008 / -0.008 / -0.004 ms a step at 512 / 8K / 32K
        # against t256 (H200, 2026-12-02, two runs); t192 (395 blocks) +0.053.  early=1 (a
        # warp's first gate and up groups copied before the wait; tried, not kept) +0.237 at
        # t256 (90 registers: two blocks an SM, two waves), +0.003 at t576; early=2 worse.
        # l2ahead=1 (its group one ahead asked of L2): -0.004 / -0.012 / -0.009 and -0.000 /
        # -0.011 / -0.010 ms (H200, 2026-12-03); l2ahead 2 +0.008 / -0.002 / -0.004, 4 +0.039
        measured_mma[("gate_up", 18944, 3584)] = MmaTiling(warps=2, threads=576, l2ahead=1)
    if sms == 132:
        # the 14B's and 32B's down: the rule's 3 tiles a block (107 blocks) at 8 warps a tile
        # instead of 10 (t768, 27 / 13.5 groups a warp): -0.022 / -0.029 ms a step at 512 / 8K
        # (14B), -0.014 / -0.026 (32B; H200, 2026-12-03, docs/PERF.md 0.20)
        # Then early=1 (the 7B's down's): the 14B -0.042 / -0.033 ms (early 2 -0.051 /
        # -0.036); with gate_up's l2ahead=1 below, the two against neither: the 14B -0.039 /
        # -0.057, the 32B -0.041 / -0.063 and -0.046 / -0.072 (two runs against the mean of
        # its baselines, which drifted 0.02-0.03; H200, 2026-12-04, docs/PERF.md 0.22)
        measured_mma[("down", 5120, 13824)] = MmaTiling(warps=8, threads=768, early=1)
        measured_mma[("down", 5120, 27648)] = MmaTiling(warps=8, threads=768, early=1)
        # the 14B's and 32B's gate_up: the rule's 7 tiles a block with the 7B's l2ahead=1
        # (the 14B alone -0.035 / -0.027)
        measured_mma[("gate_up", 13824, 5120)] = MmaTiling(warps=2, threads=448, l2ahead=1)
        measured_mma[("gate_up", 27648, 5120)] = MmaTiling(warps=2, threads=448, l2ahead=1)
    if mma and (kind != "gate_up" or MMA_GATE_UP):
        t = measured_mma.get((kind, n_out, k)) or mma_tiling(kind, n_out, k, sms=sms)
        if t is not None:
            return t
    if (kind, n_out, k) in measured:
        return measured[(kind, n_out, k)]
    budget = sms * 700
    best = 1
    for ks in range(1, min(32, groups) + 1):
        lanes = 1 << (ks - 1).bit_length()
        if n_out * lanes > budget and best > 1:
            break
        steps = -(-groups // ks)
        waste = steps * ks - groups
        if waste * 8 <= groups or ks == groups:  # at most 1/8 of the last step idle
            best = ks
    t = Tiling(ks=best, rows=1, threads=256 if k * 2 > 16384 else 128)
    if kind == "qkv" and -(-n_out // Tiling(ks=best, rows=2).rows_per_block()) > sms:
        # qkv_rope (rows 2) at 128 threads would be more blocks than SMs: twice the threads,
        # so its early blocks do not pile up beside down's (the 14B's 224 blocks of 128 ->
        # 112 of 256: -0.05 ms a step at 512, docs/PERF.md 0.20)
        t = dataclasses.replace(t, threads=256)
    return t
