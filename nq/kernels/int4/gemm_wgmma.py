"""The prefill GEMM on wgmma (sm_90a): INT4 weights dequantised in registers as the A operand,
fp16 activations as B from 128B-swizzled shared memory, fp32 accumulators; same interface and
epilogues as nq/kernels/int4/gemm.py's mma.sync kernel (which stays the default and the
small-M path: gemm.make_gemm(..., backend="wgmma") runs this one for M > WGMMA_MIN_M).

Why.  mma.sync peaks at ~450 TFLOP/s through numba on the H200 and the mma.sync GEMM reaches
~230 (28 layers: 28.5 ms at M = 512, 408 ms at 8192; cuBLAS' wgmma fp16: 9.5 / 161 ms).
`wgmma.mma_async.m64nNk16` is issued once per warpgroup for 64 x N x 16 (N = 128: 32x the work
of an m16n8k16) and runs asynchronously, so the warps dequantise the next k16 step while the
tensor cores multiply.

The block.  `wg` warpgroups (128 threads each) x `ta` m64 weight tiles a warpgroup x `bt`
tokens (the wgmma's N): 64 * ta * wg weight rows x bt tokens.  Warp w of a warpgroup holds
rows 16w .. 16w+15 of each of its m64 tiles -- exactly one 16-row tile of the uploaded
layouts -- so its A fragment of k16 chunk c is what the mma.sync kernel dequantises for that
tile (`dequant_word` on the "mma" layout, `gather_fragment` on the row layout), scaled by
`mul.rn.f16x2` (the scales folded in, as there).  gate_up: ta = 2, tile 0 the gate rows and
tile 1 the same rows of up, so the SwiGLU epilogue has both in the same thread.

    tiles     warpgroups x m64 tiles x tokens  stage (weights + x)  stages  smem    for
    WG_WIDE   2 x 2 x 128   256 rows           16 + 32 KB           4       193 KB  gate_up > 1024
    WG_TALL   2 x 1 x 128   128 rows           8 + 32 KB            4       161 KB  qkv, down,
                                                                                    gate_up
    WG_SHORT  2 x 1 x 64    128 rows           8 + 16 KB            4        97 KB  o_proj

(`DEFAULT_TILES` below has the measurements.)

The shared layouts.  A stage is one group (128 k).  Weights as gemm_kernel's copy plan puts
them (1 KB a 16-row tile; the mma layout's lane halves swapped for conflict-free ld.shared.v4).
Activations for wgmma's B, K-major with the 128B swizzle: the group's two 64-k halves are
two (bt x 128-byte) arrays; token r's 16-byte chunk c of a half at 16 * (c ^ (r % 8)) of its
128-byte row (the swizzle the hardware undoes on absolute addresses: the ring is 1024-aligned).
The descriptor of k16 chunk c: start = half (c // 4) + 32 (c % 4), SBO = 1024 (8 tokens),
LBO unused.  tests/ptx/test_wgmma_gpu.py checks this reading on the GPU in isolation.

The pipeline.  A `stages`-deep ring of cp.async.cg copies (every thread copies; no producer
warp), `stages - 2` groups ahead.  Per group:

    cp.async.wait_group(stages - 3); fence.proxy.async (cp.async writes -> wgmma's async
    proxy); bar.sync                          -- group s landed; group s - 2's buffer is free
    issue group s + stages - 2 into group s - 2's buffer
    for each k16 chunk c (8):  dequantise + scale the ta A fragments (from ld.shared words);
        wgmma.fence; ta x wgmma m64n{bt}k16; commit; wait_group(depth)

wait_group(depth) after each chunk keeps `depth` chunks' wgmmas in flight while the next
chunk's fragments are dequantised (ptxas keeps their A registers alive until then); it retires
chunk c - depth, so at chunk 0 of group s every read of group s - 1's buffer but its last
`depth` chunks' has retired -- hence the refill goes to group s - 2's buffer, which every
warpgroup has retired by the barrier (depth <= 4 < 8 chunks a group).

Registers (ptxas sm_90a, CUDA 13.0, 7B shapes; tests/kernels/int4/test_gemm_wgmma_cpu.py
prints them): WG_WIDE 224-228 (128 of them accumulators), WG_TALL 146; no spills, no local
memory, and no "wgmma serialized" note (ptxas serialises every wgmma of a kernel that holds a
call -- a 64-bit division or an IEEE fp32 division is one -- hence the (band, NB, bands) grid
and fastmath's div.approx in SwiGLU).  The accumulators never see a runtime index: zeroed and
stored to shared memory by single asm blocks (nq/ptx/wgmma.py), since LLVM does not unroll
128-iteration loops and would demote them to local memory.

M <= WGMMA_MIN_M (64; speculative verification's 4-16 tokens included) runs the mma.sync
kernel's SMALL / MEDIUM tiles unchanged: a 128-token wgmma tile would compute mostly padding.

Floor and prediction (written before the H200 ran it, 2026-12-01): the tensor pipe at
cuBLAS's ~750 TFLOP/s (its best 7B shapes here) is the floor: 28 layers ~9 ms at M = 512,
~143 ms at 8192.  Predicted: 450-550 TFLOP/s at M >= 2048 (the dequant, ~13 issue slots a
warp a chunk, hides under a 64-cycle m64n128k16 if two warpgroups alternate; cp.async by all
threads and one barrier a group cost ~10 %), ~350-400 at M = 512 (grid quantisation: 56-112
blocks of 132 SMs on o_proj/down) -- 28 layers ~14-17 ms at 512, ~200-240 ms at 8192.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from nq.config import GROUP_SIZE
from nq.kernels.build import compile_kernel, in_cache, kernel_name
from nq.kernels.common import allow_smem, dev
from nq.kernels.int4.dequant import dequant_word
from nq.kernels.int4.gemm_kernel import TILE, gather_fragment, layout_tag, row_piece_word
from nq.kernels.int4.gemm_launch import gemm_launch
from nq.ptx import (cp_async_cg_shared_global_16, cp_async_commit_group, cp_async_wait_group,
                    cvt_f32_f16, cvt_rn_f16_f32, cvta_to_shared_u32, fence_proxy_async_shared,
                    ld_global_nc_u16, ld_shared_v4_u32_at, mul_rn_f16x2, st_global_u16)
from nq.ptx.wgmma import (SWIZZLE_128B, desc_hi, wgmma_commit_group, wgmma_fence_acc,
                          wgmma_rs, wgmma_wait_group_acc, wgmma_zero_acc, acc_store_shared)

from nq.kernels.int4.wg_tiles import WgTiles, check, tiles_by_m

X_DESC_HI = desc_hi(16, 1024, SWIZZLE_128B)   # LBO unused (16), SBO = 8 rows of 128 bytes


@functools.lru_cache(maxsize=None)
def build_gemm_wgmma(kind: str, n: int, k: int, layout, tiles: WgTiles):
    """(kernel body, signature, name) of the wgmma GEMM of `kind` (N = n output features,
    gate_up: I) reading weights in `layout`; gemm.py's argument conventions."""
    check(kind, n, k, layout, tiles)
    TA, WGS, BT, STAGES, DEPTH = tiles.ta, tiles.wg, tiles.bt, tiles.stages, tiles.depth
    BW, TPB = tiles.rows, tiles.threads
    G = k // GROUP_SIZE
    K8 = k // 8
    GATE_UP = kind == "gate_up"
    RESIDUAL = kind in ("o_proj", "down")
    BIAS = kind == "qkv"
    MMA = layout == "mma"
    KS = 1 if MMA else layout[1]
    NT_OUT = n // TILE
    GU_SPLIT = GATE_UP and TA == 1         # gate_up: gate in warpgroups 0..WGS/2-1, up after
    HALF = TA // 2 if GATE_UP and not GU_SPLIT else TA   # output m64 tiles of a warpgroup
    OUT_TILES = tiles.out_tiles(kind)      # output 16-row tiles of a block
    W_BYTES = BW * GROUP_SIZE // 2
    X_OFF = W_BYTES
    X_HALF = BT * 128                      # one 64-k half of the group's activations
    STAGE = tiles.stage_bytes()
    PW = BW * 4 // TPB                     # 16-byte weight copies a thread a stage
    PX = BT * 16 // TPB
    AHEAD = STAGES - 2
    CP_PENDING = AHEAD - 1                 # cp.async groups left in flight at the wait
    NA = BT // 2                           # accumulators a thread a tile
    NACC = TA * NA
    N_AW, N_RW, N_SC, N_FR = 4 * TA, 8 * TA, 2 * TA, 4 * TA
    EPI_PITCH = BW + 4                     # fp32 a token row of the epilogue tile (+4: banks)
    EPI_U = 8                              # elements a thread writes out per batch
    OUT_ROWS = OUT_TILES * TILE            # output rows (features) of a block
    UP_COL = OUT_ROWS if GU_SPLIT else HALF * 64   # gate_up: up's column after the gate's
    mma0 = wgmma_rs(BT, 0)
    mma1 = wgmma_rs(BT, NA) if TA == 2 else mma0
    fence = wgmma_fence_acc(NACC)
    wait = wgmma_wait_group_acc(NACC)
    zero = wgmma_zero_acc(NACC)
    # acc[j] of tile a, chunk i, register r -> row 64a + g + 8 (r >> 1), token 8i + 2t + (r & 1)
    # of the thread's corner (row 16 w + g of its warpgroup's rows, token 2t) in the tile
    store_acc = acc_store_shared(tuple(
        4 * ((j // NA) * 64 + 8 * ((j % NA % 4) >> 1))
        + 4 * EPI_PITCH * (8 * ((j % NA) // 4) + (j % NA % 4 & 1)) for j in range(NACC)))
    XHI = X_DESC_HI

    def block_coords(m, band):
        """(nb, mb): the grid is (band, NB, bands), so blocks run in gemm_kernel's band order
        (the token blocks of a band fastest) with no runtime division (a 64-bit division is
        a subroutine call for ptxas, which then serialises every wgmma); blocks of the last
        band past the last token block have nothing to do (mb * BT >= m)."""
        return int32(cuda.blockIdx.y), int32(cuda.blockIdx.z) * band + int32(cuda.blockIdx.x)

    def weight_tile(nb, ti):
        """Block 16-row tile ti = (warpgroup * TA + a) * 4 + warp -> (the weight tile it reads,
        clamped, and its output tile, possibly past the end: not written)."""
        wgi = ti // (4 * TA)
        rem = ti - wgi * (4 * TA)
        a = rem >> 2
        w = rem & 3
        up = 0
        if GU_SPLIT:
            if wgi >= WGS // 2:
                up = 1
                wgi -= WGS // 2
        elif GATE_UP and a >= HALF:
            up = 1
            a -= HALF
        ot = nb * OUT_TILES + (wgi * HALF + a) * 4 + w
        return min(ot, NT_OUT - 1) + up * NT_OUT, ot

    def copy_plan(nb, tid, wsrc):
        """The weight copies' sources (the clamped tile makes them irregular) into wsrc; the
        destinations and the activation copies are affine in the copy index `it` (copy it of a
        thread is q = it * TPB + tid), so issue_stage recomputes them from a few scalars: eight
        64-bit addresses held in registers across the main loop cost ptxas more instructions a
        group (rematerialised after every barrier) than the affine forms do."""
        for it in range(PW):
            q = it * TPB + tid
            if MMA:
                gt, _ = weight_tile(nb, q >> 6)
                wsrc[it] = gt * G * 256 + (q & 63) * 4
            else:
                r = q >> 2
                gt, _ = weight_tile(nb, r >> 4)
                wsrc[it] = (gt * TILE + (r & 15)) * K8

    def issue_stage(xf, qw, buf, s, tid, wsrc, m0, m):
        if s < G:
            if MMA:      # 16-byte piece pc = tid % 64 of tile (it * TPB + tid) // 64
                ln = (tid & 63) >> 1
                wd = (tid >> 6) * 1024 + ln * 32 + 16 * ((tid & 1) ^ ((ln >> 2) & 1))
                for it in range(PW):
                    cp_async_cg_shared_global_16(buf + wd + it * (TPB >> 6) * 1024, qw,
                                                 wsrc[it] + s * 256)
            else:        # piece tid % 4 of row (it * TPB + tid) // 4, at 16 * q
                piece = row_piece(s, tid & 3, KS, G)
                for it in range(PW):
                    cp_async_cg_shared_global_16(buf + 16 * (it * TPB + tid), qw,
                                                 wsrc[it] + piece)
            # 16-byte chunk cc = tid % 16 of token r = (it * TPB + tid) // 16; r % 8 is the
            # same for every it (TPB // 16 is a multiple of 8), so is the swizzle
            cc = tid & 15
            r0 = tid >> 4
            xd = buf + X_OFF + (cc >> 3) * X_HALF + r0 * 128 + 16 * ((cc & 7) ^ (r0 & 7))
            xs = 8 * cc + s * GROUP_SIZE
            for it in range(PX):
                r = r0 + it * (TPB >> 4)
                cp_async_cg_shared_global_16(xd + it * (TPB >> 4) * 128, xf,
                                             min(m0 + r, m - 1) * k + xs)
        cp_async_commit_group()

    def load_scales(sc, rows, grp, out):
        for a in range(TA):
            out[2 * a] = uint32(ld_global_nc_u16(sc, rows[a] * G + grp))
            out[2 * a + 1] = uint32(ld_global_nc_u16(sc, (rows[a] + 8) * G + grp))

    def group_wgmma(acc, wb, dx, la, g, shift, scl):
        """acc += the warpgroup's tiles of one group x the block's tokens.  wb: this warp's
        first tile in the stage (tile a at + 4096 a); dx: the descriptor of the stage's
        activations (k16 chunk c at + (c // 4) * X_HALF / 16 + 2 (c % 4))."""
        aw = cuda.local.array(N_AW, uint32)
        rw = cuda.local.array(N_RW, uint32)
        fr = cuda.local.array(N_FR, uint32)
        for h in range(2):
            if MMA:
                for a in range(TA):
                    w0, w1, w2, w3 = ld_shared_v4_u32_at(wb + a * 4096 + (la ^ (16 * h)))
                    aw[4 * a] = w0
                    aw[4 * a + 1] = w1
                    aw[4 * a + 2] = w2
                    aw[4 * a + 3] = w3
            for p2 in range(2):
                i = 2 * h + p2
                if not MMA:
                    for a in range(TA):
                        base = wb + a * 4096 + g * 64 + 16 * i
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
                    for a in range(TA):
                        if MMA:
                            a0, a1, a2, a3 = dequant(aw[4 * a + 2 * p2 + j2])
                        else:
                            a0, a1, a2, a3 = gather(rw[8 * a + 2 * j2], rw[8 * a + 4 + 2 * j2],
                                                    rw[8 * a + 2 * j2 + 1],
                                                    rw[8 * a + 5 + 2 * j2], shift)
                        sg, sg8 = scl[2 * a], scl[2 * a + 1]
                        fr[4 * a] = mul_rn_f16x2(a0, sg)
                        fr[4 * a + 1] = mul_rn_f16x2(a1, sg8)
                        fr[4 * a + 2] = mul_rn_f16x2(a2, sg)
                        fr[4 * a + 3] = mul_rn_f16x2(a3, sg8)
                    d = dx + uint64((c >> 2) * (X_HALF >> 4) + 2 * (c & 3))
                    fence(acc)
                    mma0(acc, fr[0], fr[1], fr[2], fr[3], d, 1)
                    if TA == 2:
                        mma1(acc, fr[4], fr[5], fr[6], fr[7], d, 1)
                    wgmma_commit_group()
                    wait(acc, DEPTH)

    dequant, gather, row_piece = dev(dequant_word), dev(gather_fragment), dev(row_piece_word)
    block_coords, weight_tile, copy_plan, issue_stage, load_scales, group_wgmma = (
        dev(f) for f in (block_coords, weight_tile, copy_plan, issue_stage, load_scales,
                         group_wgmma))

    def mainloop(acc, xf, qw, sc, m, band):
        smem = cuda.shared.array(0, uint32)
        sraw = cvta_to_shared_u32(smem)
        sbase = (sraw + 1023) & 0xFFFFFC00          # the 128B swizzle repeats every 1024 B
        tid = int32(cuda.threadIdx.x)
        lane = tid & 31
        warp = tid >> 5
        wgi = warp >> 2
        w = warp & 3
        g = lane >> 2
        nb, mb = block_coords(m, band)
        m0 = mb * BT
        wsrc = cuda.local.array(PW, int32)
        copy_plan(nb, tid, wsrc)
        for s in range(AHEAD):
            issue_stage(xf, qw, sbase + s * STAGE, int32(s), tid, wsrc, m0, m)
        la = lane * 32 + 16 * ((lane >> 2) & 1)
        shift = uint32(4 * (lane & 3))
        rows = cuda.local.array(TA, int32)
        for a in range(TA):
            gt, _ = weight_tile(nb, (wgi * TA + a) * 4 + w)
            rows[a] = gt * TILE + g
        zero(acc)
        fence(acc)
        nxt = cuda.local.array(N_SC, uint32)
        scl = cuda.local.array(N_SC, uint32)
        load_scales(sc, rows, 0, nxt)
        last = sbase + (STAGES - 1) * STAGE
        rd = sbase
        wr = sbase + AHEAD * STAGE
        woff = (wgi * TA * 4 + w) * 1024
        for s64 in range(G):
            s = int32(s64)                    # (numba's range is int64: 64-bit address math)
            cp_async_wait_group(CP_PENDING)     # group s has landed (this thread's copies)
            fence_proxy_async_shared()        # .. visible to wgmma's async proxy
            cuda.syncthreads()                # .. everyone's; group s - 2's buffer is free
            issue_stage(xf, qw, wr, s + AHEAD, tid, wsrc, m0, m)
            for j in range(N_SC):
                scl[j] = nxt[j] | (nxt[j] << 16)
            if s + 1 < G:
                load_scales(sc, rows, s + 1, nxt)
            dx = uint64(XHI) | uint64(((rd + X_OFF) >> 4) & 0x3FFF)
            group_wgmma(acc, rd + woff, dx, la, g, shift, scl)
            rd = rd + STAGE if rd != last else sbase
            wr = wr + STAGE if wr != last else sbase
        wait(acc, 0)
        cp_async_wait_group(0)
        return nb, m0, wgi, w, g, lane & 3

    def epilogue(out, bias, acc, nb, m0, m, wgi, w, g, t):
        """Through shared memory (the ring is free once every warpgroup has retired its last
        wgmma): each thread puts its accumulators -- tile a, rows g, g+8 of 16-row tile w,
        tokens 8i + 2t (+1), wgmma's D layout -- into a (BT x EPI_PITCH) fp32 tile, at constant
        indices (a runtime index would put acc in local memory); then the block writes out
        token by token along the rows, coalesced: out[token, row] = the kind's function,
        one writer an element."""
        cuda.syncthreads()
        tile = cuda.shared.array(0, float32)
        traw = cvta_to_shared_u32(tile)
        tbase = (traw + 1023) & 0xFFFFFC00
        t0 = (tbase - traw) >> 2
        store_acc(acc, tbase + 4 * (2 * t * EPI_PITCH + wgi * TA * 64 + 16 * w + g))
        cuda.syncthreads()
        tid = int32(cuda.threadIdx.x)
        row0 = nb * (OUT_TILES * TILE)
        # EPI_U elements a thread a batch: every global load of the batch (the residual's old
        # value, the bias) is issued before any store.  One element at a time, each `out +=`
        # waited a full memory latency behind the store before it (the compiler cannot prove
        # they do not alias): ~25 us a block, as long as a K = 3584 main loop (H200, o_proj
        # against down at M = 8192, 2026-12-01).
        vals = cuda.local.array(EPI_U, float32)
        for e0 in range(tid, BT * OUT_ROWS, TPB * EPI_U):
            for j in range(EPI_U):
                e = e0 + j * TPB
                tok = e // OUT_ROWS
                o = e - tok * OUT_ROWS
                if GU_SPLIT:
                    lr = o                                # gate columns first, up OUT_ROWS on
                else:
                    wq = o // (HALF * 64)
                    rem = o - wq * (HALF * 64)
                    lr = (wq * TA) * 64 + rem             # the (gate) row of the tile
                row = row0 + o
                v = float32(0.0)
                if row < n and m0 + tok < m and e < BT * OUT_ROWS:
                    v = tile[t0 + tok * EPI_PITCH + lr]
                    if GATE_UP:
                        u = tile[t0 + tok * EPI_PITCH + lr + UP_COL]
                        v = v / (float32(1.0) + math.exp(-v)) * u
                    elif RESIDUAL:
                        v += out[m0 + tok, row]
                    elif BIAS:
                        v += cvt_f32_f16(ld_global_nc_u16(bias, row))
                vals[j] = v
            for j in range(EPI_U):
                e = e0 + j * TPB
                tok = e // OUT_ROWS
                row = row0 + e - tok * OUT_ROWS
                if row < n and m0 + tok < m and e < BT * OUT_ROWS:
                    if GATE_UP:
                        st_global_u16(out, (m0 + tok, row), cvt_rn_f16_f32(vals[j]))
                    else:
                        out[m0 + tok, row] = vals[j]

    mainloop, epilogue = dev(mainloop), dev(epilogue)

    if BIAS:
        def kernel(xf, qw, sc, bias, out, m, band):
            if (int32(cuda.blockIdx.z) * band + int32(cuda.blockIdx.x)) * BT >= m:
                return
            acc = cuda.local.array(NACC, float32)
            nb, m0, wgi, w, g, t = mainloop(acc, xf, qw, sc, m, band)
            epilogue(out, bias, acc, nb, m0, m, wgi, w, g, t)
        sig = ("void(float16[::1], uint32[::1], float16[::1], float16[::1], "
               "float32[:, ::1], int32, int32)")
    else:
        def kernel(xf, qw, sc, out, m, band):
            if (int32(cuda.blockIdx.z) * band + int32(cuda.blockIdx.x)) * BT >= m:
                return
            acc = cuda.local.array(NACC, float32)
            nb, m0, wgi, w, g, t = mainloop(acc, xf, qw, sc, m, band)
            epilogue(out, sc, acc, nb, m0, m, wgi, w, g, t)
        out_t = "float16" if GATE_UP else "float32"
        sig = (f"void(float16[::1], uint32[::1], float16[::1], {out_t}[:, ::1], int32, "
               f"int32)")
    name = kernel_name("gemm_wgmma", kind=kind, n=n, k=k, layout=layout_tag(layout),
                       tiles=tiles.tag())
    return kernel, sig, name


# ---- the launcher --------------------------------------------------------------------------------

# fastmath: SwiGLU's division becomes div.approx; an IEEE div.rn.f32 is a subroutine call, and
# ptxas serialises every wgmma of a kernel with a call in it (C7509 "Extern calls")
COMPILE_OPTIONS = {"fastmath": True}
WGMMA_MIN_M = 64                 # M at or below this runs the mma.sync kernel (SMALL / MEDIUM)
L2_BAND_BYTES = 16 << 20


@functools.lru_cache(maxsize=None)
def compiled(kind, n, k, layout, tiles):
    body, sig, name = build_gemm_wgmma(kind, n, k, layout, tiles)
    kern = compile_kernel(body, sig, name, **COMPILE_OPTIONS, launch_bounds=(tiles.threads,))
    allow_smem(kern, tiles.smem_bytes())
    return kern, name


def _flat(a):
    return a.reshape(int(np.prod(a.shape)))


class WgmmaGemm:
    """gemm.Gemm's interface: `g(x, qw, sc, [bias,] out, m, stream=0)`.  M <= min_m goes to
    `small` (gemm.make_gemm(..., backend="wgmma") passes the mma.sync Gemm), larger M -- or
    every M when small is None -- to the wgmma kernel with `tiles`."""

    def __init__(self, kind, n, k, layout, tiles=None, small=None, min_m=WGMMA_MIN_M):
        self.kind, self.n, self.k, self.layout = kind, n, k, layout
        # ((max_m, tiles), ...): `tiles` alone runs every M; by default DEFAULT_TILES' table
        self.table = ((None, tiles),) if tiles is not None else tiles_by_m(kind)
        for _, t in self.table:
            check(kind, n, k, layout, t)
        self.small, self.min_m = small, min_m
        self.w_rows = 2 * n if kind == "gate_up" else n
        self._memo = {}   # checked launch arguments by buffer set (gemm_launch.gemm_launch)

    def pick(self, m):
        """(tiles, kernel, name) that run m tokens (compiled, or loaded from the kernel cache,
        the first time an M needs them), as gemm.Gemm.pick."""
        if self.small is not None and m <= self.min_m:
            return self.small.pick(m)
        t = self.tiles_for(m)
        return (t,) + compiled(self.kind, self.n, self.k, self.layout, t)

    def tiles_for(self, m) -> WgTiles:
        for max_m, t in self.table:
            if max_m is None or m <= max_m:
                return t
        return self.table[-1][1]

    def prepare(self) -> int:
        """Compile now every kernel of this GEMM not in the kernel cache -- the mma.sync tiles
        for small M and the wgmma kernels of its table -- as gemm.Gemm.prepare (a cached one
        loads at its first use); returns how many compiled."""
        n = self.small.prepare(up_to=self.min_m) if self.small is not None else 0
        for _, t in self.table:
            body, sig, name = build_gemm_wgmma(self.kind, self.n, self.k, self.layout, t)
            if not in_cache(body, sig, name, **COMPILE_OPTIONS, launch_bounds=(t.threads,)):
                compiled(self.kind, self.n, self.k, self.layout, t)
                n += 1
        return n

    def grid(self, m):
        """(grid, band): (band, NB, bands) blocks -- band token blocks (as many as keep band x
        bt x K fp16 within L2_BAND_BYTES) x NB weight blocks x ceil(mt / band) bands."""
        t = self.tiles_for(m)
        nb = -(-(self.n // TILE) // t.out_tiles(self.kind))
        mt = -(-m // t.bt)
        band = max(1, min(mt, L2_BAND_BYTES // (t.bt * self.k * 2)))
        return (band, nb, -(-mt // band)), band

    def __call__(self, x, qw, sc, *rest, stream=0):
        m = int(rest[-1])
        if self.small is not None and m <= self.min_m:
            return self.small(x, qw, sc, *rest, stream=stream)
        bias = rest[0] if self.kind == "qkv" else None
        out = rest[-2]
        t = self.tiles_for(m)
        kern, name = compiled(self.kind, self.n, self.k, self.layout, t)
        fast = gemm_launch(self, name, kern, m, x, qw, sc, bias, out)
        if fast is None:      # m = 0: checked, nothing to launch
            return
        grid, band = self.grid(m)
        fast(grid, t.threads, stream, t.smem_bytes(), m, band)
