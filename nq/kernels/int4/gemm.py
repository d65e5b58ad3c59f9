"""INT4-weight x fp16-activation GEMM on the tensor cores (mma.sync), for prefill.

Prefill ran one decode step a token (955 ms for 512 tokens of the 7B).  Here each projection of
a layer is one GEMM over all M tokens: Y^T = W . X^T, W the (N, K) INT4 weights exactly as
uploaded for decode (no fp16 copy, no re-layout), X (M, K) fp16 row-major, fp32 accumulation,
the decode epilogues fused: qkv out = W.h + bias (fp32); o_proj/down x += W.a (the fp32
residual, one writer an element); gate_up out = silu(Wg.h) * (Wu.h) (fp16, W = [gate; up]);
plain out = W.x (tests).  M (1..8192) is a launch argument; a few tile configurations are
compiled once and picked per M (`DEFAULT_CONFIGS`).  The kernel is in gemm_kernel.py.

The mma.  `mma.sync.m16n8k16` with the weights as A (16 rows x 16 k) and the tokens as B (16 k
x 8 tokens): X row-major is B's "col" layout, so `ldmatrix.x4` of 16 token rows from shared
memory gives two tokens tiles' B fragments.  A warp owns ta weight tiles x tb token tiles
(ta*tb*4 fp32 accumulators a lane); a block is wn x wm x wk warps (rows, tokens, K):

    tiles    warps (n x m x k)  block tile  stages  smem    regs (rows/mma)  blocks/SM  for
    SMALL    1 x 1 x 4          32 x 16     4       96 KB   150 / 128        2          M <= 16
    MEDIUM   4 x 1 x 1          128 x 32    4       64 KB   150 / 154        3          M <= 64
    LARGE    4 x 2 x 1          128 x 128   3       120 KB  206 / 200        1          M > 64
    (warp tile 32 rows x tb*8 tokens: ta = 2 everywhere, tb = 2, 4, 8; ptxas for sm_90, 7B
    shapes, no spills, no local memory)

A k-slice is wk groups of 128 k (one scale a row a group); wk > 1 (SMALL) gives each of the
wk warps its own group of the slice and adds their sums through shared memory at the end, in
a fixed order (deterministic).  The slices stream through a `stages`-deep ring of cp.async.cg
16-byte copies (nq/ptx/async_copy.py), one barrier a slice: wait for slice s, barrier, issue
slice s + stages - 1 into the buffer slice s - 1 left, multiply slice s.  Each thread's copies
are planned once (`copy_plan`).  Shared layouts are swizzled for conflict-free reads: token
r's 16-byte chunk c of a group at chunk c ^ (r & 7) of its 256-byte row (ldmatrix's 8 rows hit
8 bank groups); an mma-layout lane's two 16-byte halves swapped when lane bit 2 is set.

The weights, per uploaded layout (`layout=` "mma" or ("rows", ks)):
  * mma fragment layout (o_proj, down; layout.mma_layout): a tile's group is 1 KB, lane l's 32
    bytes are its 8 A fragments, one word a k16 chunk; `ld.shared.v4` gives 4, and
    `dequant_word` (9 instructions) turns a word into the fragment.
  * row layout (qkv, gate_up; layout.tile_rows): a row's group is 4 pieces of 16 bytes, placed
    by chunk_permutation (`row_piece_word` finds them; the copies move them into a 64-byte row
    of the stage).  Lane (g, t) of chunk c needs pair t of words 2c, 2c+1 of rows g and g+8:
    two `ld.shared.v4` (rows g, g+8) serve two chunks, and `gather_fragment` shifts each of
    the 4 words by 4t and applies dequant's low-nibble trick: 12 instructions a fragment.
    Chosen over dequantising a tile into shared memory as fp16 and ldmatrix'ing it: each
    fragment feeds tb = 8 mmas in LARGE, so the gather's 3 extra instructions are 0.4 an mma,
    where the fp16 round trip costs a st.shared + ldmatrix a fragment, 4x the shared bytes
    and a second barrier a slice (it would dequantise once per block instead of once per
    warp row of the block: wm = 2 in LARGE, the only saving).
  (qkv's rope-ordered mma layout, ("mma_rope", D), whose output the epilogue put back in
  order, went with NQ_MMA_QKV=1: tiling.py's epitaph, code at 29184bc.)
Scales: folded into the dequantised fp16 pairs (`mul.rn.f16x2`, 4 a fragment), so the mma
accumulates across all of K.  The folded weight q*s is rounded to fp16 once: a relative error
up to 2^-11 a weight, ~2^-11/sqrt(3) ~ 3e-4 of a dot product's norm over random signs
(measured 1.3-1.8e-4 under the simulator) -- the rounding an fp16 checkpoint's weights carry.
Per-group fp32 partials scaled in fp32 (gemv_mma's way, 1e-5) would need another ta*tb*4
registers (64 in LARGE) and as many FMAs as the folding's multiplies.

Instructions (SASS, nvdisasm of the sm_90 cubin, 7B shapes), per mma:
    LARGE  mma layout 4.4 (slice: 567 for 128 HMMA a warp; the 4-chunk inner loop 214 for 64:
           64 HMMA, 16 LDSM, 2 LDS, 8 x 13 dequant+scale, ~20 addressing); row layout 5.5
           (703; inner 242); the slice's copies, scales and barrier ~140 a thread.
    MEDIUM 6.8 / 10.8, SMALL 13.8 / 22.8 (fewer mmas share each fragment and each copy).
At the mma.sync peak (~450 TFLOP/s, DEVICE.md) a sub-partition issues one m16n8k16 every ~9.5
cycles, so LARGE's 4.4-5.5 issue slots an mma leave the issue port ~50-60 % busy: the tensor
pipe, fed by 2 warps a sub-partition with 16 independent accumulators each, is the limit.
Shared memory: ~185 bytes an mma (ldmatrix 128, weights 16, the copies' writes 40) = ~80 of
128 bytes a cycle at peak.  L2 -> SM: 40 KB a slice per 1024 mma (102 FLOP a byte): 2.9 TB/s
at 300 TFLOP/s.  Predicted before measuring: LARGE ~300 TFLOP/s (2/3 of the mma.sync peak),
less where the 7B grids leave SMs idle at M = 512 (112 blocks for o_proj and down, 144 = two
waves for qkv), ~25 ms of projections for 28 layers at M = 512.

Measured (H200, scripts/bench_gemm.py, graph-timed, weights rotated past L2; TFLOP/s of the
default tiles, cuBLAS fp16 x @ w.T beside them):
             M = 16 (SMALL)   512            2048           8192
    qkv      33  (cuBLAS 59)  126 (653)      206 (744)      231 (749)
    o_proj   39  (47)         215 (629)      186 (669)      215 (756)
    gate_up  61  (59)         249 (708)      252 (756)      254 (643)
    down     59  (56)         264 (730)      264 (710)      304 (682)
    28 layers 3.77 ms (3.65)  28.5 ms (9.5)  108 ms (36)    408 ms (161)
So LARGE runs at 41-68 % of the mma.sync peak (gate_up, down 55-68), a third of cuBLAS;
M = 512 misses the 20 ms goal by 1.4x and 8K the 300 ms one likewise: the next step is wgmma
(sm_90a) with bulk copies.  Other tiles measured then: a fourth stage changes nothing (+-1 %);
128 x 64 with 4 warps, two blocks an SM (Tiles(2, 8, 4, 1, 1, 4)) wins on o_proj and down at
M >= 2048 (203 / 293 TFLOP/s) and loses 2-4 % on gate_up; MEDIUM beats LARGE on o_proj at
2048 (243); 64 x 128 (Tiles(2, 8, 2, 2, 1, 4)) loses 20-35 % everywhere (twice the
activation bytes a FLOP).

Grid order: blocks (weight block nb, token block mb), token blocks in bands of `band` (chosen
by the launcher: band x BM x K fp16 <= 16 MB); inside a band the token block varies fastest,
so the band's blocks that read one weight tile run side by side (one DRAM read, the rest L2
hits) and the band's activations stay in L2 while every weight block passes over them.

M = 16 (speculative verification of 4-16 tokens): SMALL, 32 weight rows x 16 tokens a block,
its 4 warps splitting each slice's 4 groups: grids of 144 (qkv), 112 (o_proj, down) and 1184
(gate_up) blocks stream the weights once; 14-23 instructions an mma (a fragment feeds 2
mmas), 28-45 a weight word.  Predicted ~25-40 us a layer (issue) against ~30 us of reading its
117 MB; measured 135 us (3.77 ms for 28 layers, level with cuBLAS fp16's 3.65): ~0.9 TB/s of
INT4, so neither bound holds -- each block also reads all of X (16 x K fp16: twice its 32
rows' weight bytes) and spends ~360 instructions a slice on
copies and the row layout's piece addressing.  Open: wider SMALL blocks (more rows a block, X
read fewer times).  M <= 7 runs the same kernel on the first m tokens (the rest of the
token tile is computed from a repeated row and not stored).
"""
from __future__ import annotations

import functools

import numpy as np

from nq.kernels.build import compile_kernel, in_cache
from nq.kernels.common import allow_smem
from nq.kernels.int4.gemm_kernel import (KINDS, TILE, Tiles, build_gemm, check,  # noqa: F401
                                         gather_fragment, layout_tag, row_piece_word)
from nq.kernels.int4.gemm_launch import gemm_launch


# ---- the NumPy reference -------------------------------------------------------------------------

def ref_gemm(kind, x, w_deq, bias=None, out=None):
    """fp64 reference.  x (M, K), w_deq (N, K) dequantised weights (gate_up: (2I, K), gate rows
    then up rows) -> plain: x.W^T; qkv: + bias; o_proj/down: out + x.W^T (out = the residual);
    gate_up: silu(x.Wg^T) * (x.Wu^T), (M, I)."""
    y = np.asarray(x, np.float64) @ np.asarray(w_deq, np.float64).T
    if kind == "plain":
        return y
    if kind == "qkv":
        return y + np.asarray(bias, np.float64)
    if kind in ("o_proj", "down"):
        return np.asarray(out, np.float64) + y
    if kind == "gate_up":
        half = y.shape[1] // 2
        gate, up = y[:, :half], y[:, half:]
        return gate / (1.0 + np.exp(-gate)) * up
    raise ValueError(f"ref_gemm: kind {kind!r} is not one of {KINDS}")


# ---- the launcher --------------------------------------------------------------------------------

# (largest M, tiles), tried in order: the first whose max_m >= M runs.  SMALL streams the
# weights at M <= 16 (speculative verification of 4-16 tokens, a spread-out decode): 32 rows x
# 16 tokens a block, its 4 warps split K.  LARGE is the prefill tile: 128 rows x 128 tokens.
SMALL = Tiles(ta=2, tb=2, wn=1, wm=1, wk=4, stages=4)
MEDIUM = Tiles(ta=2, tb=4, wn=4, wm=1, wk=1, stages=4)
LARGE = Tiles(ta=2, tb=8, wn=4, wm=2, wk=1, stages=3)
DEFAULT_CONFIGS = ((16, SMALL), (64, MEDIUM), (None, LARGE))
L2_BAND_BYTES = 16 << 20        # activations of a band of token blocks kept in L2 (of 60 MB)


@functools.lru_cache(maxsize=None)
def compiled(kind, n, k, layout, tiles):
    """(kernel, name): build_gemm's kernel compiled (once a process) and opted into its
    dynamic shared memory."""
    body, sig, name = build_gemm(kind, n, k, layout, tiles)
    kern = compile_kernel(body, sig, name, launch_bounds=(tiles.threads,))
    allow_smem(kern, tiles.smem_bytes())
    return kern, name


def _flat(a):
    return a.reshape(int(np.prod(a.shape)))


class Gemm:
    """One projection's GEMM: `g(x, qw, sc, [bias,] out, m, stream=0)` computes the first m
    rows of out from the first m rows of x (both may be allocated for a larger M).
    x (>= m, K) fp16; qw (Nw, K/8) uint32 and sc (Nw, K/128) fp16 as uploaded for decode (Nw = N,
    gate_up 2I); bias (N,) fp16 (qkv); out (>= m, N) fp32 (plain, qkv: written; o_proj, down:
    the residual, added to) or fp16 (gate_up, (>= m, I)).  Checks, then launches; allocates
    nothing, and m = 0 launches nothing."""

    def __init__(self, kind, n, k, layout, configs=DEFAULT_CONFIGS):
        self.kind, self.n, self.k, self.layout = kind, n, k, layout
        self.w_rows = 2 * n if kind == "gate_up" else n
        self.configs = tuple(configs)
        self._memo = {}   # checked launch arguments by buffer set (gemm_launch.gemm_launch)

    def pick(self, m):
        """(tiles, kernel, name) that run m tokens: the configuration's kernel, compiled (or
        loaded from the kernel cache) the first time an M needs it unless `prepare` ran."""
        for max_m, tiles in self.configs:
            if max_m is None or m <= max_m:
                return (tiles,) + compiled(self.kind, self.n, self.k, self.layout, tiles)
        raise ValueError(f"gemm: no tile configuration takes M={m}; end the list with "
                         f"(None, tiles)")

    def prepare(self, up_to: int | None = None) -> int:
        """Compile now, rather than when an M first needs it, every tile configuration that runs
        some M <= up_to (None: every one) and is not in the kernel cache; inside a
        parallel_compiles block the misses join its batch.  A cached one is left to load at
        its first use (a short prompt needs only the small tile).  Returns how many compiled."""
        n = 0
        for max_m, tiles in self.configs:
            body, sig, name = build_gemm(self.kind, self.n, self.k, self.layout, tiles)
            if not in_cache(body, sig, name, launch_bounds=(tiles.threads,)):
                compiled(self.kind, self.n, self.k, self.layout, tiles)
                n += 1
            if up_to is not None and (max_m is None or max_m >= up_to):
                break
        return n

    def grid(self, tiles, m):
        """(blocks, band): NB weight blocks x ceil(m / BM) token blocks, and the token blocks of a
        band (block_coords): as many as keep band x BM x K fp16 within L2_BAND_BYTES."""
        out_tiles = tiles.wn * tiles.ta // (2 if self.kind == "gate_up" else 1)
        nb = -(-(self.n // TILE) // out_tiles)
        mt = -(-m // tiles.tokens)
        band = max(1, min(mt, L2_BAND_BYTES // (tiles.tokens * self.k * 2)))
        return nb * mt, band

    def __call__(self, x, qw, sc, *rest, stream=0):
        bias = None
        if self.kind == "qkv":
            bias, out, m = rest
        else:
            out, m = rest
        m = int(m)
        tiles, kern, name = self.pick(max(m, 1))
        fast = gemm_launch(self, name, kern, m, x, qw, sc, bias, out)
        if fast is None:      # m = 0: checked, nothing to launch
            return
        blocks, band = self.grid(tiles, m)
        fast(blocks, tiles.threads, stream, tiles.smem_bytes(), m, band)


@functools.lru_cache(maxsize=None)
def make_gemm(kind: str, n: int, k: int, layout, configs=DEFAULT_CONFIGS, backend="mma"):
    """The GEMM of one projection shape (compiled once per process): kind in KINDS, n output
    features (gate_up: I), k input features, layout "mma" or ("rows", ks).  backend "mma"
    (the default: mma.sync, every M) or "wgmma" (sm_90a; nq/kernels/int4/gemm_wgmma.py for
    M > its WGMMA_MIN_M, this mma.sync Gemm below that; same call)."""
    if backend == "wgmma":
        from nq.kernels.int4.gemm_wgmma import WgmmaGemm
        return WgmmaGemm(kind, n, k, layout, small=Gemm(kind, n, k, layout, configs))
    if backend != "mma":
        raise ValueError(f"make_gemm: backend {backend!r} must be 'mma' or 'wgmma'")
    return Gemm(kind, n, k, layout, configs)
