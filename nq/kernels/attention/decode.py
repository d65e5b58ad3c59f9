"""attn_split: the paged-attention decode split kernel on tensor cores (its body; launch.py
names, compiles and launches it, then attn_combine from combine.py).  One K/V page is shared by
all GQA query heads of its kv head.

One consumer warp multiplies a page against all GQA heads of its kv head with
`mma.sync.m16n8k16` (fp16 in, fp32 accumulate), so a page costs D/16 + D/8 + 1 mma and D/8
ldmatrix a warp.  Split plan, shared-memory layout and partials: plan.py.

CTA (split, kv head h): warp 0..NC-1 consumers, warp NC the producer.  Of the NC consumers the
split uses nca: all of them, or with `ppc` one for every ppc pages of the plan's pages a split
(at most NC, at least 1), so one kernel in one captured graph gives a short context's split of
two pages to one consumer (no merge) and a long context's 31 pages to four.  A stage holds nca
pages; consumer c takes page c of every stage and keeps its own (m, l, acc) for the GQA heads;
consumers c >= nca leave at once.  The
producer's lanes each issue one `cp.async.bulk` of `rows_per_copy` token rows (K rows 0-15 then
V rows 16-31 of the page) into PADDED shared rows (plan.row_offset).  Full mbarriers (one
arrive.expect_tx per stage + the copies' complete_tx) and empty mbarriers (every consumer
thread arrives).  No __syncthreads inside a role branch: the CTA syncs once, after mbarrier
init; the roles then run to the end without meeting again (every copy issued is waited for by
the consumers, so no bulk copy is in flight when the CTA exits).

Tensor-map copies (`tma`, the step's default for every page; `tma_from` for long splits only): the
producer's lanes < npg * 2 issue one `cp.async.bulk.tensor.5d` each, a (page, kv head)'s K and
V rows of one 64-dim half (plan.tma_spec: a 4 KB box, 128-byte swizzle) into a 1024-byte
aligned slot, 1/16 of the bulk path's copies and no ldmatrix bank conflicts.  The consumers
address the swizzled rows through 4 + 4 per-lane offsets computed before the page loop (the
XOR of the swizzle folded in); the tail zeroing follows the slot's layout.  With tma_from the
plan picks the layout at run time (a split of fewer pages gets padded rows).  In the step's
one-wave grid (33 CTAs a kv head, one an SM: nq/runtime/step.py) the bulk copies lose at every
context, 16 copies a page from the SM's one producer (docs/PERF.md 0.19).

Fragments (nq/ptx/mma.py; g = lane // 4, t = lane % 4, h = kv head * GQA + g):

  scores = Q K^T, per k-step kstep (16 dims) and token n-tile nt (8 tokens):
    A (16 x 16) rows 0-7 = q_hi of head g, rows 8-15 = q_lo of head g (zero for g >= GQA),
      where q_hi = fp16(q * log2e/sqrt(D)), q_lo = fp16(that - q_hi): the otherwise empty rows
      8-15 carry the low half, so scores are ~fp32-accurate at no extra mma.  a0..a3 live in
      registers for the whole CTA (D/4 words).
    B (16 dims x 8 tokens) = K^T: ldmatrix.x4 (non-trans) of K rows, lane i at token row
      (i % 8) + 8(i // 16), dims kstep*16 + 8((i // 8) % 2): (b0, b1) of both token n-tiles.
    C: c0, c1 = hi[g, nt*8 + 2t + {0, 1}], c2, c3 = lo[same]; score = c0 + c2 (c1 + c3).
    Even and odd k-steps accumulate separately (4 independent mma chains, not 2).
  Online softmax on those 4 scores a lane holds (row g's 16 tokens live in lanes 4g..4g+3:
  shfl_xor 1, 2), exp2, masked to NEG_BIG past the context (stale K may be NaN).
  O += P V, per dim n-tile j (8 dims):
    A = P as hi + lo fp16: a0 = pack(p_hi of tokens 2t, 2t+1), a2 = tokens 8+2t, 9+2t (the C
      fragments of the scores, repacked in registers: FlashAttention-2's reuse); rows 8-15
      carry p_lo = fp16(p - p_hi) of the same tokens (a1, a3), so the weights are ~fp32-accurate.
    B = V (16 tokens x 8 dims): ldmatrix.x4.trans of V rows, lane i at token row
      16 + (i % 8) + 8((i // 8) % 2), dims 16*db + 8(i // 16): (b0, b1) of n-tiles 2db, 2db+1.
    C: c0, c1 = acc[g, 8j + 2t + {0, 1}] in, c2, c3 = 0 in; acc = d0 + d2 (hi + lo rows) out.
  l = P . ones by one more mma (d0 + d2), the same split weights as the numerator.
  Stale V rows of the tail page are zeroed in shared memory before ldmatrix: p = 0 there, but
  0 * NaN is NaN in the tensor core too.

End of CTA: consumers 1..nca-1 leave (m, l, acc) in their own page slot of the last stage (no
copy writes it again) and arrive on a merge mbarrier (count (nca-1)*32); consumer 0 waits on it,
merges and writes one partial per split (plan.py: part_ml (m, l), part_acc).

PDL: no early griddepcontrol.launch_dependents by default (`trigger` puts one at each CTA's
start, for attn_o_proj, whose blocks load their weights before they wait) -- attn_combine can
do nothing before this kernel ends, and its waiting CTAs sharing the SMs made the split 1.5x slower at 8K (docs/PERF.md
0.2, PDL); the implicit trigger at exit is the right one.

Lost in the step and retired (docs/KERNELS_ATTN.md): l2_prefetch, warp 0 of every CTA asking L2
for the head of each of gate_up's (or o_proj's) weight tiles before any wait (a3fddf4 holds
it), the combine fused into the last CTA of each kv head (13c221c), and the merge inside a
thread block cluster (cluster.py, +0.02..+2.2 ms a step; code at 342710b).

ptxas (sm_90, numba-cuda 0.30): 159 registers at d128, 107 at d64, no spills, no local memory
(nvJitLink 13.5: 145 / 103); with tma and four consumers 185 at d128 (175 before the q values
were loaded at once, 72800af), still two CTAs an SM (at most 204 a thread for five warps);
the step's tensor-map-only build 175 (the H200's JIT: 138 for the two-layout one), one CTA an
SM by its four stages of slots (nq/runtime/step.py).

Tolerance (tests/kernels/attention/test_decode_gpu.py): scores as fp32 (hi+lo q, exact fp16 K,
fp32 accumulate); P as hi+lo fp16 leaves ~2^-22 relative on each weight (P in fp16 alone:
<= 2^-11, |err| up to 9.8e-4 * max|v|), so what is left is fp32 accumulation and ex2.approx, and
the fp16 rounding of o.

Retired variants, each with its figures and the commit that holds it: docs/KERNELS_ATTN.md
"Retired variants of the split kernel".
"""
from __future__ import annotations

import functools
import math

from numba import cuda  # a module global: the simulator swaps it for its fake module
from numba.cuda.types import float32, uint32, uint64

from nq.kernels.attention.plan import (ALIGN, LOG2E, NEG_BIG, PAD, TMA_ALIGN, TMA_HALF_BYTES,
                                       plan_body,
                                       barrier_bytes, page_slot_bytes, tma_slot_bytes)
from nq.kernels.common import dev
from nq.paged import PAGE, STATE_POS

SPLIT_SIG = ("void(float32[::1], int32[::1], int32[::1], float16[:, :, :, :, ::1], "
             "float32[:, :, ::1], float32[:, :, ::1])")
# tma: the layer's tensor map (nq/ptx/tensormap.py) as one more argument
SPLIT_SIG_TMA = ("void(float32[::1], int32[::1], int32[::1], float16[:, :, :, :, ::1], "
                 "float32[:, :, ::1], float32[:, :, ::1], uint64[::1])")


@functools.cache
def split_body(gqa: int, head_dim: int, num_kv: int, consumers: int, nstage: int,
               rows_per_copy: int, max_splits: int, min_pps: int, early: bool,
               ppc: int = 0, tma: bool = False, tma_from: int = 0, trigger: bool = False):
    """The kernel body for one set of baked-in constants (split_name spells them).

    Legend: GQA query heads a kv head, D head_dim, NC consumer warps (= pages a stage), NST
    stages, RPC token rows a bulk copy, `plan` the split plan (plan.plan_body); in the
    body g = lane // 4 (a head of the group), t = lane % 4, c the consumer, stage the ring slot.
    """
    from nq.ptx import (cp_async_bulk_g2s, cp_async_bulk_tensor_5d_g2s, cvta_to_shared_u32_at,
                        fence_mbarrier_init,
                        fence_proxy_async_shared, griddepcontrol_launch_dependents,
                        griddepcontrol_wait, ldmatrix_x4,
                        ldmatrix_x4_trans, mbarrier_arrive, mbarrier_arrive_expect_tx,
                        mbarrier_init, mbarrier_try_wait_parity, mbarrier_wait_parity,
                        mma_sync_m16n8k16_f16_f32, pack_f16x2_from_f32, unpack_f16x2_to_f32)

    EARLY = bool(early)
    TRIGGER = bool(trigger)  # launch the dependents at the CTA's start (attn_o_proj's weights)
    PPC = int(ppc)           # > 0: a split's pages over min(NC, pps // PPC) consumers (`nca`)
    TMA = bool(tma)          # tensor-map copies into swizzled slots (plan.py), not bulk copies
    GQA, D, NC, NST, RPC = gqa, head_dim, consumers, nstage, rows_per_copy
    plan = dev(plan_body(max_splits, min_pps))   # (n_pages, pps, n_splits) of a length
    KSTEPS = D // 16                   # k-steps of Q K^T = dim blocks of P V (2 n-tiles each)
    NT = D // 8                        # dim n-tiles of the accumulator
    QW, AW = 4 * KSTEPS, 2 * NT        # local array sizes (compile-time constants)
    ROW_BYTES = 2 * D                  # bytes of one token row
    TFROM = int(tma_from)    # > 0: tensor-map copies only from TFROM pages a split, bulk below
    SLOT_B = page_slot_bytes(D, RPC)   # bytes of one padded page slot (bulk copies)
    SLOT_T = tma_slot_bytes(D)         # bytes of one swizzled page slot (tensor-map copies)
    HALVES = D // 64                   # tensor copies a page: one a 64-dim half
    PAGE_TX = 2 * PAGE * ROW_BYTES     # bytes the copies of one page deliver
    NCOPY = 2 * PAGE // RPC            # copies per page (lanes 0..NCOPY-1 issue one each)
    COPY_BYTES = RPC * ROW_BYTES
    ROW_WORDS = D // 2
    QSCALE = float32(LOG2E / math.sqrt(D))
    NEG = float32(NEG_BIG)
    ZERO = float32(0.0)
    ONES = uint32(0x3C003C00)          # two fp16 1.0: the B fragment of l = P . 1
    Z = uint32(0)
    FULL = 0xFFFFFFFF
    NBARS = barrier_bytes(NST) // 8    # full, empty, merge, spare
    MERGE = 2 * NST
    SCR_ML = 8 * D                     # float offset of (m, l) after acc in a merge scratch slot

    def split_main(q, state, table, kv, part_acc, part_ml, tmap):
        # q (Hq*D,) f32; state int32; table (max_pages,) int32; kv (n_pages, n_kv, 2, 16, D) f16
        # part_acc (max_splits, Hq, D) f32; part_ml (max_splits, Hq, 2) f32; tmap (16,) u64
        # (with TMA, kv's tensor map; otherwise any array, unused)
        # PDL: no griddepcontrol.launch_dependents (module doc); the trigger at exit.
        smu = cuda.shared.array(0, uint32)       # (NST, NC) padded page slots, plan.row_offset
        smf = cuda.shared.array(0, float32)      # the same bytes: the consumers' merge scratch
        bars = cuda.shared.array(NBARS, uint64)  # full[NST], empty[NST], merge
        # Per-lane state first, in the entry block, so SROA keeps it in registers.
        qf = cuda.local.array(QW, uint32)        # A fragments of (q_hi; q_lo), per k-step
        qx = cuda.local.array(QW, float32)       # this lane's q values, loaded all at once
        acc = cuda.local.array(AW, float32)      # O[g, 8j + 2t + e], n-tile j
        sc = cuda.local.array(16, float32)       # score C fragments: [parity][n-tile][c0..c3]
        kof = cuda.local.array(4, uint32)        # TMA: per-lane K / V ldmatrix offsets
        vof = cuda.local.array(4, uint32)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        bar0 = cvta_to_shared_u32_at(bars, 0)    # full[i] = bar0 + 8i, empty[i] = bar0 + 8(NST + i)
        if TRIGGER:
            griddepcontrol_launch_dependents()
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
        n_pages, pps, n_splits = plan(length)
        # nca consumers share the split's pages (a stage holds nca of them): all NC, or with
        # PPC one per PPC pages of the plan, so a short context's split of one or two pages
        # is one consumer's, without the merge, and a long one's pages go to every consumer
        # tm: this split's pages come by tensor-map copies into swizzled slots (TMA, from TFROM
        # pages a split on), otherwise by bulk copies into padded rows; uniform for the grid
        tm = TMA and (TFROM == 0 or pps >= TFROM)
        sl = SLOT_T if tm else SLOT_B
        sal = TMA_ALIGN if tm else ALIGN     # the swizzle needs 1024-byte aligned slots
        nca = NC
        if PPC:
            nca = max(1, min(NC, pps // PPC))
        if tid == 0:
            for stage in range(NST):
                mbarrier_init(bar0 + 8 * stage, 1)
                mbarrier_init(bar0 + 8 * (NST + stage), nca * 32)
            if NC > 1 and nca > 1:
                mbarrier_init(bar0 + 8 * MERGE, (nca - 1) * 32)
            fence_mbarrier_init()
        cuda.syncthreads()
        if split >= n_splits:
            return  # uniform for the CTA; no barrier is used after this point by anyone
        p_begin = split * pps
        p_end = min(p_begin + pps, n_pages)
        n_iters = (p_end - p_begin + nca - 1) // nca
        sm0 = cvta_to_shared_u32_at(smu, 0)
        skip = (sal - sm0 % sal) % sal
        stage0 = sm0 + skip                  # sal-aligned; slot (stage, j) at (stage*NC+j)*sl
        w0 = skip // 4                       # the same place as a smu / smf index

        if warp == NC:
            # Producer.  The whole warp walks the loop; lanes < NCOPY each copy RPC rows a page.
            for it in range(n_iters):
                stage = it % NST
                # A fresh barrier counts its (virtual) previous phase as complete, so the
                # first NST waits with parity 1 pass at once.
                empty = bar0 + 8 * (NST + stage)
                while mbarrier_try_wait_parity(empty, ((it // NST) & 1) ^ 1) == 0:
                    pass
                p0 = p_begin + it * nca
                npg = min(nca, p_end - p0)
                if EARLY and p0 + npg >= n_pages:
                    griddepcontrol_wait()  # this stage holds the page rope_kv writes
                if lane == 0:
                    mbarrier_arrive_expect_tx(bar0 + 8 * stage, npg * PAGE_TX)
                cuda.syncwarp(FULL)
                if tm:
                    # one tensor copy a 64-dim half of a page (K and V, 16 rows) by lane i <
                    # npg * HALVES: the box at (page, kv head) pk, half hf (plan.tma_spec)
                    if lane < npg * HALVES:
                        j = lane // HALVES
                        hf = lane - j * HALVES
                        pk = table[p0 + j] * kv.shape[1] + kvh
                        dst = stage0 + (stage * NC + j) * sl + hf * TMA_HALF_BYTES
                        cp_async_bulk_tensor_5d_g2s(dst, tmap, 0, hf, 0, 0, pk, bar0 + 8 * stage)
                elif lane < NCOPY:
                    r0 = lane * RPC
                    for j in range(npg):
                        pid = table[p0 + j]
                        dst = stage0 + (stage * NC + j) * sl + r0 * ROW_BYTES + lane * PAD
                        cp_async_bulk_g2s(dst, kv, (pid, kvh, r0 // PAGE, r0 % PAGE, 0), COPY_BYTES,
                                          bar0 + 8 * stage)
                cuda.syncwarp(FULL)
        else:
            c = warp
            if c >= nca:
                return     # a consumer the plan does not use (PPC): no barrier counts it
            if EARLY:
                griddepcontrol_wait()  # q comes from rope_kv
            g = lane // 4
            t = lane % 4
            row_ok = g < GQA
            h = kvh * GQA + g
            # Every q value first, branch-free, then the splits: loaded inside a branch a pair,
            # the 16 loads went out one L2 round trip after another (ncu at 32K: 27 % of the
            # stall samples, docs/PERF.md 0.11).  Lanes past the GQA heads read a valid head's
            # values (qb: the last head of the group) and keep zeros.
            qb = (kvh * GQA + min(g, GQA - 1)) * D + 2 * t
            for kstep in range(KSTEPS):
                for half in range(2):                 # a0/a1 (dims 2t..), a2/a3 (dims 2t+8..)
                    d = qb + kstep * 16 + 8 * half
                    qx[4 * kstep + 2 * half] = q[d]
                    qx[4 * kstep + 2 * half + 1] = q[d + 1]
            for kstep in range(KSTEPS):
                for half in range(2):
                    x0 = qx[4 * kstep + 2 * half] * QSCALE
                    x1 = qx[4 * kstep + 2 * half + 1] * QSCALE
                    hi = pack_f16x2_from_f32(x0, x1)
                    h0, h1 = unpack_f16x2_to_f32(hi)
                    lo = pack_f16x2_from_f32(x0 - h0, x1 - h1)
                    qf[4 * kstep + 2 * half] = hi if row_ok else Z
                    qf[4 * kstep + 2 * half + 1] = lo if row_ok else Z
            for j in range(2 * NT):
                acc[j] = ZERO
            m = NEG
            l = ZERO
            # This lane's ldmatrix rows (see the module doc), as byte offsets in a page slot.
            kr = (lane % 8) + 8 * (lane // 16)
            vr = PAGE + (lane % 8) + 8 * ((lane // 8) % 2)
            hoff = 128     # bytes from dims 0-63 to 64-127 (the bulk layout's rows are whole)
            if tm:
                # token row r of K (V) is 128-byte row r (16 + r) of each half's 4 KB (plan.py),
                # its 16-byte chunk XOR r % 8 (= lane % 8 for both: the swizzle)
                koff = kr * 128
                kx = (((lane // 8) % 2) ^ (lane % 8)) * 16
                voff = vr * 128
                vx = ((lane // 16) ^ (lane % 8)) * 16
                hoff = TMA_HALF_BYTES
            else:
                koff = kr * ROW_BYTES + (kr // RPC) * PAD + 16 * ((lane // 8) % 2)
                voff = vr * ROW_BYTES + (vr // RPC) * PAD + 16 * (lane // 16)
                kx = vx = 0
            if TMA:
                # the (swizzled) column of each 16-dim step of a half, added to the page's base
                # as one register: XOR-ing it in the page loop cost ~3 instructions an ldmatrix
                for j in range(4):
                    kof[j] = uint32(koff + ((j * 32) ^ kx))
                    vof[j] = uint32(voff + ((j * 32) ^ vx))
            for it in range(n_iters):
                stage = it % NST
                mbarrier_wait_parity(bar0 + 8 * stage, (it // NST) & 1)
                cuda.syncwarp(FULL)  # converged for the .aligned ldmatrix / mma.sync below
                pg = p_begin + it * nca + c
                if pg < p_end:                          # warp-uniform
                    nv = min(PAGE, length - pg * PAGE)  # valid tokens of this page
                    slot = (stage * NC + c) * sl
                    base = stage0 + slot
                    if nv < PAGE:
                        # Zero the stale V rows nv..15 (tail page only): 0 * NaN = NaN in P V.
                        for i in range(lane, (PAGE - nv) * ROW_WORDS, 32):
                            if tm:
                                # a whole 128-byte row: the swizzle only permutes inside it
                                r = PAGE + nv + i // ROW_WORDS
                                w = i % ROW_WORDS
                                byte = slot + (w // 32) * TMA_HALF_BYTES + r * 128 + (w % 32) * 4
                                smu[w0 + byte // 4] = Z
                            else:
                                r = PAGE + nv + i // ROW_WORDS
                                byte = slot + r * ROW_BYTES + (r // RPC) * PAD
                                smu[w0 + byte // 4 + i % ROW_WORDS] = Z
                    if nv < PAGE:
                        cuda.syncwarp(FULL)      # the zeroed rows before ldmatrix
                    for j in range(16):
                        sc[j] = ZERO
                    for kstep in range(KSTEPS):
                        if TMA:
                            k0, k1, k2, k3 = ldmatrix_x4(
                                uint32(base) + kof[kstep % 4] + uint32((kstep // 4) * hoff))
                        else:
                            k0, k1, k2, k3 = ldmatrix_x4(base + koff + kstep * 32)
                        par = 8 * (kstep % 2)
                        a0, a1 = qf[4 * kstep], qf[4 * kstep + 1]
                        a2, a3 = qf[4 * kstep + 2], qf[4 * kstep + 3]
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
                    for db in range(KSTEPS):
                        if TMA:
                            v0, v1, v2, v3 = ldmatrix_x4_trans(
                                uint32(base) + vof[db % 4] + uint32((db // 4) * hoff))
                        else:
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
                        # The zeroing stores were generic-proxy writes; order
                        # them before any later bulk copy into this slot.
                        fence_proxy_async_shared()
                # Every consumer thread arrives (count nca*32): each thread's own reads of the
                # stage are ordered before the refill by its own release.
                mbarrier_arrive(bar0 + 8 * (NST + stage))
            if NC > 1 and nca > 1:
                stage_last = (n_iters - 1) % NST
                if c > 0:
                    # Merge scratch (8 x D acc, then 8 x (m, l)) in this warp's own slot of the
                    # last stage: every copy into it has landed and none is issued again.
                    fo = w0 + (stage_last * NC + c) * sl // 4
                    cuda.syncwarp(FULL)  # the warp's last ldmatrix of this slot is done
                    if row_ok:
                        for j in range(NT):
                            smf[fo + g * D + 8 * j + 2 * t] = acc[2 * j]
                            smf[fo + g * D + 8 * j + 2 * t + 1] = acc[2 * j + 1]
                        if t == 0:
                            smf[fo + SCR_ML + 2 * g] = m
                            smf[fo + SCR_ML + 2 * g + 1] = l
                    mbarrier_arrive(bar0 + 8 * MERGE)
                    return
                mbarrier_wait_parity(bar0 + 8 * MERGE, 0)
                if row_ok:
                    mx = m
                    for cc in range(1, nca):
                        fo = w0 + (stage_last * NC + cc) * sl // 4
                        mx = max(mx, smf[fo + SCR_ML + 2 * g])
                    w = math.exp2(m - mx)
                    l *= w
                    for j in range(2 * NT):
                        acc[j] *= w
                    for cc in range(1, nca):
                        fo = w0 + (stage_last * NC + cc) * sl // 4
                        w = math.exp2(smf[fo + SCR_ML + 2 * g] - mx)
                        l += smf[fo + SCR_ML + 2 * g + 1] * w
                        for j in range(NT):
                            acc[2 * j] += smf[fo + g * D + 8 * j + 2 * t] * w
                            acc[2 * j + 1] += smf[fo + g * D + 8 * j + 2 * t + 1] * w
                    m = mx
            if row_ok:   # the partial's place: [split, h] of part_acc / part_ml
                for j in range(NT):
                    part_acc[split, h, 8 * j + 2 * t] = acc[2 * j]
                    part_acc[split, h, 8 * j + 2 * t + 1] = acc[2 * j + 1]
                if t == 0:
                    part_ml[split, h, 0] = m
                    part_ml[split, h, 1] = l

    split_main = dev(split_main)

    if TMA:
        def attn_split_tma(q, state, table, kv, part_acc, part_ml, tmap):
            split_main(q, state, table, kv, part_acc, part_ml, tmap)
        return attn_split_tma

    def attn_split(q, state, table, kv, part_acc, part_ml):
        split_main(q, state, table, kv, part_acc, part_ml, table)
    return attn_split
