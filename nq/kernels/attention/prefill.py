"""Causal prefill attention on the tensor cores, reading K/V straight from the paged cache.

Prefill runs a chunk of M prompt tokens (positions start..start+M-1) through a layer at once:
rmsnorm_rows -> qkv GEMM -> rope_kv_rows (rotated q; K/V into the pages) -> this kernel ->
o_proj GEMM.  Query token i attends to keys 0..start+i, all already in the cache, so a chat
turn continuing a context is the same launch with start > 0.  M and start are launch
arguments: one compiled kernel per head shape serves every chunk.

CTA (kv head h, tile of T query tokens), WARPS=8 warps, 16 query rows a warp.  The 128 rows
are (token, head) pairs of h's GQA group: row r is token r // G, query head h*G + r % G
(q[t, h*G:(h+1)*G] is contiguous, so is o's row).  At G = 7, T = 18 tokens fill 126 rows.
Why stack the group: every K/V tile staged in shared memory serves all G heads, so L2->SM
traffic is 1/128 of a K/V byte per row (compute-bound at ~2.5 TB/s of L2 for 300 TFLOP/s;
64-row CTAs would need 5 TB/s), and a short chunk still fills the rows: one query head a CTA
would need M >= 128 per CTA and re-read each tile from L2 once per head.  Grid (Hkv,
ceil(M/T)), the CTAs with the latest tokens (the longest rows) first, so the short ones fill
the tail.  Warp w's rows need keys 0..its last position: it skips the tiles past it, and a
warp of padding rows only helps load.

K/V tiles: 64 keys (4 pages) of K and of V, NSTAGE=3 stages in dynamic shared memory (32 KiB
a stage at d128: 96 KiB + 256 B of alignment slack; d64 half).  Every thread issues 16-byte
cp.async copies (8 a tile at d128: chunk tid % 16 of rows tid // 16 + 16 i of K and V), with
an XOR swizzle (chunk c of row r at c ^ (r % 8)) so the 8 rows an ldmatrix phase reads fall in
8 bank groups; a bulk copy of a page keeps the pool's layout, whose 256-byte rows put those 8
rows in one bank group (8-way conflicts), and bulk copies per row are issue-bound (decode.py's
table).  Rows at or past start + M are zero filled by the copy (src-size 0, nothing read):
stale slots of the last page may hold NaN, and 0 x NaN is NaN in the tensor core.
Pipeline: tiles 0..NSTAGE-2 in flight at the start; per tile j, cp.async.wait_group
(NSTAGE-2) and one __syncthreads (tile j landed for every thread; tile j-1's stage read by
every warp), then the copies of tile j+NSTAGE-1 into that stage, then tile j's math.

A warp's tile (fragments as nq/ptx/mma.py): S = Q K^T is 16 x 64, 8 key n-tiles x D/16
k-steps = 64 mma (d128), fed by 32 ldmatrix.x4 of K (one per k-step and 16 keys); Q's A
fragments stay in registers for the whole CTA.  The k-step address is (row base + 16 (c ^ row
% 8)) ^ 32 k: one xor with an immediate.  Causal mask (key > the row's position -> -1e30,
finite), row max over the lane quad (2 shuffles), online softmax in the log2 domain (q is
pre-scaled by log2(e)/sqrt(D), exp2 = ex2.approx; m and the lane's share of l in fp32, the
quad's l summed at the end), O rescaled by exp2(m_old - m_new).  O += P V: P's A fragments
are S's C fragments repacked to fp16 in registers (FlashAttention-2), V's B fragments come
from ldmatrix.x4.trans, 4 k-steps x D/8 dim n-tiles = 64 mma.  Every row sees key 0 in tile
0, so m is a real score from then on and a fully masked row of a later tile gets p = 0.
Padding rows (past the CTA's tokens, or G not dividing 128) have q = 0 and see every cached
key: finite, never stored.

Registers (ptxas, numba-cuda 0.30 / CUDA 13.0): 229 at d128 (64 O + 32 S + 32 Q fragments),
165 at d64; no spills, no local memory; 256 threads at <= 255 registers is one CTA an SM,
which 96 KiB of stages asks for anyway.

Precision.  q arrives fp32 (rope_kv_rows writes what decode's rope_kv writes, bit for bit;
its bytes are nothing next to K/V) and is rounded once, to fp16(q * log2(e)/sqrt(D)); K and
V are the cache's fp16; S and O accumulate in fp32; P goes to the P V mma as fp16, as in
every fp16 flash attention (decode.py splits P into hi + lo fp16 because its fragment rows
8-15 were idle; here all 16 are real rows and the split would double the P V mma); l sums
the fp32 p.  tests/kernels/attention/test_prefill_attn_gpu.py's `tolerance` derives the
bound: ~2^-11 (max|v| + |o|) against the float64 reference of the fp16-rounded q.

Measured on the H200 (7B shape, one layer, median of 5, clocks not locked; TFLOP/s of the
causal work 4 D Hq sum(start + i + 1); two runs, which differ by up to ~10%):

    m     start    8 warps x 3 stages       8 x 2             4 x 2 (2 CTAs an SM)
    512       0    0.072 ms   26 TFLOP/s    0.074 ms  26      0.069 ms  27
    2048      0    0.195     154            0.195    154      0.204    148
    2048   6144    1.04      203            1.02     207      1.00     211
    2048  30000    4.34      210            4.17     218      4.07     224

so an 8K prompt's attention (13.5 TFLOP, four 2048 chunks) is ~70 ms over 28 layers and
32K's (215 TFLOP) ~1 s: ~47 % of the ~450 TFLOP/s mma.sync peak (DEVICE.md).  Not kept:
skipping the mask on interior tiles (a warp-uniform branch around the 32 compare/selects a
lane) measured within that noise; 4 warps x 3 stages likewise (220 TFLOP/s at 30000).  Known
gap: a short chunk at depth (16 tokens at start 30000: 0.86-1.2 ms/layer, a grid of 4 CTAs)
wants the KV range split across CTAs as decode does; the next step past ~50 % of peak is
wgmma (sm_90a) with producer/consumer warps instead of a __syncthreads per tile.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda  # a module global: the simulator swaps it for its fake module
from numba.cuda.types import float32, int32, uint32

from nq.kernels.fastlaunch import FastLaunch
from nq.kernels.build import compile_kernel, kernel_name
from nq.paged import PAGE, check_paged_args

WARPS = 8          # warps a CTA, 16 query rows each: 128 rows share every K/V tile
BN = 64            # keys a tile (4 pages): S is 16 x 64 a warp, 32 fp32 registers a lane
NSTAGE = 3         # K/V tiles in flight (cp.async groups); 32 KiB a stage at head_dim 128
ALIGN = 256        # stage base alignment: the swizzle's xor must not carry into the row base
LOG2E = 1.4426950408889634
NEG_BIG = -1e30    # finite "-inf": exp2(NEG_BIG - m) == 0, and NEG_BIG - NEG_BIG is not NaN


# ---- NumPy models --------------------------------------------------------------------------------

def prefill_attention_reference(q, k, v, start: int) -> np.ndarray:
    """q (M, Hq, D), k and v (S, Hkv, D) holding positions 0..S-1 (S >= start + M) -> o
    (M, Hq, D) float64: query i (position start + i) attends to keys 0..start + i, query head h
    to kv head h // (Hq / Hkv), scale 1/sqrt(D); computed in float64 from the values given."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    m, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    s = np.einsum("ihd,jhd->hij", q, np.repeat(k, g, axis=1)) / math.sqrt(d)   # (Hq, M, S)
    masked = np.arange(k.shape[0])[None, :] > (start + np.arange(m))[:, None]
    s = np.where(masked[None], -np.inf, s)
    p = np.exp(s - s.max(axis=2, keepdims=True))
    p /= p.sum(axis=2, keepdims=True)
    return np.einsum("hij,jhd->ihd", p, np.repeat(v, g, axis=1))


def rounded_q(q, head_dim: int) -> np.ndarray:
    """q (float32) as the kernel multiplies it: fp16(q * log2(e)/sqrt(D)), scaled back, float64.
    The reference of these values leaves only the kernel's own roundings (fp16 P, fp16 o, fp32
    accumulation) to the tolerance."""
    scale = np.float32(LOG2E / math.sqrt(head_dim))
    q16 = (np.asarray(q, np.float32) * scale).astype(np.float16)
    return q16.astype(np.float64) / float(scale)


def tokens_per_cta(gqa: int, warps: int = WARPS) -> int:
    """Query tokens a CTA takes: its 16 x warps rows are (token, head of the group) pairs."""
    return 16 * warps // gqa


def chunk_offset(row: int, chunk: int, head_dim: int) -> int:
    """Byte offset of 16-byte chunk `chunk` (dims 8c..8c+7) of token row `row` in a K or V
    tile of shared memory: rows of 2*head_dim bytes, chunk c stored at c ^ (row % 8)."""
    return row * 2 * head_dim + ((chunk ^ (row % 8)) * 16)


def smem_bytes(head_dim: int, nstage: int = NSTAGE) -> int:
    """Dynamic shared memory: nstage x (K tile + V tile), plus slack to align them to 256
    bytes (numba declares the dynamic array `.align 4`)."""
    return nstage * 2 * BN * 2 * head_dim + ALIGN


# ---- kernel --------------------------------------------------------------------------------------

def out_body(head_dim: int):
    """The epilogue both prefill kernels end with (this one's and prefill_wgmma's): a lane's
    two rows (g and g + 8 of its m16 tile: tokens tk0 / tk1, heads h0 / h1) finish their sums
    l over the quad, and their O accumulators (acc's C-fragment order) go to o scaled by 1 / l,
    as fp16 pairs; ok0 / ok1 say which rows hold a token of the chunk.  A plain function: the
    kernels wrap it in `dev`."""
    from nq.ptx import pack_f16x2_from_f32
    D, NTO, FULL = head_dim, head_dim // 8, 0xFFFFFFFF

    def store_out(o, acc, l0, l1, h0, h1, t, tk0, tk1, ok0, ok1):
        l0 += cuda.shfl_xor_sync(FULL, l0, 1)
        l1 += cuda.shfl_xor_sync(FULL, l1, 1)
        l0 += cuda.shfl_xor_sync(FULL, l0, 2)
        l1 += cuda.shfl_xor_sync(FULL, l1, 2)
        inv0 = float32(1.0) / l0
        inv1 = float32(1.0) / l1
        c0 = h0 * (D // 2) + t
        c1 = h1 * (D // 2) + t
        for jd in range(NTO):
            if ok0:
                o[tk0, c0 + 4 * jd] = pack_f16x2_from_f32(acc[4 * jd] * inv0,
                                                         acc[4 * jd + 1] * inv0)
            if ok1:
                o[tk1, c1 + 4 * jd] = pack_f16x2_from_f32(acc[4 * jd + 2] * inv1,
                                                         acc[4 * jd + 3] * inv1)

    return store_out


def _name(gqa, head_dim, num_kv, warps, nstage):
    return kernel_name("prefill_attn", g=gqa, d=head_dim, kv=num_kv, w=warps, st=nstage)


@functools.cache
def _prefill_kernel(gqa: int, head_dim: int, num_kv: int, warps: int, nstage: int):
    """The kernel body for one head shape; see the module doc."""
    from nq.kernels.common import dev
    from nq.ptx import (cp_async_cg_shared_global_16_zfill, cp_async_commit_group,
                        cp_async_wait_group, cvta_to_shared_u32_at, griddepcontrol_wait,
                        ldmatrix_x4, ldmatrix_x4_trans, mma_sync_m16n8k16_f16_f32,
                        pack_f16x2_from_f32)

    G, D, NW, NST = gqa, head_dim, warps, nstage
    T = tokens_per_cta(G, NW)          # query tokens a CTA
    assert T >= 1, f"gqa {G} needs more than {NW} warps"
    NTH = 32 * NW
    KS = D // 16                       # k-steps of S = Q K^T; dim pairs of O += P V
    NTO = D // 8                       # dim n-tiles of O
    NTS = BN // 8                      # key n-tiles of S
    KB = BN // 16                      # 16-key blocks of a tile: ldmatrix of K, k-steps of P V
    RB = 2 * D                         # bytes of a token row
    CPR = D // 8                       # 16-byte chunks of a row
    RPP = NTH // CPR                   # rows a copy pass covers
    PASSES = BN // RPP
    assert NTH % CPR == 0 and BN % RPP == 0
    VOFF = BN * RB                     # V tile after the K tile in a stage
    STAGE = 2 * BN * RB
    PENDING = NST - 2                  # copy groups left in flight when a tile is consumed
    QW, AW, SW = 4 * KS, 4 * NTO, 4 * NTS   # local array sizes (registers after unrolling)
    QSCALE = float32(LOG2E / math.sqrt(D))
    NEG = float32(NEG_BIG)
    ZERO = float32(0.0)
    Z = uint32(0)
    FULL = 0xFFFFFFFF
    PG = PAGE

    def load_tile(kv, table, kvh, sbase, pos0, kv_len, last_pg, tid):
        """Issue this thread's cp.async copies of the K and V tile of keys pos0..pos0+BN-1
        (pos0 a multiple of BN) into the stage at shared address sbase; rows at or past kv_len
        are zero filled and read nothing."""
        c = tid % CPR
        rr = tid // CPR
        for i in range(PASSES):
            row = rr + RPP * i
            p = pos0 + row
            pid = table[min(p // PG, last_pg)]
            nbytes = uint32(16) if p < kv_len else Z
            off = row * RB + ((c ^ (row % 8)) * 16)
            cp_async_cg_shared_global_16_zfill(sbase + off, kv, (pid, kvh, 0, p % PG, 8 * c), nbytes)
            cp_async_cg_shared_global_16_zfill(sbase + VOFF + off, kv, (pid, kvh, 1, p % PG, 8 * c), nbytes)

    load_tile = dev(load_tile)
    store_out = dev(out_body(D))

    def prefill_attn(q, kv, table, o, start, m):
        # q (M_max, HQ, D) f32; kv (n_pages, HKV, 2, 16, D) f16; table (max_pages,) int32
        # o (M_max, HQ*D/2) uint32 = fp16 pairs; start, m: the chunk (keys 0..start+m-1 cached)
        smu = cuda.shared.array(0, uint32)     # NST stages of [K tile | V tile], swizzled rows
        qf = cuda.local.array(QW, uint32)      # A fragments of Q (fp16, pre-scaled), per k-step
        acc = cuda.local.array(AW, float32)    # O C fragments: [dim n-tile][c0..c3]
        sc = cuda.local.array(SW, float32)     # S C fragments: [key n-tile][c0..c3], then P
        griddepcontrol_wait()   # PDL (nq/ptx/griddep.py): q and the chunk's K/V come from upstream
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        kvh = cuda.blockIdx.x
        t0 = (cuda.gridDim.y - 1 - cuda.blockIdx.y) * T   # the longest rows start first
        n_tok = min(T, m - t0)
        kv_len = start + m                     # keys in the cache, every one finite
        n_tiles = (start + t0 + n_tok + BN - 1) // BN
        last_pg = (kv_len - 1) // PG
        sm0 = cvta_to_shared_u32_at(smu, 0)
        stage0 = sm0 + (ALIGN - sm0 % ALIGN) % ALIGN

        # This lane's two rows (g and g + 8 of the warp's 16): row r is token r // G of the
        # CTA, head r % G of kv head kvh.  Padding rows (past the CTA's tokens) get q = 0 and
        # see every cached key: finite, never stored.
        r0 = 16 * warp + g
        r1 = r0 + 8
        ok0 = r0 // G < n_tok
        ok1 = r1 // G < n_tok
        tk0 = t0 + min(r0 // G, n_tok - 1)
        tk1 = t0 + min(r1 // G, n_tok - 1)
        h0 = kvh * G + r0 % G
        h1 = kvh * G + r1 % G
        qp0 = start + tk0 if ok0 else kv_len - 1   # row 0 sees keys 0..qp0
        qp1 = start + tk1 if ok1 else kv_len - 1
        w_tok0 = (16 * warp) // G                  # warp-uniform: the warp's first token
        w_active = w_tok0 < n_tok
        w_last = start + t0 + min((16 * warp + 15) // G, n_tok - 1)   # its last position

        for ks in range(KS):
            for half in range(2):                 # a0/a1 (dims 2t..), a2/a3 (dims 8+2t..)
                d = 16 * ks + 8 * half + 2 * t
                x0 = pack_f16x2_from_f32(q[tk0, h0, d] * QSCALE, q[tk0, h0, d + 1] * QSCALE)
                x1 = pack_f16x2_from_f32(q[tk1, h1, d] * QSCALE, q[tk1, h1, d + 1] * QSCALE)
                qf[4 * ks + 2 * half] = x0 if ok0 else Z
                qf[4 * ks + 2 * half + 1] = x1 if ok1 else Z
        for i in range(AW):
            acc[i] = ZERO
        m0 = NEG
        m1 = NEG
        l0 = ZERO
        l1 = ZERO
        # This lane's ldmatrix rows.  Chunk 2k + c of a row sits at (2k + c) ^ (row % 8) =
        # (c ^ row % 8) ^ 2k, and a stage starts 256-byte aligned with rows of 128 or 256
        # bytes, so the address of k-step k is (row base + 16 (c ^ row % 8)) ^ 32k: one xor
        # with an immediate per ldmatrix, the 16-key block offsets (4 KiB) added after it.
        x = lane % 8                  # = row % 8 of every row the lane addresses
        kfrag = ((lane % 8) + 8 * (lane // 16)) * RB + ((lane // 8) % 2 ^ x) * 16
        vfrag = ((lane % 8) + 8 * ((lane // 8) % 2)) * RB + ((lane // 16) ^ x) * 16 + VOFF
        for s in range(NST - 1):
            if s < n_tiles:
                load_tile(kv, table, kvh, stage0 + s * STAGE, s * BN, kv_len, last_pg, tid)
            cp_async_commit_group()
        for j in range(n_tiles):
            cp_async_wait_group(PENDING)    # this thread's copies of tile j have landed
            cuda.syncthreads()             # everyone's; and tile j-1's stage is read by all
            jn = j + NST - 1
            if jn < n_tiles:
                load_tile(kv, table, kvh, stage0 + (jn % NST) * STAGE, jn * BN, kv_len,
                          last_pg, tid)
            cp_async_commit_group()        # an empty group past the end keeps the count
            pos0 = j * BN
            if w_active and pos0 <= w_last:   # warp-uniform: skip tiles all past the warp
                sb = stage0 + (j % NST) * STAGE
                for i in range(SW):
                    sc[i] = ZERO
                kbase = sb + kfrag
                for ks in range(KS):
                    a0, a1, a2, a3 = qf[4 * ks], qf[4 * ks + 1], qf[4 * ks + 2], qf[4 * ks + 3]
                    kaddr = kbase ^ (32 * ks)
                    for kb in range(KB):
                        b0, b1, b2, b3 = ldmatrix_x4(kaddr + kb * 16 * RB)
                        i = 8 * kb
                        sc[i], sc[i + 1], sc[i + 2], sc[i + 3] = mma_sync_m16n8k16_f16_f32(
                            a0, a1, a2, a3, b0, b1, sc[i], sc[i + 1], sc[i + 2], sc[i + 3])
                        sc[i + 4], sc[i + 5], sc[i + 6], sc[i + 7] = mma_sync_m16n8k16_f16_f32(
                            a0, a1, a2, a3, b2, b3, sc[i + 4], sc[i + 5], sc[i + 6], sc[i + 7])
                # Causal mask: key pos0 + 8nt + 2t + e is visible to row 0 iff <= qp0.  Keys
                # past kv_len were zero filled (finite) and lie past every qp.
                lim0 = int32(qp0 - pos0 - 2 * t)   # 32-bit compares below
                lim1 = int32(qp1 - pos0 - 2 * t)
                mx0 = NEG
                mx1 = NEG
                for nt in range(NTS):
                    for e in range(2):
                        i = 4 * nt + e
                        col = int32(8 * nt + e)
                        v0 = sc[i] if col <= lim0 else NEG
                        v1 = sc[i + 2] if col <= lim1 else NEG
                        sc[i] = v0
                        sc[i + 2] = v1
                        mx0 = max(mx0, v0)
                        mx1 = max(mx1, v1)
                # row max over the quad holding the row (lanes 4g..4g+3)
                mx0 = max(mx0, cuda.shfl_xor_sync(FULL, mx0, 1))
                mx1 = max(mx1, cuda.shfl_xor_sync(FULL, mx1, 1))
                mx0 = max(mx0, cuda.shfl_xor_sync(FULL, mx0, 2))
                mx1 = max(mx1, cuda.shfl_xor_sync(FULL, mx1, 2))
                # Every row sees key 0 in tile 0, so m is a real score from then on and a
                # fully masked row of a later tile gets p = exp2(NEG - m) = 0.
                mn0 = max(m0, mx0)
                mn1 = max(m1, mx1)
                al0 = math.exp2(m0 - mn0)
                al1 = math.exp2(m1 - mn1)
                m0 = mn0
                m1 = mn1
                ps0 = ZERO
                ps1 = ZERO
                for nt in range(NTS):
                    for e in range(2):
                        i = 4 * nt + e
                        p0 = math.exp2(sc[i] - mn0)
                        p1 = math.exp2(sc[i + 2] - mn1)
                        sc[i] = p0
                        sc[i + 2] = p1
                        ps0 += p0
                        ps1 += p1
                l0 = l0 * al0 + ps0     # this lane's share; the quad is summed at the end
                l1 = l1 * al1 + ps1
                for jd in range(NTO):
                    acc[4 * jd] *= al0
                    acc[4 * jd + 1] *= al0
                    acc[4 * jd + 2] *= al1
                    acc[4 * jd + 3] *= al1
                # O += P V: P's A fragments are S's C fragments repacked to fp16 in registers
                # (key n-tiles 2kb, 2kb+1 are k-step kb), V's B fragments by ldmatrix.trans.
                for kb in range(KB):
                    i = 8 * kb
                    pa0 = pack_f16x2_from_f32(sc[i], sc[i + 1])
                    pa1 = pack_f16x2_from_f32(sc[i + 2], sc[i + 3])
                    pa2 = pack_f16x2_from_f32(sc[i + 4], sc[i + 5])
                    pa3 = pack_f16x2_from_f32(sc[i + 6], sc[i + 7])
                    vaddr = sb + vfrag + kb * 16 * RB
                    for db in range(KS):
                        v0, v1, v2, v3 = ldmatrix_x4_trans(vaddr ^ (32 * db))
                        jd = 8 * db
                        acc[jd], acc[jd + 1], acc[jd + 2], acc[jd + 3] = \
                            mma_sync_m16n8k16_f16_f32(pa0, pa1, pa2, pa3, v0, v1, acc[jd],
                                                      acc[jd + 1], acc[jd + 2], acc[jd + 3])
                        acc[jd + 4], acc[jd + 5], acc[jd + 6], acc[jd + 7] = \
                            mma_sync_m16n8k16_f16_f32(pa0, pa1, pa2, pa3, v2, v3, acc[jd + 4],
                                                      acc[jd + 5], acc[jd + 6], acc[jd + 7])

        if w_active:
            store_out(o, acc, l0, l1, h0, h1, t, tk0, tk1, ok0, ok1)

    return prefill_attn


SIG = "void(float32[:, :, ::1], float16[:, :, :, :, ::1], int32[::1], uint32[:, ::1], int32, int32)"


@functools.cache
def _jit(gqa, head_dim, num_kv, warps, nstage):
    body = _prefill_kernel(gqa, head_dim, num_kv, warps, nstage)
    return compile_kernel(body, SIG, _name(gqa, head_dim, num_kv, warps, nstage),
                          launch_bounds=(32 * warps,), fastmath=True)


# ---- launcher ------------------------------------------------------------------------------------

def check_arrays(cfg, q, kv_layer, table, o) -> None:
    """The arrays every prefill attention launcher takes (their contract is below)."""
    from nq.kernels.common import need
    hq, d = cfg.num_heads, cfg.head_dim
    need(q, "prefill attention: q", np.float32, (q.shape[0], hq, d))
    need(o, "prefill attention: o", np.float16, (q.shape[0], hq * d))
    check_paged_args("prefill attention", cfg, kv_layer, table, table)  # no state here


def paged_launch(cfg, q, kv_layer, table, o, kern, nbytes: int, tpc: int, threads: int):
    """`launch(m, start, stream=0)` of a compiled prefill attention kernel: a grid of (kv heads,
    ceil(m / tpc)) CTAs of `threads`, `nbytes` of dynamic shared memory, its parameters built
    once (FastLaunch); m and start are checked against q's rows and the block table's reach."""
    from nq.kernels.common import allow_smem
    allow_smem(kern, nbytes)
    m_max, hkv = q.shape[0], cfg.num_kv_heads
    max_pos = table.shape[0] * PAGE
    o32 = o.view(np.uint32)        # fp16 pairs: one 4-byte store per two dims
    fast = FastLaunch(kern, q, kv_layer, table, o32, 0, 0)

    def launch(m, start, stream=0):
        m, start = int(m), int(start)
        if not 1 <= m <= m_max or start < 0 or start + m > max_pos:
            raise ValueError(f"prefill attention: m={m}, start={start}: want 1 <= m <= {m_max} "
                             f"and start + m <= {max_pos} (the block table's reach)")
        fast((hkv, -(-m // tpc)), threads, stream, nbytes, start, m)

    return launch


def prefill_attention_launcher(cfg, q, kv_layer, table, o, *, warps: int = WARPS,
                               nstage: int = NSTAGE):
    """Check the arrays once; return `launch(m, start, stream=0)`, which attends the m query
    rows q[:m] (positions start..start+m-1, rotated; their K/V already in the cache) to keys
    0..start+i and writes o[:m].

    q (M_max, num_heads, head_dim) float32; o (M_max, num_heads*head_dim) float16 (o_proj's
    input); kv_layer (n_pages, num_kv_heads, 2, 16, head_dim) float16; table int32 block table
    (positions 0..start+m-1 must be mapped).  One compiled kernel serves every m and start."""
    check_arrays(cfg, q, kv_layer, table, o)
    if warps not in (2, 4, 8) or not 2 <= nstage <= 6:
        raise ValueError(f"prefill attention: unsupported warps={warps}, nstage={nstage}")
    if tokens_per_cta(cfg.gqa_ratio, warps) < 1:
        raise ValueError(f"prefill attention: {cfg.gqa_ratio} query heads a kv head need more "
                         f"than {warps} warps (16 rows each)")
    kern = _jit(cfg.gqa_ratio, cfg.head_dim, cfg.num_kv_heads, warps, nstage)
    return paged_launch(cfg, q, kv_layer, table, o, kern, smem_bytes(cfg.head_dim, nstage),
                        tokens_per_cta(cfg.gqa_ratio, warps), 32 * warps)
