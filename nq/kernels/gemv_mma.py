"""The residual INT4 GEMVs (o_proj, down: x += W . a) with the dot products on the tensor cores.

Why: ncu reads the CUDA-core GEMV (gemv_int4) for down as issue-bound, not memory-bound (0.61
instructions issued a cycle per scheduler, DRAM at 38 % of peak; docs/KERNELS_GEMV.md).  Per 8
weights it spends 9 instructions turning nibbles into fp16 pairs and 4 fma.f16x2 multiplying
them with activations it read from shared memory (one 16-byte load a word).  Here the same 9
dequant instructions build the A fragment of one `mma.sync.m16n8k16` (fp16 in, fp32 out),
which replaces the 4 fmas, and one 8-byte B fragment of activations serves the 16 rows of the
tile: ~10 instructions per 8 weights instead of ~14.  Opt-in (`Tiling(mma=True)`), not yet
measured on the device.

The fragment layout decides the weight layout (`mma_layout`, a NumPy model; the kernel's loads
mirror it).  With g = lane // 4 and t = lane % 4, lane (g, t) of a 16-row tile holds for each
16-column chunk of K the word whose nibble slots are

    slot 0, 4: W[g,   2t], W[g,   2t+1]      -> (q & 0x000F000F) ^ 0x64086408 - 1032  = a0
    slot 1, 5: W[g+8, 2t], W[g+8, 2t+1]      -> (q & 0x00F000F0) ^ 0x64806480, fma    = a1
    slot 2, 6: W[g,   2t+8], W[g,   2t+9]    -> the same on q >> 8                    = a2
    slot 3, 7: W[g+8, 2t+8], W[g+8, 2t+9]                                             = a3

so the dequant is gemv_int4's, instruction for instruction (nq/ptx/mma.py has the fragment
coordinates).  Memory order: [tile][group][lane][8 words] -- a group (128 columns = 8 chunks)
of a tile is 1 KB, each lane's 32 bytes of it two 16-byte loads.  Scales stay in the file's
(N, K/128) layout (a lane reads rows g and g+8).

A block is TILES = threads / 32 / ks row tiles of 16 rows; the `ks` warps of a tile split its
groups (warp w: groups w, w + ks, ...), each accumulating fp32 `mma(A, B) * scale` per group
(the products of fp16 are exact, the sums fp32: closer to the fp64 reference than gemv_int4's
fp16 partials).  The block stages `a` in shared memory once, in B-fragment order: chunk c,
lane t reads the 8 bytes (a[16c+2t : 16c+2t+2], a[16c+2t+8 : 16c+2t+10]).  B's 8 columns are
all `a` (lanes with the same t load the same bytes), so every column of D is the dot product
and lane (g, t) holds rows g (d0) and g+8 (d2).  The ks warps' partials meet in shared memory
and one thread a row adds them in a fixed order: deterministic, one writer per x element.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, uint32

from nq.config import GROUP_SIZE, ModelConfig
from nq.kernels.gemv_int4 import (_MAGIC_HI, _MAGIC_LO, _MASK_HI, _MASK_LO, _NEG72, _NEG1032,
                                  _SH8, _SIXTEENTH, Tiling, _need, ref_o_proj)
from nq.loader.quant import unpack_value_shuffle
from nq.ptx import (LUT_AND_XOR, SIMULATOR, add_rn_f16x2, cvt_f32_f16, cvta_to_shared_u32,
                    fma_rn_f16x2, griddepcontrol_launch_dependents, griddepcontrol_wait,
                    ld_global_nc_u16, ld_global_nc_v4_u32, ld_shared_v2_u32_at, lop3_b32,
                    mma_sync_m16n8k16_f16_f32)

TILE = 16          # rows of an mma tile (m16)
CHUNK = 16         # columns of an mma step (k16)
KINDS = ("o_proj", "down")
ref_residual = ref_o_proj   # x + W . a, both kinds


# ---- the weight layout (NumPy model) -----------------------------------------------------------

def mma_layout(qweight: np.ndarray) -> np.ndarray:
    """File-layout (N, K/8) ValueShuffle words -> (N, K/8) words in the fragment order (module doc):
    C-order memory [tile][group][lane][8 words]."""
    n, k8 = qweight.shape
    k = k8 * 8
    if n % TILE or k % GROUP_SIZE:
        raise ValueError(f"mma_layout: N={n} must be a multiple of {TILE} and K={k} of {GROUP_SIZE}")
    nt, g = n // TILE, k // GROUP_SIZE
    nib = (unpack_value_shuffle(np.asarray(qweight)).astype(np.uint32) & 0xF)   # two's complement
    # (tile, group, row in tile, chunk in group, column in chunk)
    r = nib.reshape(nt, TILE, g, GROUP_SIZE // CHUNK, CHUNK).transpose(0, 2, 1, 3, 4)
    top, bot = r[:, :, :8], r[:, :, 8:]                  # rows g and g + 8: (nt, g, 8, 8, 16)

    def cols(x, first):                                   # column first + 2t, t = 0..3
        return x[..., first:first + 8:2]                  # (nt, g, 8 rows, 8 chunks, 4 t)

    word = (cols(top, 0) | cols(bot, 0) << 4 | cols(top, 8) << 8 | cols(bot, 8) << 12
            | cols(top, 1) << 16 | cols(bot, 1) << 20 | cols(top, 9) << 24 | cols(bot, 9) << 28)
    # (nt, g, row g, chunk i, t) -> (nt, g, lane = 4 row + t, chunk i)
    word = word.transpose(0, 1, 2, 4, 3).reshape(nt, g, 32, GROUP_SIZE // CHUNK)
    return np.ascontiguousarray(word.astype(np.uint32).reshape(n, k8))


def mma_unlayout(words: np.ndarray) -> np.ndarray:
    """The inverse of mma_layout (tests): fragment-order words -> file-layout ValueShuffle words."""
    from nq.loader.quant import pack_value_shuffle
    n, k8 = words.shape
    k = k8 * 8
    nt, g = n // TILE, k // GROUP_SIZE
    w = np.asarray(words, np.uint32).reshape(nt, g, 8, 4, GROUP_SIZE // CHUNK)  # nt, g, row, t, i
    out = np.zeros((nt, g, TILE, GROUP_SIZE // CHUNK, CHUNK), np.int8)
    for slot, (half, col) in enumerate([(0, 0), (1, 0), (0, 8), (1, 8), (0, 1), (1, 1), (0, 9), (1, 9)]):
        v = ((w >> np.uint32(4 * slot)) & 0xF).astype(np.int8)
        v = np.where(v > 7, v - 16, v).transpose(0, 1, 2, 4, 3)              # nt, g, row, i, t
        out[:, :, 8 * half:8 * half + 8, :, col:col + 8:2] = v
    return pack_value_shuffle(out.transpose(0, 2, 1, 3, 4).reshape(n, k))


# ---- the kernel ----------------------------------------------------------------------------------

def check_tiling(n_out: int, k: int, t: Tiling) -> None:
    kw = t.ks
    if not t.mma:
        raise ValueError(f"gemv_mma: tiling {t.tag()} is not an mma tiling (Tiling(mma=True))")
    if n_out % TILE or k % GROUP_SIZE:
        raise ValueError(f"gemv_mma: N={n_out} must be a multiple of {TILE} (an mma tile) and "
                         f"K={k} of {GROUP_SIZE}")
    if kw < 1 or t.threads % (32 * kw) or t.threads > 1024 or int(t.prefetch) != 1:
        raise ValueError(f"gemv_mma: tiling {t.tag()}: threads must be a multiple of 32*ks "
                         f"(ks = warps a tile's groups are split over), at most 1024, and "
                         f"prefetch 1 (a group's loads are always issued a group ahead)")
    if t.rows != 1 or t.block_major or t.bulk or t.stream or t.l2_steps:
        raise ValueError(f"gemv_mma: tiling {t.tag()}: rows, block_major, bulk, stream and "
                         f"l2_steps are gemv_int4's; an mma tiling takes ks, threads, prefetch "
                         f"and min_blocks")
    if k * 2 > 48 * 1024:
        raise ValueError(f"gemv_mma: K={k} needs {k * 2} bytes of staged activations, over the "
                         f"48 KB static shared memory limit")


@functools.lru_cache(maxsize=None)
def build_kernel(kind: str, n_out: int, k: int, t: Tiling):
    """The cuda.jit kernel body and its signature: x (N,) fp32 += W . a, a (K,) fp16."""
    if kind not in KINDS:
        raise ValueError(f"gemv_mma: kind {kind!r} is not one of {KINDS} (x += W . a)")
    check_tiling(n_out, k, t)
    KW = t.ks
    TPB = t.threads
    TILES = TPB // 32 // KW
    G = k // GROUP_SIZE
    NT = n_out // TILE
    NPAIR = -(-G // (2 * KW))         # two-group iterations of a warp (the last may be short)
    CH = k // CHUNK                   # k16 chunks
    AW = k // 2                       # staged activation words (fp16 pairs)
    RED = TILES * KW * TILE           # the warps' row partials
    STAGE = -(-CH // TPB)
    ZERO = uint32(0)

    def load_group(qw, sc, wbase, sbase, grp):
        # the lane's 8 words of group grp of its tile (words from wbase, 256 a group) and the
        # scale bits of its rows g (scales from sbase) and g + 8 (8 rows of G further)
        base = wbase + grp * 256
        w0, w1, w2, w3 = ld_global_nc_v4_u32(qw, base)
        w4, w5, w6, w7 = ld_global_nc_v4_u32(qw, base + 4)
        s0 = uint32(ld_global_nc_u16(sc, sbase + grp))
        s1 = uint32(ld_global_nc_u16(sc, sbase + 8 * G + grp))
        return (w0, w1, w2, w3, w4, w5, w6, w7, s0, s1)

    def mma_word(q, baddr, d):
        # one k16 chunk: the word's 8 weights as the A fragment, the staged activations as B
        lo0 = lop3_b32(q, _MASK_LO, _MAGIC_LO, LUT_AND_XOR)
        hi0 = lop3_b32(q, _MASK_HI, _MAGIC_HI, LUT_AND_XOR)
        q8 = q >> _SH8
        lo1 = lop3_b32(q8, _MASK_LO, _MAGIC_LO, LUT_AND_XOR)
        hi1 = lop3_b32(q8, _MASK_HI, _MAGIC_HI, LUT_AND_XOR)
        a0 = add_rn_f16x2(lo0, _NEG1032)
        a1 = fma_rn_f16x2(hi0, _SIXTEENTH, _NEG72)
        a2 = add_rn_f16x2(lo1, _NEG1032)
        a3 = fma_rn_f16x2(hi1, _SIXTEENTH, _NEG72)
        b0, b1 = ld_shared_v2_u32_at(baddr)
        return mma_sync_m16n8k16_f16_f32(a0, a1, a2, a3, b0, b1, d[0], d[1], d[2], d[3])

    def group_dot(cur, abase, grp, t4):
        """(row g, row g+8) fp32 sums of one group, times their scales.  Written out, not
        looped: the tuple's elements need literal indices to stay in registers."""
        z = float32(0.0)
        d = (z, z, z, z)
        b = abase + uint32(grp * (GROUP_SIZE // CHUNK) * 32) + uint32(t4 * 8)  # chunk stride 32 B
        d = mma_word(cur[0], b, d)
        d = mma_word(cur[1], b + uint32(32), d)
        d = mma_word(cur[2], b + uint32(64), d)
        d = mma_word(cur[3], b + uint32(96), d)
        d = mma_word(cur[4], b + uint32(128), d)
        d = mma_word(cur[5], b + uint32(160), d)
        d = mma_word(cur[6], b + uint32(192), d)
        d = mma_word(cur[7], b + uint32(224), d)
        return d[0] * cvt_f32_f16(cur[8]), d[2] * cvt_f32_f16(cur[9])

    def stage(a, act):
        # chunk c's 8 fp16 pairs p0..p7 stored as (p0 p4)(p1 p5)(p2 p6)(p3 p7): lane t's B
        # fragment (b0 = pair t, b1 = pair t + 4) is then 8 contiguous bytes
        for it in range(STAGE):
            c = it * TPB + cuda.threadIdx.x
            if c < CH:
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

    dev = functools.partial(cuda.jit, device=True, **({} if SIMULATOR else {"forceinline": True}))
    load_group, mma_word, group_dot, stage = (dev(f) for f in (load_group, mma_word, group_dot, stage))

    def kernel(a, qw, sc, x):
        act = cuda.shared.array(AW, uint32, alignment=None if SIMULATOR else 16)
        red = cuda.shared.array(RED, float32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        g = lane >> 2
        t4 = lane & 3
        tl = warp // KW
        kw = warp - tl * KW
        # a tile past the matrix (the last block's) is clamped: it loads words that exist and
        # its sums are not written
        tile = min(cuda.blockIdx.x * TILES + tl, NT - 1)
        wbase = (tile * G * 32 + lane) * 8
        sbase = (tile * TILE + g) * G
        # weights depend on nothing upstream: the first group's loads go before the wait
        ga_buf = load_group(qw, sc, wbase, sbase, min(kw, G - 1))
        griddepcontrol_wait()
        griddepcontrol_launch_dependents()
        stage(a, act)
        cuda.syncthreads()
        abase = cvta_to_shared_u32(act)
        acc0 = float32(0.0)
        acc1 = float32(0.0)
        # The warp's groups kw, kw + KW, ... two an iteration, into two register sets that
        # take turns (no copies): each group's loads are issued a group ahead of its math.
        # The conditions are the same for the whole warp: the mma sees all 32 lanes.
        for it in range(NPAIR):
            ga = kw + 2 * it * KW
            gb = ga + KW
            gb_buf = load_group(qw, sc, wbase, sbase, min(gb, G - 1))
            if ga < G:
                v0, v1 = group_dot(ga_buf, abase, ga, t4)
                acc0 += v0
                acc1 += v1
            ga_buf = load_group(qw, sc, wbase, sbase, min(gb + KW, G - 1))
            if gb < G:
                v0, v1 = group_dot(gb_buf, abase, gb, t4)
                acc0 += v0
                acc1 += v1
        if t4 == 0:
            red[(tl * KW + kw) * TILE + g] = acc0
            red[(tl * KW + kw) * TILE + g + 8] = acc1
        cuda.syncthreads()
        if tid < TILES * TILE:
            r = tid % TILE
            tl2 = tid // TILE
            s = float32(0.0)
            for w_ in range(KW):
                s += red[(tl2 * KW + w_) * TILE + r]
            row = (cuda.blockIdx.x * TILES + tl2) * TILE + r
            if row < n_out:
                x[row] += s

    kernel.__name__ = f"gemv_mma_{kind}_n{n_out}_k{k}_{t.tag()}"
    kernel.__qualname__ = kernel.__name__
    return kernel, "void(float16[::1], uint32[::1], float16[::1], float32[::1])"


@functools.lru_cache(maxsize=None)
def _compiled(kind, n_out, k, t):
    pyfunc, sig = build_kernel(kind, n_out, k, t)
    if SIMULATOR:
        return cuda.jit(pyfunc)
    bounds = (t.threads, t.min_blocks) if t.min_blocks else (t.threads,)
    return cuda.jit(sig, launch_bounds=bounds)(pyfunc)


class ResidualMmaGemv:
    """o_proj / down on the tensor cores: the interface of gemv_int4.ResidualGemv (prepare once
    on the host, then `g(a, qw, sc, x, stream)`), with its own weight layout (`mma_layout`)."""

    def __init__(self, kind: str, cfg: ModelConfig, n_out: int, k: int, tiling: Tiling):
        check_tiling(n_out, k, tiling)
        self.kind, self.n_out, self.k, self.n_rows, self.tiling = kind, n_out, k, n_out, tiling
        self.kernel = _compiled(kind, n_out, k, tiling)
        self.block = tiling.threads
        self.smem = 0
        self.grid = -(-n_out // tiling.rows_per_block())
        self.name = f"gemv_mma_{kind}_n{n_out}_k{k}_{tiling.tag()}"

    def prepare(self, parts):
        """[(qweight (N, K/8) uint32, scales (N, K/128) fp16)] in file layout -> (qw, sc)."""
        if len(parts) != 1:
            raise ValueError(f"{self.name}: prepare takes one (qweight, scales) pair, got {len(parts)}")
        q, s = (np.asarray(p) for p in parts[0])
        if q.dtype != np.uint32 or q.shape != (self.n_out, self.k // 8):
            raise ValueError(f"{self.name}: qweight must be uint32 {(self.n_out, self.k // 8)}, "
                             f"got {q.dtype} {q.shape}")
        if s.dtype != np.float16 or s.shape != (self.n_out, self.k // GROUP_SIZE):
            raise ValueError(f"{self.name}: scales must be fp16 {(self.n_out, self.k // GROUP_SIZE)}, "
                             f"got {s.dtype} {s.shape}")
        return mma_layout(q), np.ascontiguousarray(s)

    def __call__(self, a, qw, sc, x, stream=0):
        _need(qw, f"{self.name} qweight", np.uint32, (self.n_out, self.k // 8))
        _need(sc, f"{self.name} scales", np.float16, (self.n_out, self.k // GROUP_SIZE), 2)
        _need(a, f"{self.name} a", np.float16, (self.k,), 16)
        _need(x, f"{self.name} x", np.float32, (self.n_out,), 4)
        self.kernel[self.grid, self.block, stream, 0](a, qw.reshape(qw.size), sc.reshape(sc.size), x)
