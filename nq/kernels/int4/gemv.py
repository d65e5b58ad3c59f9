"""The fused INT4 GEMVs of a decode step, and the weight layout they read.

    qkv      out fp32 (N,)  = Wqkv . rmsnorm(x, w_in) + bias         N = q + 2 kv
    qkv_rope qkv, then rope_kv's job in the epilogue: rotated q fp32 -> q_out, rotated k and
             v fp16 -> the KV page table[pos//16], slot pos%16 (nq/kernels/rope_kv.py)
    o_proj   x   fp32 (H,) += Wo . a                                 a fp16 (attention output)
    gate_up  out fp16 (I,)  = silu(Wg . h) * (Wu . h),  h = rmsnorm(x, w_post)
    down     x   fp32 (H,) += Wd . a                                 a fp16 (SwiGLU output)

Public API (the engine codes against this; docs/KERNELS_GEMV.md has the design and figures):

    g = make_qkv_gemv(cfg)     # make_qkv_rope_gemv / make_o_proj_gemv / make_gate_up_gemv / ...
    qw, sc = g.prepare([(q_qw, q_sc), (k_qw, k_sc), (v_qw, v_sc)])   # host numpy, once
    g(x, norm_w, qw, sc, bias, out, stream)      # qkv     (bias: the q,k,v biases concatenated)
    g(a, qw, sc, x, stream)                      # o_proj, down
    g(x, norm_w, qw, sc, out, stream)            # gate_up (prepare([(gate...), (up...)]))
    g(x, norm_w, qw, sc, bias, state, inv_freq, table, kv_layer, q_out, stream)  # qkv_rope

`prepare` takes the file's (N, K/8) ValueShuffle qweights and (N, K/128) fp16 scales,
concatenates the parts along N, and permutes each row's 16-byte chunks into the order the
kernel's lanes read them (`tile_rows`; scales keep the file's layout).  Upload its outputs
as they are.  Launchers take numba device arrays and a numba stream, allocate nothing, touch
no host memory and are safe to capture in a CUDA graph; no workspace is needed (every
reduction is inside a warp).  References: ref_qkv, ref_o_proj, ref_gate_up, ref_down,
ref_qkv_rope.

How a kernel works (one thread = `rows` output rows x whole 128-weight groups):
  * A row's G = K/128 groups are split over `ks` lanes of a segment of P = pow2(ks) lanes;
    lane j owns groups j, j+ks, j+2ks, ... ("steps").  Per step it issues four 16-byte loads
    per weight row (one group: 128 nibbles) and one 2-byte scale load, all before any math;
    with `prefetch` (1) the next step's loads are issued before this step's math, with
    prefetch=2 the next two steps' (17 more registers a row, more bytes in flight).
  * `block_major` (qkv, o_proj, down; not a default, not yet measured): the prepared weights
    are stored so that each (block, step) is one contiguous run -- the block's rows' words of
    that step, row after row -- instead of a 1 KB piece of each of the block's rows (9.5 KB
    apart for down).  Same words, same order of math, so the same bits; only DRAM locality
    changes.  The kernel takes the flat array (`_check_weights` passes a 1-D view).
  * `bulk` (block_major qkv, o_proj, down; opt-in, not yet measured): the block gets one more
    warp, a producer whose lane 0 copies each (block, step) run -- one contiguous run in the
    block-major layout -- into a ring of `bulk` shared-memory stages with one cp.async.bulk
    (full/empty mbarriers, attn_mma's protocol), so the copy engine, not 16-byte loads from
    every lane, keeps a block's next steps in flight (down: 32 KB a stage) without holding
    registers.  Weights depend on nothing upstream, so the producer starts at block entry,
    before griddepcontrol.wait (it writes no global memory).  The consumers (the tiling's
    `threads`) read the same 16 words a step from shared memory at the same in-run offsets
    and do the same math, so the results are bit for bit those of bulk=0; scale bits stay
    2-byte global loads, a step ahead.  Launch: `Tiling.block` = threads + 32 threads and
    `ring_bytes` of dynamic shared memory (opted in above 48 KB; one down block then takes
    ~140 KB of the SM's 227 KB, so one block an SM).  Not for gate_up (two matrices a block),
    qkv_rope, l2_steps or stream.
  * The step-0 loads are issued first of all: weights do not depend on the activations, so
    the DRAM latency overlaps the prologue (RMSNorm, staging).
  * Prologue: every block stages the whole activation vector in shared memory as fp16, each
    group of 128 multiplied by a power of two f_g that brings its absmax into [128, 256)
    (exact; undone in fp32 with the weight scale).  This bounds every fp16 partial sum: a
    nibble times an activation is <= 7*256 = 1792, and 32 such products stay < 65504, so
    the fp16 partials cannot overflow even on Qwen's "massive activations".  RMSNorm's rstd
    is applied once to the final dot product (the staged values are x*w*f_g).
  * Dequant, per 32-bit word (8 weights): (q & 0x000F000F) ^ 0x64086408 is the fp16 pair
    1032+n (the XOR maps two's complement n to n+8), minus 1032 gives n exactly; the high
    nibbles (q & 0x00F000F0) ^ 0x64806480 are 1152+16n, fma(., 1/16, -72) gives n; q >> 8
    gives the other four.  1 shr + 4 lop3 + 4 add/fma + 4 fma.f16x2 = 13 per 8 weights.
  * fp16 partial sums span `span` weights (32: one 16-byte chunk, 8 products per fp16 lane;
    128: one group), then go to fp32 and are scaled once per group: fp32 acc += partial *
    (scale * 1/f_g).  Error: the inputs are fp16 (2^-11 relative), each fp16 partial adds
    ~sqrt(8) roundings of 2^-11 of its own magnitude, which is random in sign across
    chunks: |out - ref_fp64| / |ref| ~ 1e-3 (tests allow 5e-3 relative to the row norm).
  * The segment reduces its lanes with shuffles; lane 0 writes (one writer per element).

qkv_rope reads qkv's weights as they are (same `prepare`, same default ks, so one upload
serves both): a thread owns one RoPE pair, rows r0 = h*D + i and r0 + D/2 of head h (rows=2;
`weight_row` maps the pair to its rows), so lane 0 holds both halves of the rotation.  Its
fp32 y = acc*rstd + bias is exactly what qkv writes, and the rotation is rope_kv's arithmetic
(fp32 angle pos*inv_freq[i], precise libdevice cosf/sinf: not fastmath, whose Payne-Hanek
path for |angle| > 1e5 keeps 28 bytes of local memory, as rope_kv's does; the same fmas
rope_kv's expressions compile to), so with qkv's threads, ks and span the outputs are
bit-identical to qkv followed by rope_kv.  state and table are read after
griddepcontrol.wait (the previous step's argmax advances the position).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
from numba import cuda, float32, uint32
from numba.cuda.types import float16, uint64

from nq.config import GROUP_SIZE, ModelConfig
from nq.kernels.common import block_rstd, dev, warp_max, warp_sum
from nq.paged import PAGE, STATE_LEN, STATE_POS, check_paged_args
from nq.ptx import (LUT_AND_XOR, SIMULATOR, add_rn_f16x2, cp_async_bulk_g2s,
                    cp_async_bulk_prefetch_l2, cvt_f32_f16, cvt_rn_f16_f32, cvta_to_shared_u32,
                    cvta_to_shared_u32_at, fence_mbarrier_init, fma_rn_f16x2,
                    griddepcontrol_launch_dependents, griddepcontrol_wait, ld_global_nc_na_v4_u32,
                    ld_global_nc_u16, ld_global_nc_v2_u32, ld_global_nc_v4_f32,
                    ld_global_nc_v4_u32, ld_shared_v4_u32, ld_shared_v4_u32_at, lop3_b32,
                    mbarrier_arrive, mbarrier_arrive_expect_tx, mbarrier_init, mbarrier_wait_parity,
                    pack_f16x2_from_f32,
                    st_global_u16, unpack_f16x2_to_f32)
from nq.kernels.int4.dequant import (_MAGIC_HI, _MAGIC_LO, _MASK_HI, _MASK_LO, _NEG72, _NEG1032,
                                     _SH8, _SIXTEENTH, pow2_scale_f32)
from nq.kernels.int4.layout import (chunk_permutation, prepare_weights, tile_rows,  # noqa: F401
                                    untile_rows)
from nq.ref import linear, rms_norm, swiglu

KINDS = ("qkv", "o_proj", "gate_up", "down", "qkv_rope")
STATIC_SMEM_LIMIT = 48 * 1024  # numba has no opt-in for more static shared memory per block
SMEM_LIMIT = 227 * 1024        # sm_90: static + dynamic shared memory of one block (opted in)
RING_ALIGN = 128               # bulk copies' shared destination (16 required, 128 preferred)


# ---- NumPy references ------------------------------------------------------------------------

def ref_qkv(x, norm_w, eps, w_deq, bias):
    """x fp32 (H,), norm_w (H,), w_deq (N, H) fp32 (q,k,v stacked), bias (N,) -> fp32 (N,)."""
    return linear(rms_norm(x, norm_w, eps), w_deq, bias)


def ref_qkv_rope(cfg, x, norm_w, w_deq, bias, pos):
    """ref_qkv, then rope_kv at position pos -> (q (Hq, D) fp32, k (Hkv, D) fp16, v (Hkv, D) fp16)."""
    from nq.kernels.rope_kv import rope_kv_reference
    return rope_kv_reference(cfg, ref_qkv(x, norm_w, cfg.rms_norm_eps, w_deq, bias), pos)


def ref_o_proj(a, w_deq, x):
    """a (K,) (fp16 attention output), w_deq (H, K), x fp32 (H,) -> the new residual x + W.a."""
    return np.asarray(x, np.float32) + linear(np.asarray(a, np.float32), w_deq)


ref_down = ref_o_proj  # same contract: residual += W . a


def ref_gate_up(x, norm_w, eps, w_gate, w_up):
    """x fp32 (H,), w_gate / w_up (I, H) -> silu(gate) * up, fp32 (I,) (the kernel stores fp16)."""
    h = rms_norm(x, norm_w, eps)
    return swiglu(linear(h, w_gate), linear(h, w_up))


# ---- the tile layout (NumPy model; the kernel's address arithmetic mirrors it) ---------------

@dataclasses.dataclass(frozen=True)
class Tiling:
    """How a GEMV splits work; chosen per shape by `default_tiling` (measured in bench_gemv)."""
    ks: int              # lanes a row's groups are spread over (1..32); lane j owns j + ks*s
    rows: int = 1        # output rows per thread (gate_up: gate/up pairs)
    threads: int = 128   # threads per block
    prefetch: int = 1    # steps whose loads are in flight ahead of the math: 0, 1 or 2
    span: int = 32       # weights per fp16 partial sum: 32 (a chunk) or 128 (a group)
    min_blocks: int = 0  # launch_bounds' min blocks per SM (caps registers); 0: not given
    l2_steps: int = 0    # steps of each row a block asks L2 to prefetch before it waits on the
    #                      kernel before it (PDL); 0: none, >= the step count: the whole row
    block_major: bool = False  # weights stored step-major per block (`block_major_rows`): each
    #                      step of a block reads one contiguous run instead of 1 KB per row
    stream: bool = False  # weight loads as ld.global.nc.L1::no_allocate.L2::256B (whole 256-byte
    #                      sector groups into L2 at the first load of a run; nothing kept in L1)
    bulk: int = 0        # block_major only: shared-memory stages (2..4) a producer warp fills
    #                      with one cp.async.bulk per (block, step); 0: off (per-lane loads)
    mma: bool = False    # o_proj/down/gate_up on the tensor cores (nq/kernels/int4/gemv_mma.py): ks is
    #                      the warps a 16-row tile's groups are split over, and the weights
    #                      have the mma fragment layout (o_proj/down's default: mma_tiling)
    splits: int = 1      # mma o_proj/down only: blocks a tile's groups are split over (split-K;
    #                      the last block of a tile to finish adds the partials in split order;
    #                      measured, lost: opt-in)

    @property
    def lanes(self) -> int:
        return 1 << (self.ks - 1).bit_length()

    def tag(self) -> str:
        return (f"ks{self.ks}_r{self.rows}_t{self.threads}"
                + ("_pf" if self.prefetch == 1 else f"_pf{int(self.prefetch)}" if self.prefetch else "")
                + ("_s128" if self.span == 128 else "")
                + (f"_mb{self.min_blocks}" if self.min_blocks else "")
                + (f"_l2p{self.l2_steps}" if self.l2_steps else "")
                + ("_bm" if self.block_major else "") + ("_st" if self.stream else "")
                + (f"_bk{self.bulk}" if self.bulk else "") + ("_mma" if self.mma else "")
                + (f"_sk{self.splits}" if self.splits != 1 else ""))

    @property
    def block(self) -> int:
        """Threads a block is launched with: `threads` consumers, plus the producer warp (bulk)."""
        return self.threads + (32 if self.bulk else 0)

    def rows_per_block(self) -> int:
        if self.mma:  # 16-row tiles of ks warps each
            return 16 * (self.threads // 32 // self.ks)
        return (self.threads // self.lanes) * self.rows

    def layout(self) -> tuple[int, int]:
        """What fixes the prepared weights' layout: (ks, the rows of a block if block_major
        else 0; (-1, 16) for the mma fragment layout).  Tilings with equal layouts read the
        same uploaded weights."""
        if self.mma:
            return -1, 16
        return self.ks, (self.rows_per_block() if self.block_major else 0)


def _block_slices(n: int, k8: int, ks: int, rows_per_block: int):
    """(row0, rows, word0, word1) of every (block, step) in block-major memory order."""
    g = k8 * 8 // GROUP_SIZE
    steps = -(-g // ks)
    for b0 in range(0, n, rows_per_block):
        rows = min(rows_per_block, n - b0)
        for s in range(steps):
            w0 = s * ks * 16
            yield b0, rows, w0, min(w0 + ks * 16, k8)


def block_major_rows(tiled: np.ndarray, ks: int, rows_per_block: int) -> np.ndarray:
    """tile_rows' (N, K/8) -> the same words, (N, K/8) in shape, whose C-order memory is
    block-major: for each block of rows_per_block rows, for each step, every row's words of
    that step (KS*16, or 16 per group of a short last step).  A step of a block is then one
    contiguous run (32 rows x 1 KB for down's ks16 t512) instead of a 1 KB piece of each of 32
    rows 9.5 KB apart.  The kernel's flat address (load_row, block_major) mirrors this."""
    n, k8 = tiled.shape
    out = np.empty(n * k8, np.uint32)
    pos = 0
    for b0, rows, w0, w1 in _block_slices(n, k8, ks, rows_per_block):
        seg = tiled[b0:b0 + rows, w0:w1]
        out[pos:pos + seg.size] = seg.ravel()
        pos += seg.size
    return out.reshape(n, k8)


def unblock_major_rows(blocked: np.ndarray, ks: int, rows_per_block: int) -> np.ndarray:
    """The inverse of block_major_rows."""
    n, k8 = blocked.shape
    flat = np.ascontiguousarray(blocked).reshape(-1)
    out = np.empty((n, k8), np.uint32)
    pos = 0
    for b0, rows, w0, w1 in _block_slices(n, k8, ks, rows_per_block):
        size = rows * (w1 - w0)
        out[b0:b0 + rows, w0:w1] = flat[pos:pos + size].reshape(rows, w1 - w0)
        pos += size
    return out


def mma_tiling(kind: str, n_out: int, k: int) -> Tiling | None:
    """The tensor-core tiling (nq/kernels/int4/gemv_mma.py) for o_proj or down, or None where
    gemv_mma cannot take the shape (N not a multiple of 16, or K's staged activations over 48 KB:
    the 32B's down).  One 16-row tile a block, its groups split over `ks` warps: half the groups
    under 32 of them, else the largest divisor of the group count in 8..16, else 16; none
    under 16 groups (a small o_proj), where the CUDA-core kernel tied or won.

    Measured in the step graph (scripts/step_variants.py, session 5) against gemv_int4's
    tilings, ms a step at 512: 7B o_proj ks14 -0.048 (beside the mma down), down ks16 -0.069
    (t1024, two tiles a block: -0.091, the 7B's measured entry); 1.5B o_proj ks6 0.000, down
    ks14 -0.125 (ks16 -0.103); 14B o_proj ks10 -0.397 (ks8 -0.359, ks20 -0.350), down ks12
    t384 -0.244 (ks16 t512 -0.104); 3B o_proj ks8 -0.004, down ks16 -0.171; 0.5B down ks16
    -0.097, but o_proj (7 groups) ks3 +0.012.  gate_up on the tensor cores lost at the 7B
    (default_tiling's note), so it is not chosen."""
    if kind not in ("o_proj", "down") or n_out % 16 or k % GROUP_SIZE or 2 * k > 48 * 1024:
        return None
    g = k // GROUP_SIZE
    if g < 16:
        return None
    if g < 32:
        ks = max(1, g // 2)
    else:
        ks = max((d for d in range(8, 17) if g % d == 0), default=16)
    return Tiling(ks=ks, threads=32 * ks, mma=True)


def default_tiling(kind: str, n_out: int, k: int, sms: int = 132, mma: bool = True) -> Tiling:
    """The tiling for one GEMV shape: measured winners for the 7B, a rule for the rest.

    mma=True lets o_proj and down take the tensor-core kernel (`mma_tiling`), which won at
    every size measured; mma=False gives gemv_int4's (CUDA-core) tiling for the shape.  The
    CUDA-core rule: a single wave whose threads each own >= 1 whole group; spread a row over
    as many lanes as keeps the thread count under ~700 per SM (what 64 registers allow).
    """
    if kind == "qkv_rope":
        # qkv's tiling (its ks fixes the weight layout both read), a RoPE pair a thread.
        # Same threads and span too: rstd's summation order and the fp16 partials then match
        # qkv's, which is what makes qkv_rope bit-identical to qkv + rope_kv.  No register cap:
        # the H200's JIT takes 124 (two 256-thread blocks an SM, the 7B's 144 blocks in one
        # wave); the offline CUDA 13 ptxas takes ~210 given only .maxntid 256.  In the 7B step
        # graph (scripts/step_variants.py) the uncapped kernel beat min_blocks=2 at 32K (+0.025
        # against +0.21 ms over qkv + rope_kv); at 512 it saves 0.05 ms.  Alone, graph, no PDL:
        # 9.26 us against qkv 8.89 + rope_kv = 10.95 us (ks14 t128 9.28, ks7 t128 10.04).
        return dataclasses.replace(default_tiling("qkv", n_out, k, sms), rows=2)
    g = k // GROUP_SIZE
    # (kind, n_out, k) -> Tiling, chosen inside the whole decode step on the H200
    # (scripts/step_variants.py; docs/KERNELS_GEMV.md): alone (bench_gemv.py) and in the step
    # rank tilings differently, because with PDL the next kernel's blocks start beside these.
    measured = {
        # 8.3 us alone; L2 prefetch: +0.005 ms.  span 128 (one fp16 partial a group): -0.010 ms
        # a step at 512 and 8K, as qkv_rope, which takes this tiling (session 4)
        ("qkv", 4608, 3584): Tiling(ks=14, threads=256, span=128),
        ("o_proj", 3584, 3584): Tiling(ks=14, threads=256),  # 6.8 us alone; (both, in the step)
        # 3 blocks of 192 an SM: -0.08 ms a step against t128 (80 registers, 6 blocks), -0.06
        # for t128 capped at 5 blocks; t64 +0.12, t256 -0.04; then prefetch -0.02 (95 regs).
        ("gate_up", 18944, 3584): Tiling(ks=4, threads=192, span=128, min_blocks=3),
        # gate_up on the tensor cores lost in the step (session 5): ks2 t256 +0.017 ms (+0.046
        # beside the mma down), ks2 t128 +0.018, ks4 t256 +0.084, ks1 t128 +0.51, ks7 t224 +0.19
        ("down", 3584, 18944): Tiling(ks=16, threads=512),  # 18.9 us; every other grid loses
        # Lost in the step graph: blocks sized to one whole wave (qkv t576, o_proj t448,
        # gate_up t576, down t448: 128-132 blocks, one an SM) were faster alone (7.25 / 6.62 /
        # 25.2 / 19.0 us; regions -0.19 ms) but the whole step went 2.17 -> 2.38 ms (kernel_gap
        # 0.02 -> 0.32 ms): a next kernel's blocks no longer fit beside the running one.
    }
    # on the tensor cores, against the CUDA-core entries above, in the 7B step (session 5):
    measured_mma = {
        # a 16-row tile a block, 14 warps splitting its 28 groups: -0.048 ms a step at 512
        # beside the mma down (ks7 t448, two tiles a block: -0.007; ks14 t896: +0.030)
        ("o_proj", 3584, 3584): Tiling(ks=14, threads=448, mma=True),
        # two tiles a block of 32 warps, 16 a tile: -0.091 ms at 512 and 8K against the
        # CUDA-core down, which ncu read as issue-bound; ks16 t512 -0.069, ks32 t1024 +0.022,
        # ks8 t512 +0.11, ks8 t256 +0.16, ks4 t256 +0.61
        ("down", 3584, 18944): Tiling(ks=16, threads=1024, mma=True),
    }
    if mma:
        t = measured_mma.get((kind, n_out, k)) or mma_tiling(kind, n_out, k)
        if t is not None:
            return t
    if (kind, n_out, k) in measured:
        return measured[(kind, n_out, k)]
    budget = sms * 700
    best = 1
    for ks in range(1, min(32, g) + 1):
        lanes = 1 << (ks - 1).bit_length()
        if n_out * lanes > budget and best > 1:
            break
        steps = -(-g // ks)
        waste = steps * ks - g
        if waste * 8 <= g or ks == g:  # at most 1/8 of the last step idle
            best = ks
    return Tiling(ks=best, rows=1, threads=256 if k * 2 > 16384 else 128)


# ---- the kernel ------------------------------------------------------------------------------

_ALIGN = None if SIMULATOR else 16   # the simulator refuses alignment=; numba honours it
def kernel_name(kind: str, n_out: int, k: int, t: Tiling, heads=None) -> str:
    """The kernel's name (profiles, launcher errors); qkv_rope adds its heads."""
    name = f"gemv_int4_{kind}_n{n_out}_k{k}_{t.tag()}"
    if heads is not None:
        name += "_h{}_kv{}_d{}".format(*heads)
    return name


@functools.lru_cache(maxsize=None)
def build_kernel(kind: str, n_out: int, k: int, t: Tiling, eps: float, heads=None):
    """The cuda.jit kernel `kernel_name(...)` and the signature to compile it for.

    heads: (num_heads, num_kv_heads, head_dim), for qkv_rope only (the RoPE epilogue)."""
    if kind not in KINDS:
        raise ValueError(f"unknown GEMV kind {kind!r}; one of {KINDS}")
    ROPE = kind == "qkv_rope"
    HQ = HKV = D = HALF = 1   # the RoPE epilogue's shape (bound in every kind: closures see it)
    if ROPE:
        if heads is None:
            raise ValueError("qkv_rope: build_kernel needs heads=(num_heads, num_kv_heads, head_dim)")
        HQ, HKV, D = (int(h) for h in heads)
        if D <= 0 or D % 2:
            raise ValueError(f"qkv_rope: head_dim={D} is odd; RoPE pairs element i with i + D/2, "
                             f"so a head must split in halves (use kind 'qkv' and rope_kv)")
        if HQ <= 0 or HKV <= 0 or n_out != (HQ + 2 * HKV) * D:
            raise ValueError(f"qkv_rope: N={n_out} is not (num_heads + 2*num_kv_heads)*head_dim "
                             f"for heads {heads}; the rows must be [q heads | k heads | v heads]")
        if t.rows != 2:
            raise ValueError(f"qkv_rope: tiling {t.tag()} has rows={t.rows}; a thread owns one "
                             f"RoPE pair (rows i and i + D/2 of a head): use rows=2")
        HALF = D // 2
    elif heads is not None:
        raise ValueError(f"{kind}: heads= is for qkv_rope only")
    G = k // GROUP_SIZE
    KS, P, RL, TPB = t.ks, t.lanes, t.rows, t.threads
    NMAT = 2 if kind == "gate_up" else 1
    RLW = RL * NMAT
    S = -(-G // KS)
    GL = G - (S - 1) * KS
    SEGS = TPB // P
    WARPS = TPB // 32
    NORM = kind in ("qkv", "gate_up", "qkv_rope")
    PREFETCH = int(t.prefetch) >= 1
    # two steps ahead; with S == 2 (qkv, o_proj of the 7B) every weight load of the thread is
    # then issued before griddepcontrol.wait (with S == 1 there is no second step to load)
    PF2 = int(t.prefetch) == 2 and S >= 2
    SPAN32 = t.span == 32
    UWORDS = S * 16 * KS * 4            # staged activations, uint32 words (fp16 pairs)
    UG = 4 if NORM else 8               # groups a warp loads at once in the prologue
    STAGE_ITERS = -(-G // (WARPS * UG))
    PF_BYTES = min(t.l2_steps * KS * 16, k // 8) * 4   # per row; steps are row prefixes
    BM = bool(t.block_major)
    NB = int(t.bulk)                    # bulk: shared-memory stages of the weight ring
    BK = NB > 0
    LDW = ld_global_nc_na_v4_u32 if t.stream else ld_global_nc_v4_u32   # the weight loads
    RB = SEGS * RL                      # weight rows a block owns (block_major: NMAT == 1)
    K8 = k // 8
    if BM and (NMAT != 1 or kind == "qkv_rope" or t.l2_steps):
        raise ValueError(f"{kind}: block_major is for qkv, o_proj and down without l2_steps "
                         f"(their blocks own consecutive weight rows); got {t}")
    if BK and (kind not in ("qkv", "o_proj", "down") or not BM or t.l2_steps or t.stream
               or not 2 <= NB <= 4):
        raise ValueError(f"{kind}: bulk={NB} (2..4 shared-memory stages) needs block_major=True "
                         f"and no l2_steps or stream, and is for qkv, o_proj and down only (a "
                         f"block's step is then one contiguous run: one bulk copy); got {t}")
    SW = RB * KS * 16                   # bulk: words of a ring stage (the largest run)
    NBARS = max(2 * NB, 1)              # bulk: full[NB], empty[NB] (a shape: a constant)
    RING_BYTES = ring_bytes(t, k)       # + slack: numba aligns dynamic shared to 4 bytes
    EPS = np.float32(eps)
    INV_K = np.float32(1.0 / k)
    ZERO = np.uint32(0)
    if not (1 <= KS <= 32 and t.span in (32, 128) and RLW <= 4 and TPB % 32 == 0
            and int(t.prefetch) in (0, 1, 2) and t.splits == 1
            and (NMAT == 1 or RL <= 2)
            and TPB % P == 0 and TPB <= 1024):
        raise ValueError(f"unsupported tiling {t} for {kind}")
    if UWORDS * 4 + G * 4 + WARPS * 4 > STATIC_SMEM_LIMIT:
        raise ValueError(f"{kind}: K={k} needs {UWORDS * 4} bytes of staged activations, "
                         f"over the {STATIC_SMEM_LIMIT}-byte static shared memory limit")
    if BK and UWORDS * 4 + G * 4 + WARPS * 4 + 16 * NB + RING_BYTES > SMEM_LIMIT:
        raise ValueError(f"{kind}: bulk={NB} stages of {SW * 4} bytes and the staged "
                         f"activations exceed {SMEM_LIMIT} bytes of shared memory; fewer stages")

    def load_row(qw, sc, row, ok, s, j):
        # 16 words of group s*KS+j of weight row `row`, and its scale's bits (zeros if absent)
        gs = KS if s < S - 1 else GL
        if ok and j < gs:
            if BM:  # qw is the flat block-major array (block_major_rows)
                b = row // RB
                rbe = min(RB, n_out - b * RB)
                c = b * (RB * K8) + s * (rbe * KS * 16) + (row - b * RB) * (gs * 16) + j * 4
                a0, a1, a2, a3 = LDW(qw, c)
                b0, b1, b2, b3 = LDW(qw, c + gs * 4)
                c0, c1, c2, c3 = LDW(qw, c + gs * 8)
                d0, d1, d2, d3 = LDW(qw, c + gs * 12)
            else:
                c = s * (KS * 16) + j * 4          # word index of chunk (i=0, j) of step s
                a0, a1, a2, a3 = LDW(qw, (row, c))
                b0, b1, b2, b3 = LDW(qw, (row, c + gs * 4))
                c0, c1, c2, c3 = LDW(qw, (row, c + gs * 8))
                d0, d1, d2, d3 = LDW(qw, (row, c + gs * 12))
            sb = uint32(ld_global_nc_u16(sc, (row, s * KS + j)))
            return (a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, sb)
        return (ZERO, ZERO, ZERO, ZERO, ZERO, ZERO, ZERO, ZERO,
                ZERO, ZERO, ZERO, ZERO, ZERO, ZERO, ZERO, ZERO, ZERO)

    def dot8(q, a, h0, h1):
        # 8 weights of word q times the 8 fp16 activations a (4 pairs), into fp16x2 h0, h1.
        # dequant_word's instructions, each pair's fma right after it: the order every figure
        # in docs/PERF.md was measured with (calling dequant_word gives the same values but
        # another PTX order and SASS schedule; compare on the device before switching)
        lo0 = lop3_b32(q, _MASK_LO, _MAGIC_LO, LUT_AND_XOR)
        hi0 = lop3_b32(q, _MASK_HI, _MAGIC_HI, LUT_AND_XOR)
        q8 = q >> _SH8
        lo1 = lop3_b32(q8, _MASK_LO, _MAGIC_LO, LUT_AND_XOR)
        hi1 = lop3_b32(q8, _MASK_HI, _MAGIC_HI, LUT_AND_XOR)
        h0 = fma_rn_f16x2(add_rn_f16x2(lo0, _NEG1032), a[0], h0)
        h1 = fma_rn_f16x2(fma_rn_f16x2(hi0, _SIXTEENTH, _NEG72), a[1], h1)
        h0 = fma_rn_f16x2(add_rn_f16x2(lo1, _NEG1032), a[2], h0)
        h1 = fma_rn_f16x2(fma_rn_f16x2(hi1, _SIXTEENTH, _NEG72), a[3], h1)
        return h0, h1

    def load_act(abase, u):
        # the activations of one chunk: word t's 8 fp16 are unit u + t*KS (16 bytes each).
        # abase is the staged array's 32-bit shared address, so the offsets stay 32-bit and
        # ptxas folds the constant ones into the loads (LDS.128 R, [R+imm]); with &act[idx]
        # each load paid a 64-bit add (down: 380 -> 333 instructions a step, -0.048 ms a token)
        a = abase + uint32(u) * uint32(16)
        return (ld_shared_v4_u32_at(a), ld_shared_v4_u32_at(a + uint32(KS * 16)),
                ld_shared_v4_u32_at(a + uint32(2 * KS * 16)),
                ld_shared_v4_u32_at(a + uint32(3 * KS * 16)))

    def to_f32(h0, h1):
        if SPAN32:  # 16 products per fp16 lane: h0 + h1 <= 16*1792 cannot overflow
            lo, hi = unpack_f16x2_to_f32(add_rn_f16x2(h0, h1))
            return lo + hi
        a, b = unpack_f16x2_to_f32(h0)  # 32 products each: add in fp32
        c, d = unpack_f16x2_to_f32(h1)
        return (a + b) + (c + d)

    def chunk(q0, q1, q2, q3, a, st):
        # one 16-byte chunk (32 weights) of one row; st = (h0, h1, p): fp16x2 partials, fp32 sum
        h0, h1, p = st
        h0, h1 = dot8(q0, a[0], h0, h1)
        h0, h1 = dot8(q1, a[1], h0, h1)
        h0, h1 = dot8(q2, a[2], h0, h1)
        h0, h1 = dot8(q3, a[3], h0, h1)
        if SPAN32:
            return ZERO, ZERO, p + to_f32(h0, h1)
        return h0, h1, p

    def scaled(st, sbits, fi):
        # a row's group sum in fp32, times its weight scale and the activations' 1/f_g
        h0, h1, p = st
        if not SPAN32:
            p = to_f32(h0, h1)
        return p * (cvt_f32_f16(sbits) * fi)

    def rows_chunk(c0, c1, c2, c3, a, sts):
        # chunk words c_m (4-tuples) of the thread's rows against one chunk of activations a
        s0, s1, s2, s3 = sts
        s0 = chunk(c0[0], c0[1], c0[2], c0[3], a, s0)
        if RLW >= 2:
            s1 = chunk(c1[0], c1[1], c1[2], c1[3], a, s1)
        if RLW >= 3:
            s2 = chunk(c2[0], c2[1], c2[2], c2[3], a, s2)
        if RLW >= 4:
            s3 = chunk(c3[0], c3[1], c3[2], c3[3], a, s3)
        return s0, s1, s2, s3

    def dot_step(cur, abase, u, fi):
        """The thread's RLW rows times one group of activations (chunk-major: each chunk's
        activations are read from shared once and used by every row).  Written out, not
        looped: tuple elements need literal indices to stay in registers."""
        r0, r1, r2, r3 = cur
        z = (ZERO, ZERO, float32(0.0))
        sts = (z, z, z, z)
        sts = rows_chunk(r0[0:4], r1[0:4], r2[0:4], r3[0:4], load_act(abase, u), sts)
        sts = rows_chunk(r0[4:8], r1[4:8], r2[4:8], r3[4:8], load_act(abase, u + 4 * KS), sts)
        sts = rows_chunk(r0[8:12], r1[8:12], r2[8:12], r3[8:12], load_act(abase, u + 8 * KS), sts)
        sts = rows_chunk(r0[12:16], r1[12:16], r2[12:16], r3[12:16],
                         load_act(abase, u + 12 * KS), sts)
        s0, s1, s2, s3 = sts
        return (scaled(s0, r0[16], fi), scaled(s1, r1[16], fi),
                scaled(s2, r2[16], fi), scaled(s3, r3[16], fi))

    def weight_row(row0, m):
        # weight row of a thread's m-th row slot: gate_up stacks [gate; up], up rows at +n_out;
        # qkv_rope: row0 = 2p for RoPE pair p, rows i and i + D/2 of head p // (D/2), i = p % (D/2)
        # (row0 < n_out iff the pair exists, so the bounds checks of the row slots stand)
        if NMAT == 2:
            return row0 + (m % RL) + (m // RL) * n_out
        if ROPE:
            p = row0 >> 1
            return (p // HALF) * D + p % HALF + m * HALF
        return row0 + m

    def load_step(qw, sc, row0, s, j):
        r0 = load_row(qw, sc, weight_row(row0, 0), row0 < n_out, s, j)
        r1 = r0
        r2 = r0
        r3 = r0
        if RLW >= 2:
            r1 = load_row(qw, sc, weight_row(row0, 1), row0 + (1 % RL) < n_out, s, j)
        if RLW >= 3:
            r2 = load_row(qw, sc, weight_row(row0, 2), row0 + (2 % RL) < n_out, s, j)
        if RLW >= 4:
            r3 = load_row(qw, sc, weight_row(row0, 3), row0 + (3 % RL) < n_out, s, j)
        return r0, r1, r2, r3


    def piece_load(xin, norm_w, g, lane):
        # a lane's 4 inputs of group g (clamped into range: a spare load beats a branch)
        base = min(g, G - 1) * GROUP_SIZE + lane * 4
        if NORM:
            x0, x1, x2, x3 = ld_global_nc_v4_f32(xin, base)
            w01, w23 = ld_global_nc_v2_u32(norm_w, base)
            return x0, x1, x2, x3, w01, w23
        a01, a23 = ld_global_nc_v2_u32(xin, base)
        z = float32(0.0)
        return z, z, z, z, a01, a23

    def piece_put(pc, g, lane, act, invf):
        # scale group g by its power of two, store it permuted; returns the lane's sum of x^2
        x0, x1, x2, x3, w01, w23 = pc
        n0, n1 = unpack_f16x2_to_f32(w01)
        n2, n3 = unpack_f16x2_to_f32(w23)
        ss = float32(0.0)
        if NORM:
            ss = x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3
            p0, p1, p2, p3 = x0 * n0, x1 * n1, x2 * n2, x3 * n3
        else:
            p0, p1, p2, p3 = n0, n1, n2, n3
        m = wmax(max(max(abs(p0), abs(p1)), max(abs(p2), abs(p3))))
        f, fi = pow2_scale(m)
        if g >= G:
            return float32(0.0)
        s = g // KS
        u = ((s * 4 + (lane >> 3)) * 4 + ((lane >> 1) & 3)) * KS + (g - s * KS)
        w = u * 4 + (lane & 1) * 2
        act[w] = pack_f16x2_from_f32(p0 * f, p1 * f)
        act[w + 1] = pack_f16x2_from_f32(p2 * f, p3 * f)
        if lane == 0:
            invf[g] = fi
        return ss

    def stage(xin, norm_w, act, invf, red):
        """Stage the activations (fp16, pre-scaled by f_g, permuted to the lane order); rstd.

        A warp owns groups warp, warp + WARPS, ...; it issues the loads of UG groups before
        using any (one group per iteration made the prologue a chain of L2 latencies:
        ~0.4 us each, 19 of them for down_proj, measured as 2.5x its streaming time)."""
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        ss = float32(0.0)
        for it in range(STAGE_ITERS):
            g0 = it * UG * WARPS + warp
            c0 = piece_load(xin, norm_w, g0, lane)
            c1 = piece_load(xin, norm_w, g0 + WARPS, lane)
            c2 = piece_load(xin, norm_w, g0 + 2 * WARPS, lane)
            c3 = piece_load(xin, norm_w, g0 + 3 * WARPS, lane)
            c4 = c5 = c6 = c7 = c0
            if UG == 8:
                c4 = piece_load(xin, norm_w, g0 + 4 * WARPS, lane)
                c5 = piece_load(xin, norm_w, g0 + 5 * WARPS, lane)
                c6 = piece_load(xin, norm_w, g0 + 6 * WARPS, lane)
                c7 = piece_load(xin, norm_w, g0 + 7 * WARPS, lane)
            ss += piece_put(c0, g0, lane, act, invf)
            ss += piece_put(c1, g0 + WARPS, lane, act, invf)
            ss += piece_put(c2, g0 + 2 * WARPS, lane, act, invf)
            ss += piece_put(c3, g0 + 3 * WARPS, lane, act, invf)
            if UG == 8:
                ss += piece_put(c4, g0 + 4 * WARPS, lane, act, invf)
                ss += piece_put(c5, g0 + 5 * WARPS, lane, act, invf)
                ss += piece_put(c6, g0 + 6 * WARPS, lane, act, invf)
                ss += piece_put(c7, g0 + 7 * WARPS, lane, act, invf)
        rstd = float32(1.0)
        if NORM:
            ss = wsum(ss)
            if lane == 0:
                red[warp] = ss
        if BK:
            # the bulk kernel's __syncthreads is its own, outside the role branches (the
            # producer warp must reach it too); bk_rstd finishes rstd after it
            return rstd
        cuda.syncthreads()
        if NORM:
            rstd = rstd_of(red, WARPS, INV_K, EPS)
        return rstd

    def seg_sum(v):
        # butterfly over the P lanes of a segment (P divides 32: lanes never leave it)
        off = P >> 1
        while off > 0:
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, off)
            off >>= 1
        return v

    def mainloop(qw, sc, act, invf, row0, j, cur, nxt):
        """fp32 dot products of the thread's RLW weight rows over its groups, lane-partial.
        cur: step 0's loads; nxt: step 1's when PF2 (issued before the prologue too)."""
        abase = cvta_to_shared_u32(act)
        acc0 = float32(0.0)
        acc1 = float32(0.0)
        acc2 = float32(0.0)
        acc3 = float32(0.0)
        nxt2 = nxt
        for s in range(S):
            if PF2:
                if s + 2 < S:
                    nxt2 = load_step(qw, sc, row0, s + 2, j)
            elif PREFETCH and s + 1 < S:
                nxt = load_step(qw, sc, row0, s + 1, j)
            g = s * KS + j
            if g < G and j < KS:
                d0, d1, d2, d3 = dot_step(cur, abase, s * 16 * KS + j, invf[g])
                acc0 += d0
                acc1 += d1
                acc2 += d2
                acc3 += d3
            if s + 1 < S:
                if PF2:
                    cur = nxt
                    nxt = nxt2
                elif PREFETCH:
                    cur = nxt
                else:
                    cur = load_step(qw, sc, row0, s + 1, j)
        return seg_sum(acc0), seg_sum(acc1), seg_sum(acc2), seg_sum(acc3)

    pow2_scale, wsum, wmax, rstd_of = (dev(f) for f in (pow2_scale_f32, warp_sum, warp_max,
                                                         block_rstd))
    load_row, dot8, load_act, to_f32, chunk, scaled, rows_chunk, dot_step, weight_row, \
        load_step, pow2_scale, piece_load, piece_put, stage, seg_sum, mainloop = (
            dev(f) for f in (load_row, dot8, load_act, to_f32, chunk, scaled, rows_chunk, dot_step,
                             weight_row, load_step, pow2_scale, piece_load, piece_put, stage,
                             seg_sum, mainloop))

    def early(qw, row0, j):
        """Programmatic dependent launch (nq/ptx/griddep.py): what a block may do before the
        kernel before it has finished -- ask L2 for the first l2_steps steps of its weight rows
        (one bulk prefetch per row, by lane 0 of the row's segment) -- then wait for it.  The
        caller has already issued its step-0 weight loads, which depend on nothing either."""
        if PF_BYTES > 0 and j == 0:
            for m in range(RLW):
                if row0 + (m % RL) < n_out:
                    cp_async_bulk_prefetch_l2(qw, (weight_row(row0, m), 0), PF_BYTES)
        griddepcontrol_wait()
        griddepcontrol_launch_dependents()

    if BM:
        def early(qw, row0, j):  # noqa: F811 -- no row prefixes in the flat layout: no L2 prefetch
            griddepcontrol_wait()
            griddepcontrol_launch_dependents()

    # ---- bulk (Tiling.bulk): a producer warp streams each (block, step) run into a ring ----
    # Barriers: full[i] at bar0 + 8i (count 1: the producer's arrive.expect_tx, then the copy's
    # complete_tx), empty[i] at bar0 + 8(NB + i) (count TPB: every consumer thread, every step).

    def bk_copy(qw, ring0, bar0, s):
        # step s's run of this block (block_major_rows: rows r0..r0+rbe-1, gs*16 words each)
        # into stage s % NB; the full barrier's phase completes when its bytes have landed
        b = cuda.blockIdx.x
        rbe = min(RB, n_out - b * RB)
        gs = KS if s < S - 1 else GL
        nbytes = rbe * gs * 64
        st = s % NB
        mbarrier_arrive_expect_tx(bar0 + 8 * st, nbytes)
        cp_async_bulk_g2s(ring0 + st * (SW * 4), qw, b * (RB * K8) + s * (rbe * KS * 16), nbytes,
                          bar0 + 8 * st)

    def bk_init(bar0):
        # attn_mma's protocol: one thread arms the barriers, fence.mbarrier_init, then the
        # kernel's first __syncthreads (at block entry) before anyone uses them
        if cuda.threadIdx.x == TPB:
            for i in range(NB):
                mbarrier_init(bar0 + 8 * i, 1)
                mbarrier_init(bar0 + 8 * (NB + i), TPB)
            fence_mbarrier_init()

    def bk_produce_first(qw, ring0, bar0):
        """The producer warp before stage's __syncthreads: lane 0 issues the first NB copies
        at once (the ring is empty; weights depend on nothing upstream, so no
        griddepcontrol.wait: under PDL they overlap the kernel before)."""
        if cuda.threadIdx.x == TPB:
            for s in range(min(NB, S)):
                bk_copy(qw, ring0, bar0, s)
        # the producer writes no global memory: it may let the next kernel launch at once
        griddepcontrol_launch_dependents()

    def bk_produce_rest(qw, ring0, bar0):
        # step s reuses the stage of step s - NB once every consumer thread has released it
        # (phase (s // NB) - 1 of its empty barrier: parity ((s // NB) & 1) ^ 1)
        if cuda.threadIdx.x == TPB:
            for s in range(NB, S):
                mbarrier_wait_parity(bar0 + 8 * (NB + s % NB), ((s // NB) & 1) ^ 1)
                bk_copy(qw, ring0, bar0, s)

    def bk_scales(sc, row0, s, j):
        # the scale bits of the thread's rows at step s (2-byte global loads, a step ahead)
        gs = KS if s < S - 1 else GL
        s0 = ZERO
        s1 = ZERO
        s2 = ZERO
        s3 = ZERO
        if j < gs:
            g = s * KS + j
            if row0 < n_out:
                s0 = uint32(ld_global_nc_u16(sc, (row0, g)))
            if RL >= 2 and row0 + 1 < n_out:
                s1 = uint32(ld_global_nc_u16(sc, (row0 + 1, g)))
            if RL >= 3 and row0 + 2 < n_out:
                s2 = uint32(ld_global_nc_u16(sc, (row0 + 2, g)))
            if RL >= 4 and row0 + 3 < n_out:
                s3 = uint32(ld_global_nc_u16(sc, (row0 + 3, g)))
        return s0, s1, s2, s3

    def bk_row(ring, base, row, ok, s, j, sb):
        # load_row's 16 words from the stage (word base): the BM address less the run's start
        gs = KS if s < S - 1 else GL
        if ok and j < gs:
            c = base + (row % RB) * (gs * 16) + j * 4
            a0, a1, a2, a3 = ld_shared_v4_u32(ring, c)
            b0, b1, b2, b3 = ld_shared_v4_u32(ring, c + gs * 4)
            c0, c1, c2, c3 = ld_shared_v4_u32(ring, c + gs * 8)
            d0, d1, d2, d3 = ld_shared_v4_u32(ring, c + gs * 12)
            return (a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, sb)
        return (ZERO, ZERO, ZERO, ZERO, ZERO, ZERO, ZERO, ZERO,
                ZERO, ZERO, ZERO, ZERO, ZERO, ZERO, ZERO, ZERO, ZERO)

    def bk_step(ring, base, row0, s, j, sbs):
        s0, s1, s2, s3 = sbs
        r0 = bk_row(ring, base, row0, row0 < n_out, s, j, s0)
        r1 = r0
        r2 = r0
        r3 = r0
        if RL >= 2:
            r1 = bk_row(ring, base, row0 + 1, row0 + 1 < n_out, s, j, s1)
        if RL >= 3:
            r2 = bk_row(ring, base, row0 + 2, row0 + 2 < n_out, s, j, s2)
        if RL >= 4:
            r3 = bk_row(ring, base, row0 + 3, row0 + 3 < n_out, s, j, s3)
        return r0, r1, r2, r3

    def bk_mainloop(ring, w0, bar0, sc, act, invf, row0, j, sbs):
        """mainloop with the step's words from the ring: the same dot_step on the same words,
        so the same bits.  Every consumer thread (rowless and idle lanes too) waits on full
        and arrives on empty each step: the empty count is TPB, and a thread that skipped the
        wait could arrive twice in one phase."""
        abase = cvta_to_shared_u32(act)
        acc0 = float32(0.0)
        acc1 = float32(0.0)
        acc2 = float32(0.0)
        acc3 = float32(0.0)
        for s in range(S):
            nsb = sbs
            if s + 1 < S:
                nsb = bk_scales(sc, row0, s + 1, j)
            st = s % NB
            mbarrier_wait_parity(bar0 + 8 * st, (s // NB) & 1)
            cur = bk_step(ring, w0 + st * SW, row0, s, j, sbs)
            g = s * KS + j
            if g < G and j < KS:
                d0, d1, d2, d3 = dot_step(cur, abase, s * 16 * KS + j, invf[g])
                acc0 += d0
                acc1 += d1
                acc2 += d2
                acc3 += d3
            # release the stage (arrive has release semantics: the ld.shared above come first)
            mbarrier_arrive(bar0 + 8 * (NB + st))
            sbs = nsb
        return seg_sum(acc0), seg_sum(acc1), seg_sum(acc2), seg_sum(acc3)

    def bk_enter(bars, ring):
        """Block entry, every thread: the barriers' and the 128-byte aligned ring's shared
        addresses, the barriers armed (bk_init) and published by the first __syncthreads.
        Returns (bar0, the ring's byte address, the same place as a word index of `ring`)."""
        bar0 = cvta_to_shared_u32_at(bars, 0)
        sm0 = cvta_to_shared_u32_at(ring, 0)
        skip = (RING_ALIGN - sm0 % RING_ALIGN) % RING_ALIGN
        bk_init(bar0)
        cuda.syncthreads()
        return bar0, sm0 + skip, skip // 4

    def bk_rstd(red):
        # stage's RMSNorm tail, after the kernel's __syncthreads (same sum, same order)
        rstd = float32(1.0)
        if NORM:
            rstd = rstd_of(red, WARPS, INV_K, EPS)
        return rstd

    if BK:  # compiled only when used (numba numbers every function it compiles: the default
        #     kernels' names and PTX stay as they were)
        bk_copy, bk_init, bk_produce_first, bk_produce_rest, bk_scales, bk_row, bk_step, \
            bk_mainloop, bk_rstd, bk_enter = (
                dev(f) for f in (bk_copy, bk_init, bk_produce_first, bk_produce_rest, bk_scales,
                                 bk_row, bk_step, bk_mainloop, bk_rstd, bk_enter))

    def start(qw, sc):
        tid = cuda.threadIdx.x
        j = tid % P
        row0 = (cuda.blockIdx.x * SEGS + tid // P) * RL
        return row0, j

    def put_qkv(out, bias, row, v):
        if row < n_out:
            out[row] = v + cvt_f32_f16(ld_global_nc_u16(bias, row))

    def put_swiglu(out, row, gt, up):
        if row < n_out:
            y = gt / (float32(1.0) + math.exp(-gt)) * up
            st_global_u16(out, row, cvt_rn_f16_f32(y))

    def put_residual(x, row, v):
        if row < n_out:
            x[row] += v

    def put_rope(bias, kv, q_out, row0, v0, v1, pos, page, fr):
        """rope_kv's job for RoPE pair row0 // 2, from the fp32 dot products v0, v1 of its rows
        (times rstd).  Its inputs y0, y1 are qkv's outputs bit for bit; its arithmetic is
        rope_kv's as compiled: rope_kv writes x1*c - x2*s and x2*c + x1*s, which the compilers
        contract (LLVM, then ptxas: sm_90 SASS, CUDA 13) into fma(x1, c, -(x2*s)) and
        fma(x1, s, x2*c).  Left to contraction here the second came out fma(y1, c, y0*s) (a
        different rounding), so both are spelled out: no mul-add pair is left to contract."""
        if row0 < n_out:
            r0 = weight_row(row0, 0)
            y0 = float32(v0 + cvt_f32_f16(ld_global_nc_u16(bias, r0)))   # = put_qkv's out[r0]
            y1 = float32(v1 + cvt_f32_f16(ld_global_nc_u16(bias, r0 + HALF)))
            p = row0 >> 1
            b = p // HALF   # head: [q heads | k heads | v heads]
            i = p % HALF
            slot = pos % PAGE
            if b < HQ + HKV:
                ang = float32(pos) * fr
                c = math.cos(ang)
                s = math.sin(ang)
                z0 = cuda.fma(y0, c, -(y1 * s))
                z1 = cuda.fma(y0, s, y1 * c)
                if b < HQ:
                    q_out[b * D + i] = z0
                    q_out[b * D + i + HALF] = z1
                else:
                    kv[page, b - HQ, 0, slot, i] = float16(z0)
                    kv[page, b - HQ, 0, slot, i + HALF] = float16(z1)
            else:
                kv[page, b - HQ - HKV, 1, slot, i] = float16(y0)
                kv[page, b - HQ - HKV, 1, slot, i + HALF] = float16(y1)

    early, start, put_qkv, put_swiglu, put_residual, put_rope = (
        dev(f) for f in (early, start, put_qkv, put_swiglu, put_residual, put_rope))

    if kind == "qkv":
        def kernel(x, norm_w, qw, sc, bias, out):
            act = cuda.shared.array(UWORDS, uint32, alignment=_ALIGN)
            invf = cuda.shared.array(G, float32)
            red = cuda.shared.array(WARPS, float32)
            row0, j = start(qw, sc)
            cur = load_step(qw, sc, row0, 0, j)
            nxt = load_step(qw, sc, row0, 1, j) if PF2 else cur
            early(qw, row0, j)
            rstd = stage(x, norm_w, act, invf, red)
            acc = mainloop(qw, sc, act, invf, row0, j, cur, nxt)
            if j == 0:
                a0, a1, a2, a3 = acc
                put_qkv(out, bias, row0, a0 * rstd)
                if RL >= 2:
                    put_qkv(out, bias, row0 + 1, a1 * rstd)
                if RL >= 3:
                    put_qkv(out, bias, row0 + 2, a2 * rstd)
                if RL >= 4:
                    put_qkv(out, bias, row0 + 3, a3 * rstd)
        sig = "void(float32[::1], float16[::1], uint32[:, ::1], float16[:, ::1], float16[::1], float32[::1])"
    elif kind == "qkv_rope":
        def kernel(x, norm_w, qw, sc, bias, state, inv_freq, table, kv, q_out):
            act = cuda.shared.array(UWORDS, uint32, alignment=_ALIGN)
            invf = cuda.shared.array(G, float32)
            red = cuda.shared.array(WARPS, float32)
            row0, j = start(qw, sc)
            cur = load_step(qw, sc, row0, 0, j)
            nxt = load_step(qw, sc, row0, 1, j) if PF2 else cur
            early(qw, row0, j)
            # After the wait (the previous step's argmax advanced the position): the position
            # and the pair's frequency now, its page after the prologue, so that the epilogue
            # does not begin with two dependent round trips to L2 (3 registers meanwhile).
            pos = state[STATE_POS]
            fr = inv_freq[(row0 >> 1) % HALF]
            rstd = stage(x, norm_w, act, invf, red)
            page = table[pos // PAGE]
            acc = mainloop(qw, sc, act, invf, row0, j, cur, nxt)
            if j == 0:
                a0, a1, a2, a3 = acc
                put_rope(bias, kv, q_out, row0, a0 * rstd, a1 * rstd, pos, page, fr)
        sig = ("void(float32[::1], float16[::1], uint32[:, ::1], float16[:, ::1], float16[::1], "
               "int32[::1], float32[::1], int32[::1], float16[:, :, :, :, ::1], float32[::1])")
    elif kind == "gate_up":
        def kernel(x, norm_w, qw, sc, out):
            act = cuda.shared.array(UWORDS, uint32, alignment=_ALIGN)
            invf = cuda.shared.array(G, float32)
            red = cuda.shared.array(WARPS, float32)
            row0, j = start(qw, sc)
            cur = load_step(qw, sc, row0, 0, j)
            nxt = load_step(qw, sc, row0, 1, j) if PF2 else cur
            early(qw, row0, j)
            rstd = stage(x, norm_w, act, invf, red)
            acc = mainloop(qw, sc, act, invf, row0, j, cur, nxt)
            if j == 0:
                a0, a1, a2, a3 = acc
                if RL == 1:
                    put_swiglu(out, row0, a0 * rstd, a1 * rstd)
                else:  # RL == 2: rows (g0, g1, u0, u1)
                    put_swiglu(out, row0, a0 * rstd, a2 * rstd)
                    put_swiglu(out, row0 + 1, a1 * rstd, a3 * rstd)
        sig = "void(float32[::1], float16[::1], uint32[:, ::1], float16[:, ::1], float16[::1])"
    else:
        def kernel(a, qw, sc, x):
            act = cuda.shared.array(UWORDS, uint32, alignment=_ALIGN)
            invf = cuda.shared.array(G, float32)
            red = cuda.shared.array(WARPS, float32)
            row0, j = start(qw, sc)
            cur = load_step(qw, sc, row0, 0, j)
            nxt = load_step(qw, sc, row0, 1, j) if PF2 else cur
            early(qw, row0, j)
            stage(a, a, act, invf, red)
            acc = mainloop(qw, sc, act, invf, row0, j, cur, nxt)
            if j == 0:
                a0, a1, a2, a3 = acc
                put_residual(x, row0, a0)
                if RL >= 2:
                    put_residual(x, row0 + 1, a1)
                if RL >= 3:
                    put_residual(x, row0 + 2, a2)
                if RL >= 4:
                    put_residual(x, row0 + 3, a3)
        sig = "void(float16[::1], uint32[:, ::1], float16[:, ::1], float32[::1])"

    if BK:
        # Roles: threads 0..TPB-1 are the consumers (the tiling's segments and rows, as
        # without bulk), warp TPB/32 the producer.  Both __syncthreads (after the barrier
        # init, and stage's) are here, outside the role branches.
        def bk_prologue(src, norm_w, qw, sc, act, invf, red, bars, ring):
            # the barriers and the ring; the consumers' first scales, early loads and staging
            # of src (x and norm_w, or a); the producer's first copies; the __syncthreads
            tid = cuda.threadIdx.x
            bar0, ring0, rw = bk_enter(bars, ring)
            row0, j = start(qw, sc)
            sbs = (ZERO, ZERO, ZERO, ZERO)
            if tid < TPB:
                sbs = bk_scales(sc, row0, 0, j)
                early(qw, row0, j)
                stage(src, norm_w, act, invf, red)
            else:
                bk_produce_first(qw, ring0, bar0)
            cuda.syncthreads()
            return tid, bar0, ring0, rw, row0, j, sbs

        bk_prologue = dev(bk_prologue)

        if kind == "qkv":
            def kernel(x, norm_w, qw, sc, bias, out):
                act = cuda.shared.array(UWORDS, uint32, alignment=_ALIGN)
                invf = cuda.shared.array(G, float32)
                red = cuda.shared.array(WARPS, float32)
                bars = cuda.shared.array(NBARS, uint64)
                ring = cuda.shared.array(0, uint32)
                tid, bar0, ring0, rw, row0, j, sbs = bk_prologue(x, norm_w, qw, sc, act, invf,
                                                                 red, bars, ring)
                if tid < TPB:
                    rstd = bk_rstd(red)
                    acc = bk_mainloop(ring, rw, bar0, sc, act, invf, row0, j, sbs)
                    if j == 0:
                        a0, a1, a2, a3 = acc
                        put_qkv(out, bias, row0, a0 * rstd)
                        if RL >= 2:
                            put_qkv(out, bias, row0 + 1, a1 * rstd)
                        if RL >= 3:
                            put_qkv(out, bias, row0 + 2, a2 * rstd)
                        if RL >= 4:
                            put_qkv(out, bias, row0 + 3, a3 * rstd)
                else:
                    bk_produce_rest(qw, ring0, bar0)
        else:
            def kernel(a, qw, sc, x):
                act = cuda.shared.array(UWORDS, uint32, alignment=_ALIGN)
                invf = cuda.shared.array(G, float32)
                red = cuda.shared.array(WARPS, float32)
                bars = cuda.shared.array(NBARS, uint64)
                ring = cuda.shared.array(0, uint32)
                tid, bar0, ring0, rw, row0, j, sbs = bk_prologue(a, a, qw, sc, act, invf, red,
                                                                 bars, ring)
                if tid < TPB:
                    acc = bk_mainloop(ring, rw, bar0, sc, act, invf, row0, j, sbs)
                    if j == 0:
                        a0, a1, a2, a3 = acc
                        put_residual(x, row0, a0)
                        if RL >= 2:
                            put_residual(x, row0 + 1, a1)
                        if RL >= 3:
                            put_residual(x, row0 + 2, a2)
                        if RL >= 4:
                            put_residual(x, row0 + 3, a3)
                else:
                    bk_produce_rest(qw, ring0, bar0)

    if BM:  # the flat block-major weights
        sig = sig.replace("uint32[:, ::1]", "uint32[::1]")
    kernel.__name__ = kernel.__qualname__ = kernel_name(kind, n_out, k, t, heads)
    return kernel, sig


def compile_kernel(kind: str, n_out: int, k: int, t: Tiling, eps: float = 1e-6, heads=None):
    """The compiled dispatcher (on the GPU) or the simulator kernel, cached by its name."""
    return _compiled(kind, n_out, k, t, float(eps), None if heads is None else tuple(heads))


@functools.lru_cache(maxsize=None)
def _compiled(kind, n_out, k, t, eps, heads):
    pyfunc, sig = build_kernel(kind, n_out, k, t, eps, heads)
    if SIMULATOR:
        return cuda.jit(pyfunc)
    bounds = (t.block, t.min_blocks) if t.min_blocks else (t.block,)
    return cuda.jit(sig, launch_bounds=bounds)(pyfunc)


def ring_bytes(t: Tiling, k: int) -> int:
    """Dynamic shared memory a bulk kernel is launched with: `bulk` stages of the largest
    (block, step) run (rows_per_block x ks groups x 64 bytes) plus alignment slack."""
    return t.bulk * t.rows_per_block() * t.ks * 16 * 4 + RING_ALIGN


# ---- launchers -------------------------------------------------------------------------------

def _addr(a) -> int:
    cai = getattr(a, "__cuda_array_interface__", None)
    return cai["data"][0] if cai else np.asarray(getattr(a, "_ary", a)).ctypes.data


def _need(a, what, dtype, shape, align=16):
    if a.dtype != np.dtype(dtype) or tuple(a.shape) != tuple(shape):
        raise ValueError(f"{what}: expected {np.dtype(dtype)} {tuple(shape)}, got {a.dtype} {tuple(a.shape)}")
    contig = a.is_c_contiguous() if hasattr(a, "is_c_contiguous") else a.flags.c_contiguous
    if not contig:
        raise ValueError(f"{what}: must be C-contiguous")
    if _addr(a) % align:
        raise ValueError(f"{what}: device address must be {align}-byte aligned")


class _Gemv:
    """One compiled GEMV: its shape, tiling, launch grid, weight preparation and arg checks."""

    kind = ""
    heads = None  # qkv_rope: (num_heads, num_kv_heads, head_dim)

    def __init__(self, cfg: ModelConfig, n_out: int, k: int, n_rows: int,
                 tiling: Tiling | None = None):
        if k % GROUP_SIZE or n_out % 8:
            raise ValueError(f"{self.kind}: N={n_out}, K={k}; K must be a multiple of "
                             f"{GROUP_SIZE} and N of 8")
        self.n_out, self.k, self.n_rows = n_out, k, n_rows  # n_rows: weight rows (gate_up: 2N)
        self.tiling = tiling or default_tiling(self.kind, n_out, k, mma=False)
        if self.tiling.mma:
            raise ValueError(f"{self.kind}: tiling {self.tiling.tag()} is a tensor-core tiling; "
                             f"build it with make_{self.kind}_gemv (nq/kernels/int4/gemv_mma.py)")
        self.eps = float(cfg.rms_norm_eps)
        self.kernel = compile_kernel(self.kind, n_out, k, self.tiling, self.eps, self.heads)
        t = self.tiling
        rows_per_block = (t.threads // t.lanes) * t.rows
        self.grid = -(-n_out // rows_per_block)
        self.name = kernel_name(self.kind, n_out, k, t, self.heads)
        # launch: the consumers plus, with bulk, the producer warp and the weight ring
        # (dynamic shared memory, over 48 KB with the staged activations: opted in)
        self.block = t.block
        self.smem = ring_bytes(t, k) if t.bulk else 0
        if self.smem and not SIMULATOR:
            from nq.kernels.attention.combine import _allow_smem
            _allow_smem(self.kernel, self.smem)

    def prepare(self, parts):
        """[(qweight, scales), ...] host arrays in file layout -> (qweight, scales) to upload."""
        ks, rows_per_block = self.tiling.layout()
        qw, sc = prepare_weights(parts, ks)
        if rows_per_block:
            qw = block_major_rows(qw, ks, rows_per_block)
        if qw.shape[0] != self.n_rows or qw.shape[1] * 8 != self.k:
            raise ValueError(f"{self.name}: prepared weights are {qw.shape}, expected "
                             f"({self.n_rows}, {self.k // 8})")
        return qw, sc

    def _check_weights(self, qw, sc):
        """Check the prepared weights; returns qw as the kernel takes it (block_major: flat)."""
        _need(qw, f"{self.name} qweight", np.uint32, (self.n_rows, self.k // 8))
        _need(sc, f"{self.name} scales", np.float16, (self.n_rows, self.k // GROUP_SIZE), 2)
        return qw.reshape(qw.size) if self.tiling.block_major else qw


class QkvGemv(_Gemv):
    kind = "qkv"

    def __call__(self, x, norm_w, qw, sc, bias, out, stream=0):
        """out fp32 (N,) = Wqkv . rmsnorm(x, norm_w) + bias; x fp32 (K,), norm_w/bias fp16."""
        qw = self._check_weights(qw, sc)
        _need(x, f"{self.name} x", np.float32, (self.k,))
        _need(norm_w, f"{self.name} norm_w", np.float16, (self.k,), 8)
        _need(bias, f"{self.name} bias", np.float16, (self.n_out,), 2)
        _need(out, f"{self.name} out", np.float32, (self.n_out,), 4)
        self.kernel[self.grid, self.block, stream, self.smem](x, norm_w, qw, sc, bias, out)


class QkvRopeGemv(_Gemv):
    """qkv's GEMV with rope_kv's job as its epilogue; reads qkv's prepared weights as they are
    (the same `prepare`, and the default tiling keeps qkv's ks)."""

    kind = "qkv_rope"

    def __init__(self, cfg: ModelConfig, tiling: Tiling | None = None):
        self.cfg = cfg   # build_kernel refuses what the RoPE epilogue cannot do (odd head_dim)
        self.heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        super().__init__(cfg, cfg.qkv_size, cfg.hidden_size, cfg.qkv_size, tiling)

    def __call__(self, x, norm_w, qw, sc, bias, state, inv_freq, table, kv_layer, q_out,
                 stream=0):
        """q_out fp32 (Hq*D,) = rope(q), kv_layer[table[pos//16], :, 0/1, pos%16] = fp16 rope(k)
        / v, pos = state[STATE_POS], where [q|k|v] = Wqkv . rmsnorm(x, norm_w) + bias (fp32).
        x fp32 (K,), norm_w/bias fp16, inv_freq fp32 (D/2,) (rope_kv.rope_inv_freq), state and
        table int32, kv_layer (n_pages, Hkv, 2, 16, D) fp16 (nq/runtime/kv_cache.py)."""
        hq, _, d = self.heads
        qw = self._check_weights(qw, sc)
        _need(x, f"{self.name} x", np.float32, (self.k,))
        _need(norm_w, f"{self.name} norm_w", np.float16, (self.k,), 8)
        _need(bias, f"{self.name} bias", np.float16, (self.n_out,), 2)
        _need(state, f"{self.name} state", np.int32, (STATE_LEN,), 4)
        _need(inv_freq, f"{self.name} inv_freq", np.float32, (d // 2,), 4)
        _need(q_out, f"{self.name} q_out", np.float32, (hq * d,), 4)
        check_paged_args(self.name, self.cfg, kv_layer, table, state)
        if len(table.shape) != 1:
            raise ValueError(f"{self.name}: table must be 1-D (max_pages,), got {tuple(table.shape)}")
        self.kernel[self.grid, self.block, stream, self.smem](x, norm_w, qw, sc, bias, state,
                                                              inv_freq, table, kv_layer, q_out)


class GateUpGemv(_Gemv):
    kind = "gate_up"

    def __call__(self, x, norm_w, qw, sc, out, stream=0):
        """out fp16 (I,) = silu(Wg . h) * (Wu . h), h = rmsnorm(x, norm_w); qw = [gate; up]."""
        qw = self._check_weights(qw, sc)
        _need(x, f"{self.name} x", np.float32, (self.k,))
        _need(norm_w, f"{self.name} norm_w", np.float16, (self.k,), 8)
        _need(out, f"{self.name} out", np.float16, (self.n_out,), 2)
        self.kernel[self.grid, self.block, stream, self.smem](x, norm_w, qw, sc, out)


class ResidualGemv(_Gemv):
    """o_proj and down: x fp32 (N,) += W . a, a fp16 (K,); each x element has one writer."""

    def __init__(self, kind, *args, **kw):
        self.kind = kind
        super().__init__(*args, **kw)

    def __call__(self, a, qw, sc, x, stream=0):
        qw = self._check_weights(qw, sc)
        _need(a, f"{self.name} a", np.float16, (self.k,), 8)
        _need(x, f"{self.name} x", np.float32, (self.n_out,), 4)
        self.kernel[self.grid, self.block, stream, self.smem](a, qw, sc, x)


def make_qkv_gemv(cfg: ModelConfig, tiling: Tiling | None = None) -> QkvGemv:
    """qkv: prepare([(q_qw, q_sc), (k_qw, k_sc), (v_qw, v_sc)]); bias = concat(bq, bk, bv)."""
    return QkvGemv(cfg, cfg.qkv_size, cfg.hidden_size, cfg.qkv_size, tiling)


def make_qkv_rope_gemv(cfg: ModelConfig, tiling: Tiling | None = None) -> QkvRopeGemv:
    """qkv_rope: prepare as qkv's (the same uploaded weights serve both); call (x, norm_w, qw,
    sc, bias, state, inv_freq, table, kv_layer, q_out, stream)."""
    return QkvRopeGemv(cfg, tiling)


def make_o_proj_gemv(cfg: ModelConfig, tiling: Tiling | None = None) -> ResidualGemv:
    """o_proj: prepare([(o_qw, o_sc)]); call (attn_out fp16, qw, sc, x, stream)."""
    tiling = tiling or default_tiling("o_proj", cfg.hidden_size, cfg.q_size)
    if tiling.mma:
        from nq.kernels.int4.gemv_mma import ResidualMmaGemv
        return ResidualMmaGemv("o_proj", cfg, cfg.hidden_size, cfg.q_size, tiling)
    return ResidualGemv("o_proj", cfg, cfg.hidden_size, cfg.q_size, cfg.hidden_size, tiling)


def make_gate_up_gemv(cfg: ModelConfig, tiling: Tiling | None = None) -> GateUpGemv:
    """gate_up: prepare([(gate_qw, gate_sc), (up_qw, up_sc)]) -> one (2I, K/8) matrix."""
    i = cfg.intermediate_size
    if tiling is not None and tiling.mma:
        from nq.kernels.int4.gemv_mma import GateUpMmaGemv
        return GateUpMmaGemv(cfg, i, cfg.hidden_size, tiling)
    return GateUpGemv(cfg, i, cfg.hidden_size, 2 * i, tiling)


def make_down_gemv(cfg: ModelConfig, tiling: Tiling | None = None) -> ResidualGemv:
    """down: prepare([(down_qw, down_sc)]); call (swiglu_out fp16, qw, sc, x, stream)."""
    tiling = tiling or default_tiling("down", cfg.hidden_size, cfg.intermediate_size)
    if tiling.mma:
        from nq.kernels.int4.gemv_mma import ResidualMmaGemv
        return ResidualMmaGemv("down", cfg, cfg.hidden_size, cfg.intermediate_size, tiling)
    return ResidualGemv("down", cfg, cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size,
                        tiling)
