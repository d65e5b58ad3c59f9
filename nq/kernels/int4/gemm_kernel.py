"""The prefill GEMM's kernel: tile configurations, their checks, and the kernel factory.

nq/kernels/int4/gemm.py's docstring is the design note (tiles, layouts, pipeline, registers,
instruction counts, predicted speed) and holds the reference and the launcher; this module is
the kernel it describes, kept apart to keep each file readable (a launch's host side, shared
with gemm_wgmma.py: gemm_launch.py).
"""
from __future__ import annotations

import dataclasses
import functools
import math

from numba import cuda, float32, int32, uint32

from nq.config import GROUP_SIZE
from nq.kernels.build import kernel_name
from nq.kernels.common import SMEM_OPTIN_LIMIT, dev
from nq.kernels.int4.dequant import dequant_word
from nq.kernels.int4.layout import TILE          # weight rows of an mma A tile (m16)
from nq.ptx import (LUT_AND_XOR, SIMULATOR, add_rn_f16x2, cp_async_cg_shared_global_16,
                    cp_async_commit_group, cp_async_wait_group, cvt_f32_f16, cvt_rn_f16_f32,
                    cvta_to_shared_u32, ld_global_nc_u16, ld_shared_v4_u32_at, ldmatrix_x4,
                    lop3_b32, mma_sync_m16n8k16_f16_f32, mul_rn_f16x2, st_global_u16)

KINDS = ("plain", "qkv", "o_proj", "down", "gate_up")
ALIGN = None if SIMULATOR else 128   # cp.async and ldmatrix need 16 (the simulator takes none)
_NEG1032 = 0xE408E408           # fp16x2 (-1032, -1032): dequant.py's lo-nibble offset
_MASK_LO = 0x000F000F
_MAGIC_LO = 0x64086408


# ---- tile configurations -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Tiles:
    """How a block splits its work.  A warp owns `ta` 16-row weight tiles x `tb` 8-token tiles
    (ta*tb accumulators of 4 fp32 a lane); the block is wn x wm x wk warps: wn along the weight
    rows, wm along the tokens, wk along K (the wk warps of a stage take one group each and their
    sums meet in shared memory at the end).  `stages` k-slices (wk groups each) in flight."""
    ta: int
    tb: int
    wn: int
    wm: int
    wk: int
    stages: int

    @property
    def rows(self) -> int:          # weight rows of a block (gate_up: half gate, half up)
        return TILE * self.ta * self.wn

    @property
    def tokens(self) -> int:        # tokens of a block
        return 8 * self.tb * self.wm

    @property
    def threads(self) -> int:
        return 32 * self.wn * self.wm * self.wk

    def stage_bytes(self) -> int:   # a group: rows x 64 bytes of INT4, tokens x 256 of fp16
        return self.wk * (self.rows * GROUP_SIZE // 2 + self.tokens * GROUP_SIZE * 2)

    def smem_bytes(self) -> int:
        return self.stages * self.stage_bytes()

    def tag(self) -> str:
        return f"a{self.ta}b{self.tb}n{self.wn}m{self.wm}k{self.wk}s{self.stages}"


def layout_tag(layout) -> str:
    if layout == "mma":
        return "mma"
    if isinstance(layout, tuple) and len(layout) == 2 and layout[0] == "rows" \
            and isinstance(layout[1], int) and layout[1] >= 1:
        return f"rows{layout[1]}"
    raise ValueError(f"gemm: layout {layout!r} must be 'mma' (the fragment layout, o_proj, "
                     f"down, gate_up) or ('rows', ks) (the row layout, ks from the decode "
                     f"tiling)")


def check(kind: str, n: int, k: int, layout, tiles: Tiles) -> None:
    """Refuse what the kernel cannot do, before compiling."""
    layout_tag(layout)
    if kind not in KINDS:
        raise ValueError(f"gemm: kind {kind!r} is not one of {KINDS}")
    if n % TILE or k % GROUP_SIZE or n <= 0 or k <= 0:
        raise ValueError(f"gemm: N={n} must be a multiple of {TILE} and K={k} of {GROUP_SIZE}")
    t = tiles
    if min(t.ta, t.tb, t.wn, t.wm, t.wk) < 1 or t.tb % 2 or t.stages < 2 or t.threads > 1024:
        raise ValueError(f"gemm: tiles {t.tag()}: tb must be even (ldmatrix.x4 loads two token "
                         f"tiles), stages >= 2, at most 1024 threads")
    if kind == "gate_up" and t.ta % 2:
        raise ValueError(f"gemm: gate_up needs an even ta (a warp holds gate and up tiles of "
                         f"the same rows), got {t.tag()}")
    if (t.wk * t.rows * 4) % t.threads or (t.wk * t.tokens * 16) % t.threads:
        raise ValueError(f"gemm: tiles {t.tag()}: the 16-byte copies of a slice (4 a weight "
                         f"row, 16 a token, per group) must be a whole number a thread")
    if t.smem_bytes() > SMEM_OPTIN_LIMIT:
        raise ValueError(f"gemm: tiles {t.tag()} need {t.smem_bytes()} bytes of shared memory, "
                         f"over sm_90's {SMEM_OPTIN_LIMIT}")
    if t.wk > 1 and 4 * (t.wk - 1) * t.wn * t.wm * 32 * 4 * t.ta * t.tb > t.smem_bytes():
        raise ValueError(f"gemm: tiles {t.tag()}: the wk partial sums do not fit the stages")


# ---- the kernel ----------------------------------------------------------------------------------

def gather_fragment(qa, qb, qc, qd, shift):
    """Row layout: the A fragment of lane (g, t) from the four words that hold its pairs --
    qa = row g, k 16c..16c+7; qb = row g+8, same k; qc, qd = the same rows, k 16c+8..16c+15.
    Pair t of a ValueShuffle word is its nibble slots t and t+4 (columns 2t, 2t+1), so
    `word >> 4t` puts it where dequant_word's low-nibble trick reads it:
    ((w >> 4t) & 0x000F000F) ^ 0x64086408 is the fp16 pair 1032 + n, minus 1032.
    12 instructions (shr, lop3, add.f16x2 a register) for 8 weights; dequant_word needs 9."""
    return (add_rn_f16x2(lop3_b32(qa >> shift, _MASK_LO, _MAGIC_LO, LUT_AND_XOR), _NEG1032),
            add_rn_f16x2(lop3_b32(qb >> shift, _MASK_LO, _MAGIC_LO, LUT_AND_XOR), _NEG1032),
            add_rn_f16x2(lop3_b32(qc >> shift, _MASK_LO, _MAGIC_LO, LUT_AND_XOR), _NEG1032),
            add_rn_f16x2(lop3_b32(qd >> shift, _MASK_LO, _MAGIC_LO, LUT_AND_XOR), _NEG1032))


def row_piece_word(grp, i, ks, n_groups):
    """Row layout: word offset, inside a row, of the 16-byte piece i (k 32i..32i+31 of the
    group) of group grp -- layout.chunk_permutation's position s*ks*4 + i*gs + j of file
    chunk 4*grp + i, with s = grp // ks, j = grp % ks, gs the step's group count."""
    st = grp // ks
    j = grp - st * ks
    gs = min(ks, n_groups - st * ks)
    return 4 * (st * ks * 4 + i * gs + j)


@functools.lru_cache(maxsize=None)
def build_gemm(kind: str, n: int, k: int, layout, tiles: Tiles):
    """(kernel body, signature, name) of the GEMM of `kind` for N = n output features (gate_up:
    I, its weights the 2I rows [gate; up]) and K = k, reading weights in `layout`."""
    check(kind, n, k, layout, tiles)
    TA, TB, WN, WM, WK, STAGES = (tiles.ta, tiles.tb, tiles.wn, tiles.wm, tiles.wk,
                                  tiles.stages)
    BN, BM, TPB = tiles.rows, tiles.tokens, tiles.threads
    G = k // GROUP_SIZE
    K8 = k // 8
    NS = -(-G // WK)                      # k-slices of the main loop (WK groups each)
    GATE_UP = kind == "gate_up"
    RESIDUAL = kind in ("o_proj", "down")
    BIAS = kind == "qkv"
    MMA = layout == "mma"
    KS = 1 if MMA else layout[1]
    NT_OUT = n // TILE                    # output tiles (gate_up: gate tiles; up tiles follow)
    HALF = TA // 2 if GATE_UP else TA     # output tiles of a warp
    OUT_TILES = WN * HALF                 # output tiles of a block
    NB = -(-NT_OUT // OUT_TILES)          # blocks along N
    W_BYTES = BN * GROUP_SIZE // 2        # a group of the block's rows: 1 KB a tile
    X_BYTES = BM * GROUP_SIZE * 2         # a group of the block's tokens: 256 bytes a token
    X_OFF = WK * W_BYTES
    STAGE = tiles.stage_bytes()
    W_PIECES = WK * BN * 4                # 16-byte copies a stage
    X_PIECES = WK * BM * 16
    PW = W_PIECES // TPB                  # of them a thread's (check: whole numbers)
    PX = X_PIECES // TPB
    IN_FLIGHT = STAGES - 2                # slices still landing while one is computed
    NACC = TA * TB * 4                    # fp32 accumulators of a lane
    N_AW, N_RW, N_BF, N_SC = 4 * TA, 8 * TA, 2 * TB, 2 * TA   # (local array sizes: constants)

    def block_coords(m, band):
        """(nb, mb): this block's weight-row block and token block.  Token blocks come in bands
        of `band`; inside a band the token block varies fastest, so the `band` blocks that read
        a weight tile run side by side (one DRAM read, the rest L2 hits) and the band's
        activations (band x BM x K fp16, sized by the launcher) stay in L2 while all NB weight
        blocks pass over them."""
        mt = (m + BM - 1) // BM
        per_band = NB * band
        b = int32(cuda.blockIdx.x)
        bi = b // per_band
        r = b - bi * per_band
        size = min(band, mt - bi * band)
        nb = r // size
        return nb, bi * band + (r - nb * size)

    def weight_tile(nb, ti):
        """Block tile ti (warp ti // TA's tile ti % TA) -> (the weight tile it reads, clamped
        into the matrix, and its output tile, which may be past the end: not written)."""
        wn = ti // TA
        a = ti - wn * TA
        up = 0
        if GATE_UP and a >= HALF:         # a warp's second half of tiles: the same rows of up
            up = 1
            a -= HALF
        ot = nb * OUT_TILES + wn * HALF + a
        return min(ot, NT_OUT - 1) + up * NT_OUT, ot

    def copy_plan(nb, m0, m, tid, wsrc, wdst, xsrc, xdst):
        """This thread's 16-byte copies of k-slice 0, worked out once: weight copy it reads
        word wsrc[it] of qw into byte wdst[it] of the stage, activation copy it reads element
        xsrc[it] of x into byte xdst[it]; slice s reads s*WK groups further (row layout: at
        row_piece's place of each group instead)."""
        for it in range(PW):
            p = it * TPB + tid
            slot = p // (BN * 4)              # the group of the slice (wk)
            q = p - slot * (BN * 4)
            if MMA:
                # tile ti's 1 KB of the group: lane l's 32 bytes, its two 16-byte halves
                # swapped for lanes with bit 2 set (conflict-free 16-byte reads)
                ti = q >> 6
                pc = q & 63
                ln = pc >> 1
                gt, _ = weight_tile(nb, ti)
                wdst[it] = slot * W_BYTES + ti * 1024 + ln * 32 + 16 * ((pc & 1) ^ ((ln >> 2) & 1))
                wsrc[it] = (gt * G + slot) * 256 + pc * 4
            else:
                r = q >> 2                    # block row (64 bytes a group), piece q & 3
                gt, _ = weight_tile(nb, r >> 4)
                wdst[it] = slot * W_BYTES + r * 64 + 16 * (q & 3)
                wsrc[it] = (gt * TILE + (r & 15)) * K8
        for it in range(PX):
            # token r's 16-byte chunk cc of the group sits at chunk cc ^ (r & 7) of its
            # 256-byte row: ldmatrix's 8 rows then hit 8 different bank groups.  Tokens past
            # m read token m-1 (finite; never stored).
            p = it * TPB + tid
            slot = p // (BM * 16)
            q = p - slot * (BM * 16)
            r = q >> 4
            cc = q & 15
            xsrc[it] = min(m0 + r, m - 1) * k + slot * GROUP_SIZE + 8 * cc
            xdst[it] = X_OFF + slot * X_BYTES + r * 256 + 16 * (cc ^ (r & 7))

    def issue_stage(xf, qw, buf, s, tid, wsrc, wdst, xsrc, xdst):
        """Start the copies of k-slice s (groups s*WK ..) into the ring buffer at shared
        address buf; commit them as one group (an empty one past the end, so that wait_group
        counts slices).  xf: x as a flat array."""
        if s < NS:
            for it in range(PW):
                grp = s * WK + (it * TPB + tid) // (BN * 4)
                if G % WK == 0 or grp < G:
                    if MMA:
                        src = wsrc[it] + s * (WK * 256)
                    else:
                        src = wsrc[it] + row_piece(grp, tid & 3, KS, G)
                    cp_async_cg_shared_global_16(buf + wdst[it], qw, src)
            for it in range(PX):
                grp = s * WK + (it * TPB + tid) // (BM * 16)
                if G % WK == 0 or grp < G:
                    cp_async_cg_shared_global_16(buf + xdst[it], xf,
                                                 xsrc[it] + s * (WK * GROUP_SIZE))
        cp_async_commit_group()

    def load_scales(sc, rows, grp, out):
        # the fp16 scale bits of the warp's rows g, g+8 of each tile, group grp
        for a in range(TA):
            out[2 * a] = uint32(ld_global_nc_u16(sc, rows[a] * G + grp))
            out[2 * a + 1] = uint32(ld_global_nc_u16(sc, (rows[a] + 8) * G + grp))

    def group_mma(acc, wb, xrow, xl16, la, g, shift, scl):
        """acc += this warp's tiles of one group (8 k16 chunks) times its tokens.
        wb: the warp's first tile in the stage (1 KB a tile); xrow: its ldmatrix row (token
        lr of its first 16) in the stage; scl: (s_g, s_g8) fp16x2 of each tile."""
        aw = cuda.local.array(N_AW, uint32)         # mma layout: 4 chunks' words a tile
        rw = cuda.local.array(N_RW, uint32)         # row layout: a piece of rows g, g+8
        bf = cuda.local.array(N_BF, uint32)         # B fragments of a chunk
        for h in range(2):
            if MMA:
                for a in range(TA):
                    w0, w1, w2, w3 = ld_shared_v4_u32_at(wb + a * 1024 + (la ^ (16 * h)))
                    aw[4 * a] = w0
                    aw[4 * a + 1] = w1
                    aw[4 * a + 2] = w2
                    aw[4 * a + 3] = w3
            for p2 in range(2):
                i = 2 * h + p2                        # piece: chunks 2i, 2i+1
                if not MMA:
                    for a in range(TA):
                        base = wb + a * 1024 + g * 64 + 16 * i
                        w0, w1, w2, w3 = ld_shared_v4_u32_at(base)
                        w4, w5, w6, w7 = ld_shared_v4_u32_at(base + 512)
                        rw[8 * a] = w0
                        rw[8 * a + 1] = w1
                        rw[8 * a + 2] = w2
                        rw[8 * a + 3] = w3
                        rw[8 * a + 4] = w4
                        rw[8 * a + 5] = w5
                        rw[8 * a + 6] = w6
                        rw[8 * a + 7] = w7
                for j2 in range(2):
                    c = 2 * i + j2
                    for jb in range(TB // 2):
                        r0, r1, r2, r3 = ldmatrix_x4(xrow + jb * 4096 + ((32 * c) ^ xl16))
                        bf[4 * jb] = r0
                        bf[4 * jb + 1] = r1
                        bf[4 * jb + 2] = r2
                        bf[4 * jb + 3] = r3
                    for a in range(TA):
                        if MMA:
                            a0, a1, a2, a3 = dequant(aw[4 * a + 2 * p2 + j2])
                        else:
                            a0, a1, a2, a3 = gather(rw[8 * a + 2 * j2], rw[8 * a + 4 + 2 * j2],
                                                    rw[8 * a + 2 * j2 + 1],
                                                    rw[8 * a + 5 + 2 * j2], shift)
                        sg, sg8 = scl[2 * a], scl[2 * a + 1]
                        a0 = mul_rn_f16x2(a0, sg)
                        a1 = mul_rn_f16x2(a1, sg8)
                        a2 = mul_rn_f16x2(a2, sg)
                        a3 = mul_rn_f16x2(a3, sg8)
                        for b in range(TB):
                            o = (a * TB + b) * 4
                            d0, d1, d2, d3 = mma_sync_m16n8k16_f16_f32(
                                a0, a1, a2, a3, bf[2 * b], bf[2 * b + 1],
                                acc[o], acc[o + 1], acc[o + 2], acc[o + 3])
                            acc[o] = d0
                            acc[o + 1] = d1
                            acc[o + 2] = d2
                            acc[o + 3] = d3

    dequant, gather, row_piece = dev(dequant_word), dev(gather_fragment), dev(row_piece_word)
    block_coords, weight_tile, copy_plan, issue_stage, load_scales, group_mma = (
        dev(f) for f in (block_coords, weight_tile, copy_plan, issue_stage, load_scales,
                         group_mma))

    def mainloop(acc, xf, qw, sc, m, band):
        """The block's sums over all of K into acc (warps with wk = 0 hold the block's; the
        others' were added to theirs).  Returns (nb, m0, wn, wm, wk, g, t)."""
        smem = cuda.shared.array(0, uint32, alignment=ALIGN)  # the ring, sized at launch
        sbase = cvta_to_shared_u32(smem)
        tid = int32(cuda.threadIdx.x)
        lane = tid & 31
        warp = tid >> 5
        wm = warp % WM
        wn = (warp // WM) % WN
        wk = warp // (WM * WN)
        g = lane >> 2
        nb, mb = block_coords(m, band)
        m0 = mb * BM
        wsrc = cuda.local.array(PW, int32)
        wdst = cuda.local.array(PW, int32)
        xsrc = cuda.local.array(PX, int32)
        xdst = cuda.local.array(PX, int32)
        copy_plan(nb, m0, m, tid, wsrc, wdst, xsrc, xdst)
        for s in range(STAGES - 1):
            issue_stage(xf, qw, sbase + s * STAGE, s, tid, wsrc, wdst, xsrc, xdst)
        la = lane * 32 + 16 * ((lane >> 2) & 1)           # mma layout: the lane's 32 bytes
        lr = (lane & 7) + 8 * (lane >> 4)                  # ldmatrix: the lane's token row ..
        xl16 = 16 * (((lane >> 3) & 1) ^ (lane & 7))       # .. and its chunk swizzle
        shift = uint32(4 * (lane & 3))                     # row layout: pair t's nibbles
        rows = cuda.local.array(TA, int32)
        for a in range(TA):
            gt, _ = weight_tile(nb, wn * TA + a)
            rows[a] = gt * TILE + g
        for r in range(NACC):
            acc[r] = float32(0.0)
        nxt = cuda.local.array(N_SC, uint32)
        scl = cuda.local.array(N_SC, uint32)
        load_scales(sc, rows, min(wk, G - 1), nxt)
        rd = sbase                            # slice s's buffer: sbase + (s % STAGES) * STAGE
        wr = sbase + (STAGES - 1) * STAGE     # and slice s + STAGES - 1's (s - 1's)
        for s in range(NS):
            cp_async_wait_group(IN_FLIGHT)     # slice s has landed (this thread's copies) ..
            cuda.syncthreads()                # .. everyone's; slice s-1's buffer is free
            issue_stage(xf, qw, wr, s + STAGES - 1, tid, wsrc, wdst, xsrc, xdst)
            grp = s * WK + wk
            for j in range(N_SC):           # the scale pair, fp16x2 (s, s)
                scl[j] = nxt[j] | (nxt[j] << 16)
            if grp + WK < G:                  # the next slice's scales, a slice ahead
                load_scales(sc, rows, grp + WK, nxt)
            if grp < G:                       # the same for the whole warp
                group_mma(acc, rd + wk * W_BYTES + wn * TA * 1024,
                          rd + X_OFF + wk * X_BYTES + (wm * TB * 8 + lr) * 256,
                          xl16, la, g, shift, scl)
            wr = rd
            rd = rd + STAGE if rd != sbase + (STAGES - 1) * STAGE else sbase
        if WK > 1:
            # the wk > 0 warps' sums through shared memory (the ring is free once every warp is
            # past its last slice), added by the wk = 0 warp in a fixed order: deterministic
            cp_async_wait_group(0)
            cuda.syncthreads()
            red = cuda.shared.array(0, float32, alignment=ALIGN)  # the same memory
            if wk > 0:
                base = (((wk - 1) * WN + wn) * WM + wm) * NACC
                for r in range(NACC):
                    red[(base + r) * 32 + lane] = acc[r]
            cuda.syncthreads()
            if wk == 0:
                for w in range(1, WK):
                    base = (((w - 1) * WN + wn) * WM + wm) * NACC
                    for r in range(NACC):
                        acc[r] += red[(base + r) * 32 + lane]
        return nb, m0, wn, wm, wk, g, lane & 3

    def epilogue(out, bias, acc, nb, m0, m, wn, wm, g, t):
        """Lane (g, t) holds, for its tile a and token tile b, rows g, g+8 x tokens 2t, 2t+1:
        out[token, row] = the kind's function of it; one writer per element."""
        for a in range(HALF):
            _, ot = weight_tile(nb, wn * TA + a)
            if ot < NT_OUT:
                for hr in range(2):
                    row = ot * TILE + g + 8 * hr
                    bv = float32(0.0)
                    if BIAS:
                        bv = cvt_f32_f16(ld_global_nc_u16(bias, row))
                    for b in range(TB):
                        tok = m0 + wm * TB * 8 + 8 * b + 2 * t
                        for c in range(2):
                            v = acc[(a * TB + b) * 4 + 2 * hr + c]
                            if tok + c < m:
                                if GATE_UP:
                                    u = acc[((a + HALF) * TB + b) * 4 + 2 * hr + c]
                                    y = v / (float32(1.0) + math.exp(-v)) * u
                                    st_global_u16(out, (tok + c, row), cvt_rn_f16_f32(y))
                                elif RESIDUAL:
                                    out[tok + c, row] += v
                                else:
                                    out[tok + c, row] = v + bv

    mainloop, epilogue = dev(mainloop), dev(epilogue)

    if BIAS:
        def kernel(xf, qw, sc, bias, out, m, band):
            acc = cuda.local.array(NACC, float32)
            nb, m0, wn, wm, wk, g, t = mainloop(acc, xf, qw, sc, m, band)
            if wk == 0:
                epilogue(out, bias, acc, nb, m0, m, wn, wm, g, t)
        sig = ("void(float16[::1], uint32[::1], float16[::1], float16[::1], "
               "float32[:, ::1], int32, int32)")
    else:
        def kernel(xf, qw, sc, out, m, band):
            acc = cuda.local.array(NACC, float32)
            nb, m0, wn, wm, wk, g, t = mainloop(acc, xf, qw, sc, m, band)
            if wk == 0:
                epilogue(out, sc, acc, nb, m0, m, wn, wm, g, t)
        out_t = "float16" if GATE_UP else "float32"
        sig = (f"void(float16[::1], uint32[::1], float16[::1], {out_t}[:, ::1], int32, "
               f"int32)")
    name = kernel_name("gemm", kind=kind, n=n, k=k, layout=layout_tag(layout), tiles=tiles.tag())
    return kernel, sig, name
