"""Paged-attention decode split kernel on tensor cores: one K/V page shared by all G query heads.

attn_decode's attn_split is compute-bound: each of its G consumer warps re-reads and converts
every page in fp32 (30.6 us/layer at 8K context against a 4 us byte floor, docs/KERNELS_ATTN.md
"Diagnosis").  Here one consumer warp multiplies a page against all G heads of its kv head with
`mma.sync.m16n8k16` (fp16 in, fp32 accumulate), so a page costs D/16 + D/8 + 1 mma and D/8
ldmatrix per warp instead of G x (64 ld.shared + 128 cvt + 128 FMA) per lane.  Same pool
layout, split plan, log2-domain partials and launcher contract as attn_decode; the partials are
merged by attn_decode's attn_combine, unchanged -- or, fused, by the split kernel itself (below).

CTA (split, kv head h): warp 0..NC-1 consumers, warp NC the producer.  A stage holds NC pages;
consumer c takes page c of every stage and keeps its own (m, l, acc) for the G heads.  The
producer's lanes each issue one `cp.async.bulk` of `rows_per_copy` token rows (K rows 0-15 then
V rows 16-31 of the page) into PADDED shared rows: row r of a page slot sits at
r*2D + (r // rows_per_copy)*16 bytes, so at rows_per_copy=1 the 8 rows an ldmatrix phase reads
fall in 8 different 16-byte bank groups (no conflict; 2**k rows per copy = 2**k-way conflict,
fewer copies).  Full mbarriers (one arrive.expect_tx per stage + the copies' complete_tx) and
empty mbarriers (every consumer thread arrives) as in attn_decode: no __syncthreads inside a
role branch.

Fragments (nq/ptx/mma.py; g = lane // 4, t = lane % 4, h = kv head * G + g):

  S = Q K^T, per k-step ks (16 dims) and token n-tile nt (8 tokens):
    A (16 x 16) rows 0-7 = q_hi of head g, rows 8-15 = q_lo of head g (zero for g >= G), where
      q_hi = fp16(q * log2e/sqrt(D)), q_lo = fp16(that - q_hi): the otherwise empty rows 8-15
      carry the low half, so scores are ~fp32-accurate at no extra mma.  a0..a3 live in
      registers for the whole CTA (D/4 words).
    B (16 dims x 8 tokens) = K^T: ldmatrix.x4 (non-trans) of K rows, lane i at token row
      (i % 8) + 8(i // 16), dims ks*16 + 8((i // 8) % 2): (b0, b1) of both token n-tiles.
    C: c0, c1 = S_hi[g, nt*8 + 2t + {0, 1}], c2, c3 = S_lo[same]; score = c0 + c2 (c1 + c3).
    Even and odd k-steps accumulate separately (4 independent mma chains, not 2).
  Online softmax on those 4 scores a lane holds (row g's 16 tokens live in lanes 4g..4g+3:
  shfl_xor 1, 2), exp2, masked to NEG_BIG past the context (stale K may be NaN).
  O += P V, per dim n-tile j (8 dims):
    A = P as hi + lo fp16: a0 = pack(p_hi of tokens 2t, 2t+1), a2 = tokens 8+2t, 9+2t (the C
      fragments of S, repacked in registers: FlashAttention-2's reuse); rows 8-15 carry p_lo =
      fp16(p - p_hi) of the same tokens (a1, a3), so the weights are ~fp32-accurate.
    B = V (16 tokens x 8 dims): ldmatrix.x4.trans of V rows, lane i at token row
      16 + (i % 8) + 8((i // 8) % 2), dims 16*db + 8(i // 16): (b0, b1) of n-tiles 2db, 2db+1.
    C: c0, c1 = acc[g, 8j + 2t + {0, 1}] in, c2, c3 = 0 in; acc = d0 + d2 (hi + lo rows) out.
  l = P . ones by one more mma (d0 + d2), the same split weights as the numerator.
  Stale V rows of the tail page are zeroed in shared memory before ldmatrix: p = 0 there, but
  0 * NaN is NaN in the tensor core too.

End of CTA: consumers 1..NC-1 leave (m, l, acc) in their own page slot of the last stage (no
copy writes it again) and arrive on a merge mbarrier (count (NC-1)*32); consumer 0 waits on it,
merges and writes one partial per split in attn_decode's layout (part_ml (m, l), part_acc).

Fused combine (attn_mma_launcher(counters=attn_mma_counters(cfg))): at short contexts a layer's
attention is latency-bound (~10 us at 512 tokens) and the kernel boundary before attn_combine
costs a few us of it, so the last CTA of each kv head to finish does the combine instead: one
kernel a layer.  After its partial, a CTA ends its roles with a __syncthreads; thread 0 fences
(membar.gl, release: the CTA's partial stores are ordered before it by the barrier) and
atomically increments counters[kv head]; the CTA that reads n_splits - 1 is the last, fences
again (acquire) and a second __syncthreads passes that on to its threads, which then see every
split's partial.  CTAs past n_splits (no pages) neither count nor merge; every CTA computes
n_splits from the same state, so the count is consistent, and a single split (<= 16 tokens at
the default plan) merges without the atomic.  All warps merge (combine_warps can add warps
that do nothing else): warp w takes heads w, w + NW, ... -- per lane the max of m_s and
sum l_s w_s over s = lane, lane + 32, ..., attn_combine's butterflies, then the lane's dims
lane + 32 j in attn_combine's 4 split groups, combine_rows splits x D/32 loads in flight a
round (part_acc read through a flat view, so a row's loads are one address + immediates);
weights, 1/den and the flag in the free page slots.  Deterministic and bit for bit the two-
kernel path's o whichever CTA is last: the partials are merged in split order with
attn_combine's operations in its order (the select between multiply and add, as there, keeps
LLVM from contracting them into an fma), which the GPU test checks bit for bit and the
simulator test with the CTAs run in permuted orders.  Graph replays: the last CTA zeroes its
counter, so every launch leaves the counters as it found them (zero; a launch that faults
leaves the context unusable anyway) and a captured graph needs no reset node.  PDL: no early
launch_dependents (o_proj is scheduled once every CTA has exited); with early=True every
thread waits before the merge, the first global write of threads that had not.

ptxas (sm_90, numba-cuda 0.30): 159 registers at d128, 107 at d64, no spills, no local memory
(nvJitLink 13.5: 144 / 104; fused 143 / 105).

Tolerance (tests/test_attn_mma_gpu.py): scores as fp32 (hi+lo q, exact fp16 K, fp32
accumulate); P as hi+lo fp16 leaves ~2^-22 relative on each weight (P in fp16 alone: <= 2^-11,
|err| up to 9.8e-4 * max|v|), so what is left is fp32 accumulation and ex2.approx, as in
attn_decode, and the fp16 rounding of o.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda  # a module global: the simulator swaps it for its fake module
from numba.cuda.types import float16, float32, uint32, uint64

from nq.kernels.attention.combine import (CSG, LOG2E, MIN_PPS, NEG_BIG, SMEM_LIMIT, SPLIT_SIG,
                                    _allow_smem, _jit as _decode_jit, check_attention_args)
from nq.paged import PAGE, STATE_POS
from nq.ptx import SIMULATOR

# Defaults measured on the H200 (scripts/bench_attn.py --kernel mma, 28 layers of the 7B,
# us per layer at 512 / 8K / 32K; docs/KERNELS_ATTN.md has the whole sweep):
#   1 consumer, 3 stages, 4 rows a copy, 66 splits    9.8 / 16.5 / 33.4   <- the defaults
#   2 consumers, 3 stages, 1 row a copy, 66 splits   10.6 / 18.2 / 48.2   (512 bulk copies a
#       page-pair: the copy engine's issue rate, not bandwidth, bounded it at long contexts)
#   2 consumers, 3 stages, 32 rows (one copy a page)  11.0 / 19.6 / 37.0   (8-way ldmatrix conflicts)
#   max_splits 33 (1 CTA an SM)                       ~10 / 25.6 / 82.9
#   max_splits 132: 10.5 / 18.2 / 33.0; 4 consumers x 2 stages: 11.6-12.4 / 18.7-21.2 / 39-45
#   attn_decode's fp32 kernel (one warp a head):      9.0 / 30.6 / 97.8
# One consumer warp computes a page for all G heads in ~50 tensor-core instructions, so more
# consumers only add merge work; short contexts stay launch- and latency-bound (~10 us).
CONSUMERS = 1       # consumer warps = pages per stage
NSTAGE = 3          # stages of CONSUMERS pages each
ROWS_PER_COPY = 4   # token rows per cp.async.bulk (4: 2-way ldmatrix conflicts, 1/4 the copies)
COMBINE_ROWS = 16   # fused combine: splits a round loads (x head_dim/32 loads in flight a lane)
CTAS_PER_SM = 2     # default max_splits = ceil(CTAS_PER_SM * n_sms / num_kv_heads): 66 for the 7B
PAD = 16            # bytes between padded row groups (one bank group)
ALIGN = 16          # ldmatrix rows and bulk copies need 16-byte shared addresses


# ---- NumPy models --------------------------------------------------------------------------------

def row_offset(r: int, head_dim: int, rows_per_copy: int = ROWS_PER_COPY) -> int:
    """Byte offset of token row r (0-15 K, 16-31 V) in a page slot of shared memory."""
    return r * 2 * head_dim + (r // rows_per_copy) * PAD


def page_slot_bytes(head_dim: int, rows_per_copy: int = ROWS_PER_COPY) -> int:
    return 2 * PAGE * 2 * head_dim + (2 * PAGE // rows_per_copy) * PAD


def smem_bytes(head_dim: int, consumers: int = CONSUMERS, nstage: int = NSTAGE,
               rows_per_copy: int = ROWS_PER_COPY) -> int:
    """Dynamic shared memory of the split kernel: nstage x consumers padded page slots, plus
    slack to align them (numba declares the dynamic array `.align 4`)."""
    return nstage * consumers * page_slot_bytes(head_dim, rows_per_copy) + ALIGN


def default_max_splits(num_kv_heads: int, n_sms: int = 132, ctas_per_sm: int = CTAS_PER_SM) -> int:
    return max(1, -(-ctas_per_sm * n_sms // num_kv_heads))


def split_q_hi_lo(x):
    """x float32 -> (hi, lo) fp16 with hi + lo = x to ~2^-22 relative (the kernel's q split)."""
    x = np.asarray(x, np.float32)
    hi = x.astype(np.float16)
    lo = (x - hi.astype(np.float32)).astype(np.float16)
    return hi, lo


def page_scores_model(q_scaled, k_page):
    """One consumer warp's S = Q K^T for a page through the warp models of nq/ptx/mma.py, with
    the kernel's fragment mapping: q_scaled (G, D) float32, k_page (16, D) fp16 -> (G, 16).

    Checks the mapping (q_hi rows 0-7, q_lo rows 8-15, ldmatrix lane addressing, c0 + c2), not
    the hardware; tests/test_attn_mma_cpu.py compares it with q K^T in float64.
    """
    from nq.ptx.mma import ldmatrix_x4_warp, mma_m16n8k16_f16_f32_warp
    G, D = q_scaled.shape
    hi, lo = split_q_hi_lo(q_scaled)
    hi_bits, lo_bits = hi.view(np.uint16), lo.view(np.uint16)
    kb = np.asarray(k_page, np.float16).view(np.uint16)
    s = np.zeros((G, PAGE))
    for ks in range(D // 16):
        a = np.zeros((32, 4), np.uint32)
        for lane in range(32):
            g, t = divmod(lane, 4)
            if g < G:
                for reg, (src, col) in enumerate(((hi_bits, 2 * t), (lo_bits, 2 * t),
                                                  (hi_bits, 2 * t + 8), (lo_bits, 2 * t + 8))):
                    d = ks * 16 + col
                    a[lane, reg] = int(src[g, d]) | (int(src[g, d + 1]) << 16)
        rows = [kb[(i % 8) + 8 * (i // 16), ks * 16 + 8 * ((i // 8) % 2):][:8] for i in range(32)]
        b = ldmatrix_x4_warp(rows)
        for nt in range(2):
            c = mma_m16n8k16_f16_f32_warp(a, b[:, 2 * nt:2 * nt + 2], np.zeros((32, 4), np.float32))
            for lane in range(32):
                g, t = divmod(lane, 4)
                if g < G:
                    for e in range(2):
                        s[g, nt * 8 + 2 * t + e] += float(c[lane, e]) + float(c[lane, 2 + e])
    return s


# ---- kernel --------------------------------------------------------------------------------------

def combine_scratch_words(gqa: int, max_splits: int) -> int:
    """32-bit words of shared memory the fused combine uses: wts (G + 1, max_splits), inv (G,),
    the last-CTA flag."""
    return (gqa + 1) * max_splits + gqa + 1


@functools.cache
def _split_kernel(gqa: int, head_dim: int, num_kv: int, consumers: int, nstage: int,
                  rows_per_copy: int, max_splits: int, min_pps: int, early: bool = False,
                  fused: bool = False, warps: int = 0, combine_rows: int = COMBINE_ROWS,
                  trigger_splits: int = 0):
    """attn_mma_g{gqa}_d{head_dim}_kv{num_kv}_c{consumers}_st{nstage}_r{rows_per_copy}_s{max_splits}."""
    from nq.kernels.common import dev, warp_max, warp_sum
    from nq.ptx import (cp_async_bulk_g2s, cvta_to_shared_u32_at, fence_mbarrier_init,
                        fence_proxy_async_shared, griddepcontrol_launch_dependents,
                        griddepcontrol_wait, ldmatrix_x4, ldmatrix_x4_trans,
                        mbarrier_arrive, mbarrier_arrive_expect_tx, mbarrier_init,
                        mbarrier_try_wait_parity, mbarrier_wait_parity, mma_sync_m16n8k16_f16_f32,
                        pack_f16x2_from_f32, unpack_f16x2_to_f32)

    EARLY = bool(early)
    G, D, NC, NST, RPC = gqa, head_dim, consumers, nstage, rows_per_copy
    MAXS, MINP = max_splits, min_pps
    KS = D // 16                       # k-steps of Q K^T = dim blocks of P V (2 n-tiles each)
    NT = D // 8                        # dim n-tiles of the accumulator
    QW, AW = 4 * KS, 2 * NT            # local array sizes (compile-time constants)
    RB = 2 * D                         # bytes of one token row
    SLOT = page_slot_bytes(D, RPC)     # bytes of one padded page slot
    PAGE_TX = 2 * PAGE * RB            # bytes the copies of one page deliver
    NCOPY = 2 * PAGE // RPC            # copies per page (lanes 0..NCOPY-1 issue one each)
    COPY_BYTES = RPC * RB
    ROW_WORDS = D // 2
    QSCALE = float32(LOG2E / math.sqrt(D))
    NEG = float32(NEG_BIG)
    ZERO = float32(0.0)
    ONES = uint32(0x3C003C00)          # two fp16 1.0: the B fragment of l = P . 1
    Z = uint32(0)
    FULL = 0xFFFFFFFF
    wsum, wmax = dev(warp_sum), dev(warp_max)   # nq/kernels/common.py
    NBARS = 2 * NST + 2                # full, empty, merge; even, so 16-byte static size
    MERGE = 2 * NST
    SCR_ML = 8 * D                     # float offset of (m, l) after acc in a merge scratch slot
    # FUSED: the last CTA of a kv head to finish merges its G heads' partials (module doc).
    FUSED = bool(fused)
    TRIG = int(trigger_splits)         # n_splits <= TRIG: trigger the dependents at the start
    NW = max(NC + 1, warps)            # warps of the CTA (warps > NC + 1: combine-only warps)
    HPW = (G + NW - 1) // NW           # heads per warp in the merge: g = warp + NW k
    DB = D // 32                       # dims per lane in the merge (lane + 32 j)
    RS = combine_rows                  # splits a merge round loads (DB * RS loads in flight)
    assert RS % CSG == 0 and RS <= 16, "combine_rows: 4, 8 or 16 (fully unrolled, registers)"
    CA = CSG * DB                      # attn_combine's CSG split-group sums of a lane's dims
    HQ = G * num_kv
    SS = uint64(HQ * D)                # part_acc words per split (unsigned: see the merge)
    WTS = 0                            # scratch word offsets (combine_scratch_words):
    INV = (G + 1) * MAXS               # wts[g, s] = exp2(m_s - max m) (row G: heads g >= G
    FLAG = INV + G                     # write there), inv[g] = 1 / sum l w, the flag

    def attn_mma_split(q, state, table, kv, part_acc, out):
        # q (Hq*D,) f32; state int32; table (max_pages,) int32; kv (n_pages, n_kv, 2, 16, D) f16
        # part_acc (max_splits, Hq, D) f32; out: part_ml (max_splits, Hq, 2) f32, or FUSED the
        # tuple (part_ml, o (Hq*D,) f16, counters (n_kv,) int32, part_acc flat) -- one parameter
        # either way, so the unfused kernel's signature and PTX are what they were.
        # PDL: no early griddepcontrol.launch_dependents -- attn_combine can do nothing before
        # this kernel ends, and its waiting CTAs sharing the SMs made the split 1.5x slower at
        # 8K (attn_decode measured it); the implicit trigger at exit is the right one.
        if FUSED:
            part_ml, o, counters, paf = out
        else:
            part_ml = out
        smu = cuda.shared.array(0, uint32)       # (NST, NC) padded page slots, see row_offset
        smf = cuda.shared.array(0, float32)      # the same bytes: merge scratch at the end
        bars = cuda.shared.array(NBARS, uint64)  # full[NST], empty[NST], merge
        # Per-lane state first, in the entry block, so SROA keeps it in registers.
        qf = cuda.local.array(QW, uint32)        # A fragments of (q_hi; q_lo), per k-step
        acc = cuda.local.array(AW, float32)      # O[g, 8j + 2t + e], n-tile j
        sc = cuda.local.array(16, float32)       # S C fragments: [parity][n-tile][c0..c3]
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        bar0 = cvta_to_shared_u32_at(bars, 0)    # full[s] = bar0 + 8s, empty[s] = bar0 + 8(NST + s)
        if tid == 0:
            for s in range(NST):
                mbarrier_init(bar0 + 8 * s, 1)
                mbarrier_init(bar0 + 8 * (NST + s), NC * 32)
            if NC > 1:
                mbarrier_init(bar0 + 8 * MERGE, (NC - 1) * 32)
            fence_mbarrier_init()
        cuda.syncthreads()
        if not EARLY:
            griddepcontrol_wait()  # state, q and the KV page written by rope_kv come from upstream
        # EARLY (PDL): state, the block table and every page but the one rope_kv writes this
        # step (the last page of the context) are written by nothing in the step -- only by
        # the previous replay's argmax and by host copies between replays -- so the split plan
        # and those pages' copies go ahead of the wait; the consumers wait before reading q,
        # the producer before copying the last page.

        split = cuda.blockIdx.x
        kvh = cuda.blockIdx.y
        length = state[STATE_POS] + 1
        n_pages = (length + PAGE - 1) // PAGE
        pps = max(MINP, (n_pages + MAXS - 1) // MAXS)
        n_splits = (n_pages + pps - 1) // pps
        if TRIG > 0 and n_splits <= TRIG:
            # Short context: few CTAs, so the next kernel's blocks (o_proj, or attn_combine and
            # through it o_proj) fit beside them and can start their weight loads now; at long
            # context their waiting blocks would crowd the split's (the 8K slowdown above).
            griddepcontrol_launch_dependents()
        if split >= n_splits:
            return  # uniform for the CTA; no barrier is used after this point by anyone
        p_begin = split * pps
        p_end = min(p_begin + pps, n_pages)
        n_iters = (p_end - p_begin + NC - 1) // NC
        sm0 = cvta_to_shared_u32_at(smu, 0)
        skip = (ALIGN - sm0 % ALIGN) % ALIGN
        stage0 = sm0 + skip                  # 16-byte aligned; slot (s, j) at + (s*NC + j)*SLOT
        w0 = skip // 4                       # the same place as a smu / smf index

        if warp == NC:
            # Producer.  The whole warp walks the loop; lanes < NCOPY each copy RPC rows a page.
            for it in range(n_iters):
                s = it % NST
                # A fresh barrier counts its (virtual) previous phase as complete, so the
                # first NST waits with parity 1 pass at once.
                while mbarrier_try_wait_parity(bar0 + 8 * (NST + s), ((it // NST) & 1) ^ 1) == 0:
                    pass
                p0 = p_begin + it * NC
                npg = min(NC, p_end - p0)
                if EARLY and p0 + npg >= n_pages:
                    griddepcontrol_wait()  # this stage holds the page rope_kv writes
                if lane == 0:
                    mbarrier_arrive_expect_tx(bar0 + 8 * s, npg * PAGE_TX)
                cuda.syncwarp(FULL)
                if lane < NCOPY:
                    r0 = lane * RPC
                    for j in range(npg):
                        pid = table[p0 + j]
                        cp_async_bulk_g2s(stage0 + (s * NC + j) * SLOT + r0 * RB + lane * PAD,
                                          kv, (pid, kvh, r0 // PAGE, r0 % PAGE, 0), COPY_BYTES,
                                          bar0 + 8 * s)
                cuda.syncwarp(FULL)
        elif FUSED and warp > NC:
            pass  # a combine-only warp: straight to the merge
        else:
            c = warp
            if EARLY:
                griddepcontrol_wait()  # q comes from rope_kv
            g = lane // 4
            t = lane % 4
            row_ok = g < G
            h = kvh * G + g
            for ks in range(KS):
                for half in range(2):                 # a0/a1 (dims 2t..), a2/a3 (dims 2t+8..)
                    if row_ok:
                        d = h * D + ks * 16 + 2 * t + 8 * half
                        x0 = q[d] * QSCALE
                        x1 = q[d + 1] * QSCALE
                        hi = pack_f16x2_from_f32(x0, x1)
                        h0, h1 = unpack_f16x2_to_f32(hi)
                        qf[4 * ks + 2 * half] = hi
                        qf[4 * ks + 2 * half + 1] = pack_f16x2_from_f32(x0 - h0, x1 - h1)
                    else:
                        qf[4 * ks + 2 * half] = Z
                        qf[4 * ks + 2 * half + 1] = Z
            for j in range(2 * NT):
                acc[j] = ZERO
            m = NEG
            l = ZERO
            # This lane's ldmatrix rows (see the module doc), as byte offsets in a page slot.
            kr = (lane % 8) + 8 * (lane // 16)
            koff = kr * RB + (kr // RPC) * PAD + 16 * ((lane // 8) % 2)
            vr = PAGE + (lane % 8) + 8 * ((lane // 8) % 2)
            voff = vr * RB + (vr // RPC) * PAD + 16 * (lane // 16)
            for it in range(n_iters):
                s = it % NST
                mbarrier_wait_parity(bar0 + 8 * s, (it // NST) & 1)
                cuda.syncwarp(FULL)  # converged for the .aligned ldmatrix / mma.sync below
                pg = p_begin + it * NC + c
                if pg < p_end:                          # warp-uniform
                    nv = min(PAGE, length - pg * PAGE)  # valid tokens of this page
                    slot = (s * NC + c) * SLOT
                    base = stage0 + slot
                    if nv < PAGE:
                        # Zero the stale V rows nv..15 (tail page only): 0 * NaN = NaN in P V.
                        for i in range(lane, (PAGE - nv) * ROW_WORDS, 32):
                            r = PAGE + nv + i // ROW_WORDS
                            smu[w0 + (slot + r * RB + (r // RPC) * PAD) // 4 + i % ROW_WORDS] = Z
                        cuda.syncwarp(FULL)
                    for j in range(16):
                        sc[j] = ZERO
                    for ks in range(KS):
                        k0, k1, k2, k3 = ldmatrix_x4(base + koff + ks * 32)
                        par = 8 * (ks % 2)
                        a0, a1, a2, a3 = qf[4 * ks], qf[4 * ks + 1], qf[4 * ks + 2], qf[4 * ks + 3]
                        d0, d1, d2, d3 = mma_sync_m16n8k16_f16_f32(
                            a0, a1, a2, a3, k0, k1, sc[par], sc[par + 1], sc[par + 2], sc[par + 3])
                        sc[par], sc[par + 1], sc[par + 2], sc[par + 3] = d0, d1, d2, d3
                        d0, d1, d2, d3 = mma_sync_m16n8k16_f16_f32(
                            a0, a1, a2, a3, k2, k3, sc[par + 4], sc[par + 5], sc[par + 6],
                            sc[par + 7])
                        sc[par + 4], sc[par + 5], sc[par + 6], sc[par + 7] = d0, d1, d2, d3
                    # Scores of tokens nt*8 + 2t + e: hi + lo rows, even + odd k-steps.
                    pm = NEG
                    for nt in range(2):
                        for e in range(2):
                            i = 4 * nt + e
                            x = (sc[i] + sc[i + 2]) + (sc[8 + i] + sc[8 + i + 2])
                            ok = row_ok and nt * 8 + 2 * t + e < nv
                            x = x if ok else NEG        # stale K past the length may be NaN
                            sc[i] = x
                            pm = max(pm, x)
                    pm = max(pm, cuda.shfl_xor_sync(FULL, pm, 1))
                    pm = max(pm, cuda.shfl_xor_sync(FULL, pm, 2))
                    m_new = max(m, pm)
                    alpha = math.exp2(m - m_new)
                    for nt in range(2):
                        for e in range(2):
                            i = 4 * nt + e
                            ok = row_ok and nt * 8 + 2 * t + e < nv
                            p = math.exp2(sc[i] - m_new)
                            sc[i] = p if ok else ZERO   # a masked row has m = NEG: exp2(0) = 1
                    m = m_new
                    # P as hi + lo fp16 (rows g and g+8 of the A fragment, as q): rows g+8 of
                    # the product are P_lo V, added in fp32 after each mma, so the weights are
                    # ~fp32-accurate (fp16 P alone flipped a near-tie greedy choice of the
                    # 2-layer 7B-width test that the fp32 kernel had matched).
                    pa0 = pack_f16x2_from_f32(sc[0], sc[1])   # P_hi[g, 2t, 2t+1]
                    pa2 = pack_f16x2_from_f32(sc[4], sc[5])   # P_hi[g, 8+2t, 9+2t]
                    h0, h1 = unpack_f16x2_to_f32(pa0)
                    h4, h5 = unpack_f16x2_to_f32(pa2)
                    pa1 = pack_f16x2_from_f32(sc[0] - h0, sc[1] - h1)   # P_lo, same tokens
                    pa3 = pack_f16x2_from_f32(sc[4] - h4, sc[5] - h5)
                    d0, _, d2, _ = mma_sync_m16n8k16_f16_f32(pa0, pa1, pa2, pa3, ONES, ONES,
                                                             l * alpha, ZERO, ZERO, ZERO)
                    l = d0 + d2
                    for db in range(KS):
                        v0, v1, v2, v3 = ldmatrix_x4_trans(base + voff + db * 32)
                        j = 4 * db
                        d0, d1, d2, d3 = mma_sync_m16n8k16_f16_f32(
                            pa0, pa1, pa2, pa3, v0, v1, acc[j] * alpha, acc[j + 1] * alpha,
                            ZERO, ZERO)
                        acc[j], acc[j + 1] = d0 + d2, d1 + d3
                        d0, d1, d2, d3 = mma_sync_m16n8k16_f16_f32(
                            pa0, pa1, pa2, pa3, v2, v3, acc[j + 2] * alpha, acc[j + 3] * alpha,
                            ZERO, ZERO)
                        acc[j + 2], acc[j + 3] = d0 + d2, d1 + d3
                    if nv < PAGE:
                        # The zeroing stores were generic-proxy writes; order them before any
                        # later bulk copy into this slot.
                        fence_proxy_async_shared()
                # Every consumer thread arrives (count NC*32): each thread's own reads of the
                # stage are ordered before the refill by its own release.
                mbarrier_arrive(bar0 + 8 * (NST + s))
            if NC > 1:
                s_last = (n_iters - 1) % NST
                if c > 0:
                    # Merge scratch (8 x D acc, then 8 x (m, l)) in this warp's own slot of the
                    # last stage: every copy into it has landed and none is issued again.
                    fo = w0 + (s_last * NC + c) * SLOT // 4
                    cuda.syncwarp(FULL)  # the warp's last ldmatrix of this slot is done
                    if row_ok:
                        for j in range(NT):
                            smf[fo + g * D + 8 * j + 2 * t] = acc[2 * j]
                            smf[fo + g * D + 8 * j + 2 * t + 1] = acc[2 * j + 1]
                        if t == 0:
                            smf[fo + SCR_ML + 2 * g] = m
                            smf[fo + SCR_ML + 2 * g + 1] = l
                    mbarrier_arrive(bar0 + 8 * MERGE)
                    if not FUSED:
                        return
                if not FUSED or c == 0:  # FUSED: warps c > 0 go on to the merge at the end
                    mbarrier_wait_parity(bar0 + 8 * MERGE, 0)
                if row_ok and (not FUSED or c == 0):
                    mx = m
                    for cc in range(1, NC):
                        fo = w0 + (s_last * NC + cc) * SLOT // 4
                        mx = max(mx, smf[fo + SCR_ML + 2 * g])
                    w = math.exp2(m - mx)
                    l *= w
                    for j in range(2 * NT):
                        acc[j] *= w
                    for cc in range(1, NC):
                        fo = w0 + (s_last * NC + cc) * SLOT // 4
                        w = math.exp2(smf[fo + SCR_ML + 2 * g] - mx)
                        l += smf[fo + SCR_ML + 2 * g + 1] * w
                        for j in range(NT):
                            acc[2 * j] += smf[fo + g * D + 8 * j + 2 * t] * w
                            acc[2 * j + 1] += smf[fo + g * D + 8 * j + 2 * t + 1] * w
                    m = mx
            if row_ok and (not FUSED or c == 0):
                for j in range(NT):
                    part_acc[split, h, 8 * j + 2 * t] = acc[2 * j]
                    part_acc[split, h, 8 * j + 2 * t + 1] = acc[2 * j + 1]
                if t == 0:
                    part_ml[split, h, 0] = m
                    part_ml[split, h, 1] = l

        if FUSED:
            # ---- the last CTA of kv head kvh to finish merges the n_splits partials --------
            if EARLY:
                # No global write before the wait: the producer waited only if its split holds
                # the last page, merge-only warps never.
                griddepcontrol_wait()
            # Every role is done: consumer 0's partial stores are ordered before tid 0's
            # release fence by this barrier; the page slots are free for the scratch.
            cuda.syncthreads()
            if tid == 0:
                last = uint32(1)
                if n_splits > 1:
                    cuda.threadfence()  # release: this CTA's partial, before its arrival
                    if cuda.atomic.add(counters, kvh, 1) == n_splits - 1:
                        counters[kvh] = 0   # all n_splits arrived: zero for the next launch
                        cuda.threadfence()  # acquire: the other splits' partials
                    else:
                        last = uint32(0)
                smu[w0 + FLAG] = last
            cuda.syncthreads()  # and the barrier passes the acquire on to every thread
            if smu[w0 + FLAG] == 0:
                return  # uniform for the CTA
            # attn_decode's attn_combine for heads kvh*G + g, with the same operations in the
            # same order, so o is bit for bit the two-kernel path's.  Warp w merges heads
            # g = w, w + NW, ...: per lane the max of m_s and the sum of l_s w_s over
            # s = lane, lane + 32, ..., the same butterflies; then each lane's dims
            # lane + 32 j, summed in attn_combine's CSG split groups (splits sg, sg + CSG, ...)
            # and added group after group.  Only this warp reads the head's scratch: syncwarp.
            cmx = cuda.local.array(HPW, float32)
            cden = cuda.local.array(HPW, float32)
            ca = cuda.local.array(CA, float32)
            for k in range(HPW):
                cmx[k] = NEG
                cden[k] = ZERO
            # No branch on g (a head g >= G reads head G - 1 and writes wts row G, unread), so
            # a lane's loads of all its heads are in flight together.
            for s in range(lane, n_splits, 32):
                for k in range(HPW):
                    gg = min(warp + NW * k, G - 1)
                    cmx[k] = max(cmx[k], part_ml[s, kvh * G + gg, 0])
            for k in range(HPW):
                mx = cmx[k]
                cmx[k] = wmax(mx)
            for s in range(lane, n_splits, 32):
                for k in range(HPW):
                    g = warp + NW * k
                    gg = min(g, G - 1)
                    w = math.exp2(part_ml[s, kvh * G + gg, 0] - cmx[k])
                    smf[w0 + WTS + min(g, G) * MAXS + s] = w
                    cden[k] += part_ml[s, kvh * G + gg, 1] * w
            for k in range(HPW):
                g = warp + NW * k
                den = cden[k]
                den = wsum(den)
                if lane == 0 and g < G:
                    smf[w0 + INV + g] = float32(1.0) / den
            cuda.syncwarp(FULL)
            for k in range(HPW):
                g = warp + NW * k
                if g < G:
                    # Unsigned indices: no negative-index wrap, so a row's DB loads are one
                    # address + immediate offsets.
                    hd = uint64((kvh * G + g) * D + lane)   # flat (split 0, head, dim lane)
                    ws = uint32(w0 + WTS + g * MAXS)
                    for j in range(CA):
                        ca[j] = ZERO
                    # A round: RS splits x DB dims, all loads unconditional and in flight
                    # together.  As in attn_combine, rows past n_splits are clamped to a valid
                    # one and dropped by the select, not by their weight.
                    for s0 in range(0, n_splits, RS):
                        for r in range(RS):
                            s = s0 + r
                            sc = min(s, MAXS - 1)
                            wsc = smf[ws + uint32(sc)]
                            row = uint64(sc) * SS + hd
                            for j in range(DB):
                                x = paf[row + uint64(32 * j)] * wsc
                                ca[CSG * j + r % CSG] += x if s < n_splits else ZERO
                    inv = smf[w0 + INV + g]
                    for j in range(DB):
                        t = ca[CSG * j]
                        for sg in range(1, CSG):
                            t += ca[CSG * j + sg]
                        o[hd + uint64(32 * j)] = float16(t * inv)

    return attn_mma_split


# FUSED: the last parameter is the tuple (part_ml, o, counters, part_acc flat).
FUSED_SIG = ("void(float32[::1], int32[::1], int32[::1], float16[:, :, :, :, ::1], "
             "float32[:, :, ::1], Tuple((float32[:, :, ::1], float16[::1], int32[::1], float32[::1])))")


@functools.cache
def _jit(*key):
    """key: _split_kernel's arguments; the 10th, fused, picks the signature."""
    sig = FUSED_SIG if len(key) > 9 and key[9] else SPLIT_SIG
    return cuda.jit(sig, fastmath=True)(_split_kernel(*key))


# ---- launcher ------------------------------------------------------------------------------------

def attn_mma_workspace(cfg, max_splits: int | None = None):
    """Device partial buffers for one attention call site (reusable across layers)."""
    ms = max_splits or default_max_splits(cfg.num_kv_heads)
    part_acc = cuda.device_array((ms, cfg.num_heads, cfg.head_dim), np.float32)  # (max_splits, Hq, D)
    part_ml = cuda.device_array((ms, cfg.num_heads, 2), np.float32)              # (max_splits, Hq, (m, l))
    return part_acc, part_ml


def attn_mma_counters(cfg):
    """The fused combine's arrival counters (attn_mma_launcher(counters=...)): int32
    (num_kv_heads,), zero.  Every launch leaves them zero again; one set per call site, like
    the partial buffers, reusable across layers and graph replays."""
    return cuda.to_device(np.zeros(cfg.num_kv_heads, np.int32))


def attn_mma_launcher(cfg, q, state, table, kv_layer, o, part_acc, part_ml, *,
                      consumers: int = CONSUMERS, nstage: int = NSTAGE,
                      rows_per_copy: int = ROWS_PER_COPY, min_pps: int = MIN_PPS,
                      early: bool = False, counters=None, combine_warps: int = 0,
                      combine_rows: int = COMBINE_ROWS, trigger_splits: int = 0):
    """Check shapes once; return `launch(stream=0)` running the mma split kernel then
    attn_decode's attn_combine -- or, given counters (attn_mma_counters), the split kernel
    alone with the combine fused into the last CTA of each kv head (module doc; o bit for bit
    the same).  Arguments as attn_decode_launcher; max_splits is part_acc.shape[0]
    (attn_mma_workspace).  consumers: warps = pages per stage; nstage: stages; rows_per_copy:
    token rows per bulk copy (1, 2, 4, 8, 16 or 32); early: read the split plan and copy every
    page but the last before griddepcontrol.wait (matters only in a graph with programmatic
    edges; not yet measured on the GPU, so off).  Fused only (not yet measured either):
    combine_warps, warps a CTA (0 = consumers + 1; more add warps that only merge -- at ~143
    registers, 4 warps still fit two CTAs an SM, 8 do not); combine_rows, splits one merge
    round loads (4, 8 or 16; x head_dim/32 loads in flight a lane).  trigger_splits: when the
    plan has at most that many splits, every CTA triggers the dependent launch at its start
    (programmatic dependent launch; 0 = only at exit).  counters must not be
    shared by two launches that can run at the same time (like part_acc and part_ml)."""
    G, D, hq, hkv = cfg.gqa_ratio, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    check_attention_args(cfg, q, state, table, kv_layer, o, part_acc, part_ml)
    if not 1 <= consumers <= 8 or not 1 <= nstage <= 8 or rows_per_copy not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"attention (mma): unsupported consumers={consumers}, nstage={nstage}, "
                         f"rows_per_copy={rows_per_copy}")
    ms = part_acc.shape[0]
    nbytes = smem_bytes(D, consumers, nstage, rows_per_copy)
    if counters is None:
        key = (G, D, hkv, consumers, nstage, rows_per_copy, ms, min_pps, bool(early))
        split = _jit(*key, False, 0, COMBINE_ROWS, int(trigger_splits)) if trigger_splits else _jit(*key)
        combine = _decode_jit("combine", D, ms, min_pps)
        threads = (consumers + 1) * 32
    else:
        if tuple(counters.shape) != (hkv,) or counters.dtype != np.int32:
            raise ValueError(f"attention (mma): counters is {counters.dtype}"
                             f"{tuple(counters.shape)}, want int32({hkv},) zeroed "
                             f"(attn_mma_counters)")
        if not SIMULATOR and not hasattr(counters, "__cuda_array_interface__"):
            raise ValueError("attention (mma): counters must be a device array (attn_mma_counters)")
        warps = combine_warps or consumers + 1
        if not consumers + 1 <= warps <= 32 or combine_rows not in (4, 8, 16):
            raise ValueError(f"attention (mma): unsupported combine_warps={combine_warps}, "
                             f"combine_rows={combine_rows}")
        split = _jit(G, D, hkv, consumers, nstage, rows_per_copy, ms, min_pps, bool(early), True,
                     warps, combine_rows, int(trigger_splits))
        nbytes = max(nbytes, ALIGN + 4 * combine_scratch_words(G, ms))
        threads = warps * 32
        # The tuple parameter (kernel doc); the flat view of part_acc is made here, once.
        out = (part_ml, o, counters, part_acc.reshape(part_acc.size))
    if nbytes + 8 * (2 * nstage + 2) > SMEM_LIMIT and not SIMULATOR:
        _allow_smem(split, nbytes)

    if counters is not None:
        def launch(stream=0):
            split[(ms, hkv), threads, stream, nbytes](q, state, table, kv_layer, part_acc, out)
        return launch

    def launch(stream=0):
        split[(ms, hkv), threads, stream, nbytes](q, state, table, kv_layer, part_acc, part_ml)
        combine[hq, D * CSG, stream](state, part_acc, part_ml, o)

    return launch
