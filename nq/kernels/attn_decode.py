"""Paged-attention decode (one query token, GQA), warp-specialised, split over the context.

Two kernels, both launched with a fixed grid so one captured graph serves every step:

  attn_split    grid (max_splits, n_kv), block (NC + 1) warps.  CTA (split, kv head h) takes
                pages [split*pps, ...) of the context (length = state[STATE_POS] + 1, read on
                device) for the G = num_heads/num_kv query heads that share h.  Warp NC is the
                producer: its lane 0 issues one cp.async.bulk per (page, h) -- K and V are
                adjacent in the pool (nq/kv_cache.py), 8 KiB at head_dim 128 -- into NSTAGE=3
                stages of shared memory, each guarded by a full mbarrier (arrive.expect_tx +
                the copies' complete_tx) and an empty mbarrier (one arrival per consumer warp).
                Consumer warps 0..NC-1 take tokens t = w, w+NC, ... of each stage; a lane holds
                head_dim/32 dims of q (all G heads, in registers), K and V; scores are reduced
                with xor-shuffles and fed to an fp32 online softmax in the log2 domain (q is
                pre-scaled by log2(e)/sqrt(head_dim), exp2 everywhere).  At the end the NC warps
                merge through shared memory and write the split's partial (m, l, acc).
  attn_combine  grid (num_heads,), block head_dim: merges the splits' partials (flash-decoding)
                and writes o fp16 (num_heads*head_dim,), the o_proj GEMV input.

Split plan (same arithmetic in both kernels and in `split_plan`, the NumPy model):
    n_pages  = ceil(length / 16)
    pps      = max(min_pps, ceil(n_pages / max_splits))      pages per split
    n_splits = ceil(n_pages / pps)                            every split has >= 1 page
CTAs with split >= n_splits exit at once.  max_splits defaults to ~2 CTAs per SM over the kv
heads (66 for 4 kv heads on 132 SMs), so a single sequence fills the GPU from
min_pps*max_splits*16 tokens on (1056 tokens for the 7B).

No __syncthreads inside a role branch: the CTA syncs once after mbarrier init and once after
both roles finish (before the merge, which reuses the stage memory).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from nq.kv_cache import PAGE, STATE_POS

NSTAGE = 3       # shared-memory stages (triple buffering)
NC = 4           # consumer warps
MIN_PPS = 1      # fewest pages a split takes: 1 measured best (512 tokens: 15.7 vs 20.7 us at 4)
NEG_BIG = -1e30  # finite "-inf": exp2(NEG_BIG - m) == 0 and NEG_BIG - NEG_BIG is not NaN
LOG2E = 1.4426950408889634
SMEM_LIMIT = 48 * 1024  # dynamic + static shared memory without the opt-in attribute


# ---- NumPy reference ---------------------------------------------------------------------------

def attention_reference(q, k, v):
    """q (Hq, D), k and v (S, Hkv, D) -> o (Hq, D) float64: softmax(q k^T / sqrt(D)) v, GQA.

    Computed in float64 from the values given (the test passes the same fp16 K/V the kernel
    reads), so the only differences left are the kernel's fp32 rounding and exp2 approximation.
    """
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    hq, d = q.shape
    g = hq // k.shape[1]
    kk = np.repeat(k, g, axis=1)  # (S, Hq, D)
    vv = np.repeat(v, g, axis=1)
    s = np.einsum("hd,shd->hs", q, kk) / math.sqrt(d)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return np.einsum("hs,shd->hd", p, vv)


def split_plan(length: int, max_splits: int, min_pps: int = MIN_PPS) -> tuple[int, int]:
    """(pages per split, number of splits) for a context of `length` tokens (module doc)."""
    n_pages = -(-length // PAGE)
    pps = max(min_pps, -(-n_pages // max_splits))
    return pps, -(-n_pages // pps)


def split_combine_model(q, k, v, max_splits: int, min_pps: int = MIN_PPS):
    """NumPy model of attn_split + attn_combine (log2-domain partials), float64.

    Equals attention_reference up to rounding; the CPU test checks it, so the GPU test only
    has to check the kernels against the plain reference.
    """
    q = np.asarray(q, np.float64)
    hq, d = q.shape
    g = hq // k.shape[1]
    length = k.shape[0]
    pps, n_splits = split_plan(length, max_splits, min_pps)
    qs = q * (LOG2E / math.sqrt(d))
    kk = np.repeat(np.asarray(k, np.float64), g, axis=1)
    vv = np.repeat(np.asarray(v, np.float64), g, axis=1)
    ms, ls, accs = [], [], []
    for s in range(n_splits):
        lo, hi = s * pps * PAGE, min((s + 1) * pps * PAGE, length)
        sc = np.einsum("hd,shd->hs", qs, kk[lo:hi])  # (Hq, n) log2-domain scores
        m = sc.max(axis=1)
        p = np.exp2(sc - m[:, None])
        ms.append(m)
        ls.append(p.sum(axis=1))
        accs.append(np.einsum("hs,shd->hd", p, vv[lo:hi]))
    m = np.stack(ms)  # (n_splits, Hq)
    mx = m.max(axis=0)
    w = np.exp2(m - mx)
    num = np.einsum("sh,shd->hd", w, np.stack(accs))
    den = np.einsum("sh,sh->h", w, np.stack(ls))
    return num / den[:, None]


def default_max_splits(num_kv_heads: int, n_sms: int = 132, ctas_per_sm: int = 2) -> int:
    return max(1, -(-ctas_per_sm * n_sms // num_kv_heads))


def smem_bytes(gqa: int, head_dim: int, pps: int, nc: int = NC) -> int:
    """Dynamic shared memory of attn_split: the stages, then fp32 q / acc / m / l."""
    stages = NSTAGE * pps * 2 * PAGE * head_dim * 2
    state = 4 * (nc * gqa * head_dim + gqa * head_dim + 2 * nc * gqa)
    return stages + state


def default_pages_per_stage(gqa: int, head_dim: int, nc: int = NC) -> int:
    """Most pages per stage that fit 48 KiB with the 48 B of static barriers (1 at d=128)."""
    pps = 1
    while smem_bytes(gqa, head_dim, pps + 1, nc) + 64 <= SMEM_LIMIT:
        pps += 1
    return pps


# ---- kernels -----------------------------------------------------------------------------------

@functools.cache
def _split_kernel(gqa: int, head_dim: int, num_kv: int, pps: int, max_splits: int, min_pps: int,
                  nc: int = NC):
    """attn_split_g{gqa}_d{head_dim}_kv{num_kv}_pps{pps}_s{max_splits}_nc{nc}."""
    from numba import cuda
    from numba.cuda.types import boolean, float16, float32, uint64

    from nq.kernels._ptx_attn import (cp_async_bulk_g2s, fence_mbarrier_init, mbarrier_arrive,
                                      mbarrier_arrive_expect_tx, mbarrier_init,
                                      mbarrier_try_wait_parity, smem_addr_u32)

    G, D, DPL = gqa, head_dim, head_dim // 32
    NC = nc
    PAGE_ELEMS = 2 * PAGE * D            # K then V of one (page, kv head), fp16
    PAGE_BYTES = PAGE_ELEMS * 2
    STAGE_ELEMS = pps * PAGE_ELEMS
    STAGE_TOK = pps * PAGE
    PPS, MAXS, MINP = pps, max_splits, min_pps
    QSCALE = float32(LOG2E / math.sqrt(D))
    NEG = float32(NEG_BIG)
    # fp32 regions after the stages: acc (NC, G, D) unnormalised sum p*v per consumer warp,
    # q (G, D) pre-scaled, m (NC, G) and l (NC, G) per consumer warp (written at the end).
    F_ACC = NSTAGE * pps * PAGE_BYTES // 4
    F_Q = F_ACC + NC * G * D
    F_M = F_Q + G * D
    F_L = F_M + NC * G
    NTHREADS = (NC + 1) * 32
    NBARS = 2 * NSTAGE
    TPW = PAGE // NC                     # tokens of a page per consumer warp

    def attn_split(q, state, table, kv, part_acc, part_ml):
        # q (Hq*D,) f32; state int32; table (max_pages,) int32; kv (n_pages, n_kv, 2, 16, D) f16
        # part_acc (max_splits, Hq, D) f32; part_ml (max_splits, Hq, 2) f32
        sm = cuda.shared.array(0, float16)   # (NSTAGE, PPS, 2, 16, D) fp16 stages, then ...
        smf = cuda.shared.array(0, float32)  # ... the fp32 regions F_ACC, F_Q, F_M, F_L
        bars = cuda.shared.array(NBARS, uint64)  # full[0..2], empty[0..2]
        # Per-lane state; declared first so the allocas sit in the entry block, where LLVM's
        # SROA turns them into registers (declared inside a branch they stay in local memory).
        qv = cuda.local.array(DPL, float32)
        kf = cuda.local.array((TPW, DPL), float32)
        vf = cuda.local.array((TPW, DPL), float32)
        ok = cuda.local.array(TPW, boolean)
        scs = cuda.local.array(TPW, float32)
        ps = cuda.local.array(TPW, float32)
        split = cuda.blockIdx.x
        kvh = cuda.blockIdx.y
        length = state[STATE_POS] + 1
        n_pages = (length + PAGE - 1) // PAGE
        pps = max(MINP, (n_pages + MAXS - 1) // MAXS)
        n_splits = (n_pages + pps - 1) // pps
        if split >= n_splits:
            return  # uniform for the CTA, before any barrier
        p_begin = split * pps
        p_end = min(p_begin + pps, n_pages)
        n_iters = (p_end - p_begin + PPS - 1) // PPS
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        bar0 = smem_addr_u32(bars, 0)  # full[s] = bar0 + 8s, empty[s] = bar0 + 8(NSTAGE+s)

        if tid == 0:
            for s in range(NSTAGE):
                mbarrier_init(bar0 + 8 * s, 1)
                mbarrier_init(bar0 + 8 * (NSTAGE + s), NC * 32)
            fence_mbarrier_init()
        for idx in range(tid, G * D, NTHREADS):
            smf[F_Q + idx] = q[kvh * G * D + idx] * QSCALE
        cuda.syncthreads()

        if warp == NC:
            # Producer.  The whole warp walks the loop (so it reaches the CTA barrier below
            # converged: bar.sync is .aligned); lane 0 alone drives the copy engine.
            stage0 = smem_addr_u32(sm, 0)
            for it in range(n_iters):
                s = it % NSTAGE
                # A fresh barrier counts its (virtual) previous phase as complete, so the
                # first NSTAGE waits with parity 1 pass at once.
                while mbarrier_try_wait_parity(bar0 + 8 * (NSTAGE + s), ((it // NSTAGE) & 1) ^ 1) == 0:
                    pass
                if lane == 0:
                    p0 = p_begin + it * PPS
                    npg = min(PPS, p_end - p0)
                    mbarrier_arrive_expect_tx(bar0 + 8 * s, npg * PAGE_BYTES)
                    for j in range(npg):
                        pid = table[p0 + j]
                        cp_async_bulk_g2s(stage0 + (s * PPS + j) * PAGE_BYTES, kv, (pid, kvh, 0, 0, 0),
                                          PAGE_BYTES, bar0 + 8 * s)
                cuda.syncwarp(0xFFFFFFFF)
        else:
            # Consumers: warp w takes slots w, w+NC, w+2NC, w+3NC of every page (TPW tokens).
            # The TPW dot products and shuffle chains of a head are independent and branch-free
            # (masking by select).  The head loop is NOT unrolled by NVVM (too large), so
            # per-head state lives where a runtime index reaches it without local memory: q and
            # acc in shared memory (this lane's dims only), m and l in lane g's registers.
            # Measured: latency-bound on the serial per-head chain (~3 us per page per CTA at
            # 7 heads; docs/KERNELS_ATTN.md).  An earlier per-token variant (q/acc in
            # registers, lazy rescale branch) was ~20% faster at 8K but had the n_tok bug.
            m_r = NEG
            l_r = float32(0.0)
            for g in range(G):
                for j in range(DPL):
                    smf[F_ACC + (warp * G + g) * D + lane * DPL + j] = 0.0
            for it in range(n_iters):
                s = it % NSTAGE
                while mbarrier_try_wait_parity(bar0 + 8 * s, (it // NSTAGE) & 1) == 0:
                    pass
                tok0 = (p_begin + it * PPS) * PAGE
                n_tok = min(min(length, p_end * PAGE) - tok0, STAGE_TOK)  # valid tokens in stage
                for pg in range((n_tok + PAGE - 1) // PAGE):
                    pbase = s * STAGE_ELEMS + pg * PAGE_ELEMS + lane * DPL
                    for i in range(TPW):
                        slot = warp + NC * i
                        ok[i] = pg * PAGE + slot < n_tok
                        for j in range(DPL):
                            kf[i, j] = float32(sm[pbase + slot * D + j])
                            # Slots past the length hold whatever the pool had (NaN possibly):
                            # zero V so that p = 0 really contributes nothing.
                            vv = float32(sm[pbase + (PAGE + slot) * D + j])
                            vf[i, j] = vv if ok[i] else float32(0.0)
                    for g in range(G):
                        for j in range(DPL):
                            qv[j] = smf[F_Q + g * D + lane * DPL + j]
                        m_old = cuda.shfl_sync(0xFFFFFFFF, m_r, g)
                        l_old = cuda.shfl_sync(0xFFFFFFFF, l_r, g)
                        mx = m_old
                        for i in range(TPW):
                            sc = float32(0.0)
                            for j in range(DPL):
                                sc += qv[j] * kf[i, j]
                            sc += cuda.shfl_xor_sync(0xFFFFFFFF, sc, 16)
                            sc += cuda.shfl_xor_sync(0xFFFFFFFF, sc, 8)
                            sc += cuda.shfl_xor_sync(0xFFFFFFFF, sc, 4)
                            sc += cuda.shfl_xor_sync(0xFFFFFFFF, sc, 2)
                            sc += cuda.shfl_xor_sync(0xFFFFFFFF, sc, 1)
                            sc = sc if ok[i] else NEG
                            scs[i] = sc
                            mx = max(mx, sc)
                        alpha = math.exp2(m_old - mx)
                        psum = float32(0.0)
                        for i in range(TPW):
                            pi = math.exp2(scs[i] - mx)
                            ps[i] = pi if ok[i] else float32(0.0)
                            psum += ps[i]
                        if lane == g:
                            m_r = mx
                            l_r = l_old * alpha + psum
                        ao = F_ACC + (warp * G + g) * D + lane * DPL
                        for j in range(DPL):
                            a = smf[ao + j] * alpha
                            for i in range(TPW):
                                a += ps[i] * vf[i, j]
                            smf[ao + j] = a
                # Every consumer thread arrives (count NC*32): each thread's own reads of the
                # stage are then ordered before the refill by its own release, with no reliance
                # on __syncwarp cumulativity.
                mbarrier_arrive(bar0 + 8 * (NSTAGE + s))
            if lane < G:
                smf[F_M + warp * G + lane] = m_r
                smf[F_L + warp * G + lane] = l_r

        cuda.syncthreads()  # both roles done; every consumer's acc, m, l is in shared memory
        for idx in range(tid, G * D, NTHREADS):
            g = idx // D
            d = idx % D
            mx = smf[F_M + g]
            for w in range(1, NC):
                mx = max(mx, smf[F_M + w * G + g])
            a = float32(0.0)
            lsum = float32(0.0)
            for w in range(NC):
                sc = math.exp2(smf[F_M + w * G + g] - mx)
                a += smf[F_ACC + (w * G + g) * D + d] * sc
                lsum += smf[F_L + w * G + g] * sc
            h = kvh * G + g
            part_acc[split, h, d] = a
            if d == 0:
                part_ml[split, h, 0] = mx
                part_ml[split, h, 1] = lsum

    return attn_split


@functools.cache
def _combine_kernel(head_dim: int, max_splits: int, min_pps: int):
    """attn_combine_d{head_dim}_s{max_splits}: merge split partials, o fp16."""
    from numba import cuda
    from numba.cuda.types import float16, float32

    MAXS, MINP = max_splits, min_pps

    def attn_combine(state, part_acc, part_ml, o):
        # part_acc (max_splits, Hq, D) f32; part_ml (max_splits, Hq, 2) f32; o (Hq*D,) f16
        h = cuda.blockIdx.x
        d = cuda.threadIdx.x
        length = state[STATE_POS] + 1
        n_pages = (length + PAGE - 1) // PAGE
        pps = max(MINP, (n_pages + MAXS - 1) // MAXS)
        n_splits = (n_pages + pps - 1) // pps
        mx = part_ml[0, h, 0]
        for s in range(1, n_splits):
            mx = max(mx, part_ml[s, h, 0])
        num = float32(0.0)
        den = float32(0.0)
        for s in range(n_splits):
            w = math.exp2(part_ml[s, h, 0] - mx)
            num += part_acc[s, h, d] * w
            den += part_ml[s, h, 1] * w
        o[h * head_dim + d] = float16(num / den)

    return attn_combine


SPLIT_SIG = "void(float32[::1], int32[::1], int32[::1], float16[:, :, :, :, ::1], float32[:, :, ::1], float32[:, :, ::1])"
COMBINE_SIG = "void(int32[::1], float32[:, :, ::1], float32[:, :, ::1], float16[::1])"


@functools.cache
def _jit(kind: str, *key):
    from numba import cuda
    if kind == "split":
        return cuda.jit(SPLIT_SIG, fastmath=True, lineinfo=False)(_split_kernel(*key))
    return cuda.jit(COMBINE_SIG, fastmath=True)(_combine_kernel(*key))


def _allow_smem(kernel, nbytes: int) -> None:
    """Opt the kernel into more than 48 KiB of dynamic shared memory (cuFuncSetAttribute)."""
    from numba.cuda.cudadrv import driver as drv
    from numba.cuda.cudadrv.driver import binding
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    for k in kernel.overloads.values():
        fn = k._codelibrary.get_cufunc()
        drv.driver.cuKernelSetAttribute(attr, int(nbytes), fn.handle, fn.device.id)


# ---- launcher ------------------------------------------------------------------------------------

def attn_workspace(cfg, max_splits: int | None = None):
    """Device partial buffers for one attention call site (reusable across layers)."""
    from numba import cuda
    ms = max_splits or default_max_splits(cfg.num_kv_heads)
    part_acc = cuda.device_array((ms, cfg.num_heads, cfg.head_dim), np.float32)  # (max_splits, Hq, D)
    part_ml = cuda.device_array((ms, cfg.num_heads, 2), np.float32)              # (max_splits, Hq, (m, l))
    return part_acc, part_ml


def attn_decode_launcher(cfg, q, state, table, kv_layer, o, part_acc, part_ml,
                         pages_per_stage: int | None = None, min_pps: int = MIN_PPS, nc: int = NC):
    """Check shapes once; return `launch(stream=0)` running attn_split then attn_combine.

    q (num_heads*head_dim,) f32 (rope_kv's output), state int32 (STATE_LEN,), table int32
    (max_pages,), kv_layer (n_pages, num_kv_heads, 2, 16, head_dim) f16 (nq/kv_cache.py),
    o (num_heads*head_dim,) f16, part_acc/part_ml from attn_workspace.  The context length is
    state[STATE_POS] + 1 at run time; the caller guarantees table covers it.
    """
    G, D, hq, hkv = cfg.gqa_ratio, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    if not 1 <= G <= 8:
        raise ValueError(f"attention supports 1..8 query heads per kv head, got {G}")
    ms = part_acc.shape[0]
    want = {"q": (q, (hq * D,), np.float32), "o": (o, (hq * D,), np.float16),
            "part_acc": (part_acc, (ms, hq, D), np.float32),
            "part_ml": (part_ml, (ms, hq, 2), np.float32)}
    for name, (a, shape, dt) in want.items():
        if tuple(a.shape) != shape or a.dtype != dt:
            raise ValueError(f"attention: {name} is {a.dtype}{tuple(a.shape)}, want {np.dtype(dt)}{shape}")
    if kv_layer.dtype != np.float16 or tuple(kv_layer.shape[1:]) != (hkv, 2, PAGE, D):
        raise ValueError(f"attention: kv_layer is {kv_layer.dtype}{tuple(kv_layer.shape)}, "
                         f"want float16(n_pages, {hkv}, 2, {PAGE}, {D})")
    if table.dtype != np.int32 or state.dtype != np.int32:
        raise ValueError("attention: table and state must be int32")
    if kv_layer.__cuda_array_interface__["data"][0] % 128:
        raise ValueError("attention: kv_layer must be 128-byte aligned (bulk copies)")
    if PAGE % nc:
        raise ValueError(f"attention: {nc} consumer warps do not divide a {PAGE}-token page")
    pps = pages_per_stage or default_pages_per_stage(G, D, nc)
    split = _jit("split", G, D, hkv, pps, ms, min_pps, nc)
    combine = _jit("combine", D, ms, min_pps)
    nbytes = smem_bytes(G, D, pps, nc)
    if nbytes + 64 > SMEM_LIMIT:
        _allow_smem(split, nbytes)

    def launch(stream=0):
        split[(ms, hkv), (nc + 1) * 32, stream, nbytes](q, state, table, kv_layer, part_acc, part_ml)
        combine[hq, D, stream](state, part_acc, part_ml, o)

    return launch
