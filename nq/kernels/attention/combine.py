"""Paged-attention decode (one query token, GQA), warp-specialised, split over the context.

Two kernels, both launched with a fixed grid so one captured graph serves every step:

  attn_split    grid (max_splits, n_kv), block G + 1 warps (G = num_heads/num_kv query heads
                per kv head).  CTA (split, kv head h) takes pages [split*pps, ...) of the
                context (length = state[STATE_POS] + 1, read on device).  Warp G is the
                producer: its lane 0 issues one cp.async.bulk per (page, h) -- K and V are
                adjacent in the pool (nq/runtime/kv_cache.py), 8 KiB at head_dim 128 -- into NSTAGE=3
                stages of shared memory, each guarded by a full mbarrier (arrive.expect_tx +
                the copies' complete_tx) and an empty mbarrier (one arrival per consumer thread).
                Consumer warp g owns query head h*G + g: a lane keeps head_dim/32 dims of q
                (pre-scaled by log2(e)/sqrt(head_dim)) and of the fp32 accumulator in registers,
                m and l in registers, so there is no head loop.  Per page a lane forms partial
                dot products for all 16 tokens (16 independent chains), then a transposed
                butterfly (8+4+2+1+1 shuffles instead of 16x5) leaves token lane//2's score in
                lanes 2t and 2t+1; one online-softmax rescale per page (exp2, fp32), and the 16
                p's are broadcast by shuffle for the V accumulation.  Each warp writes its
                head's split partial (m, l, acc) straight from registers.
  attn_combine  grid (num_heads,), block head_dim*CSG: merges the splits' partials
                (flash-decoding) in a fixed order and writes o fp16 (num_heads*head_dim,), the
                o_proj GEMV input.  CSG split groups with 4 loads in flight each keep the
                merge from being one long chain of dependent L2 round trips.

Split plan (same arithmetic in both kernels and in `split_plan`, the NumPy model):
    n_pages  = ceil(length / 16)
    pps      = max(min_pps, ceil(n_pages / max_splits))      pages per split
    n_splits = ceil(n_pages / pps)                            every split has >= 1 page
CTAs with split >= n_splits exit at once.  max_splits defaults to ~2 CTAs per SM over the kv
heads (66 for 4 kv heads on 132 SMs).

No __syncthreads inside a role branch: the CTA syncs once, after mbarrier init; the roles then
run to the end without meeting again (every copy issued is waited for by the consumers, so no
bulk copy is in flight when the CTA exits).

The previous kernel (NC=4 consumer warps over the tokens of a page, a runtime loop over the G
heads with q/acc in shared memory) lost: 15.7 / 43.6 / 118.8 us per layer at 512 / 8K / 32K
tokens (docs/KERNELS_ATTN.md); it is in git history (commit b4397d6), not kept importable.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from nq.paged import PAGE, STATE_POS, check_paged_args

NSTAGE = 3       # shared-memory stages (triple buffering)
MIN_PPS = 1      # fewest pages a split takes: 1 measured best (512 tokens: 15.7 vs 20.7 us at 4)
CSG = 4          # split groups per head in attn_combine (block head_dim * CSG)
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


def transposed_butterfly(partial):
    """NumPy model of attn_split's score reduction: partial (32 lanes, 16 tokens) -> (32,),
    lane L holding sum over lanes of token L >> 1, with the kernel's exact keep/send schedule."""
    v = np.array(partial, np.float64).copy()
    lanes = np.arange(32)
    n = PAGE // 2
    for off in (16, 8, 4, 2):
        hi = (lanes & off) != 0
        x, y = v[:, :n].copy(), v[:, n:2 * n].copy()
        keep = np.where(hi[:, None], y, x)
        send = np.where(hi[:, None], x, y)
        v = keep + send[lanes ^ off]
        n //= 2
    return v[:, 0] + v[lanes ^ 1, 0]


def default_max_splits(num_kv_heads: int, n_sms: int = 132, ctas_per_sm: int = 2) -> int:
    return max(1, -(-ctas_per_sm * n_sms // num_kv_heads))


def smem_bytes(head_dim: int, pps: int) -> int:
    """Dynamic shared memory of attn_split: NSTAGE stages of pps (K, V) pages, fp16."""
    return NSTAGE * pps * 2 * PAGE * head_dim * 2


def default_pages_per_stage(head_dim: int) -> int:
    """Most pages per stage that fit 48 KiB with the 48 B of static barriers (1 at d=128)."""
    pps = 1
    while smem_bytes(head_dim, pps + 1) + 64 <= SMEM_LIMIT:
        pps += 1
    return pps


# ---- kernels -----------------------------------------------------------------------------------

@functools.cache
def _split_kernel(gqa: int, head_dim: int, num_kv: int, pps: int, max_splits: int, min_pps: int):
    """attn_split_g{gqa}_d{head_dim}_kv{num_kv}_pps{pps}_s{max_splits}."""
    from numba import cuda
    from numba.cuda.types import float32, uint32, uint64

    from nq.kernels.common import dev, warp_sum
    from nq.ptx import (cp_async_bulk_g2s, cvta_to_shared_u32_at, fence_mbarrier_init,
                        griddepcontrol_launch_dependents, griddepcontrol_wait, mbarrier_arrive, mbarrier_arrive_expect_tx, mbarrier_init,
                        mbarrier_try_wait_parity, unpack_f16x2_to_f32)

    G, D, DPL = gqa, head_dim, head_dim // 32
    W = DPL // 2                         # fp16 pairs (u32 words) of one row a lane holds
    ROW = D // 2                         # u32 words per token row
    PAGE_WORDS = 2 * PAGE * ROW          # K then V of one (page, kv head)
    PAGE_BYTES = PAGE_WORDS * 4
    STAGE_WORDS = pps * PAGE_WORDS
    STAGE_TOK = pps * PAGE
    PPS, MAXS, MINP = pps, max_splits, min_pps
    QSCALE = float32(LOG2E / math.sqrt(D))
    NEG = float32(NEG_BIG)
    FULL = 0xFFFFFFFF
    wsum = dev(warp_sum)   # nq/kernels/common.py
    NBARS = 2 * NSTAGE

    def attn_split(q, state, table, kv, part_acc, part_ml):
        # q (Hq*D,) f32; state int32; table (max_pages,) int32; kv (n_pages, n_kv, 2, 16, D) f16
        # part_acc (max_splits, Hq, D) f32; part_ml (max_splits, Hq, 2) f32
        smu = cuda.shared.array(0, uint32)       # (NSTAGE, PPS, 2, 16, D/2) fp16 pairs
        bars = cuda.shared.array(NBARS, uint64)  # full[0..2], empty[0..2]
        # Per-lane state; declared first so the allocas sit in the entry block, where LLVM's
        # SROA turns them into registers (every index below is a compile-time constant).
        qv = cuda.local.array(DPL, float32)
        acc = cuda.local.array(DPL, float32)
        sc = cuda.local.array(PAGE, float32)
        # PDL: q and this step's K/V come from rope_kv.  No early launch_dependents: the
        # combine can do nothing before this kernel ends, and at 8K its waiting CTAs (and the
        # o_proj's behind it) made this kernel 1.5x slower (1.33 vs 0.89 ms over 28 layers).
        griddepcontrol_wait()
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
        bar0 = cvta_to_shared_u32_at(bars, 0)  # full[s] = bar0 + 8s, empty[s] = bar0 + 8(NSTAGE+s)

        if tid == 0:
            for s in range(NSTAGE):
                mbarrier_init(bar0 + 8 * s, 1)
                mbarrier_init(bar0 + 8 * (NSTAGE + s), G * 32)
            fence_mbarrier_init()
        cuda.syncthreads()

        if warp == G:
            # Producer.  The whole warp walks the loop; lane 0 alone drives the copy engine.
            stage0 = cvta_to_shared_u32_at(smu, 0)
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
                cuda.syncwarp(FULL)
        else:
            h = kvh * G + warp
            for j in range(DPL):
                qv[j] = q[h * D + lane * DPL + j] * QSCALE
                acc[j] = float32(0.0)
            m = NEG
            l_part = float32(0.0)     # this lane's share of l (even lanes count their token)
            even = (lane & 1) == 0
            t_own = lane >> 1         # the token whose score this lane holds after the butterfly
            for it in range(n_iters):
                s = it % NSTAGE
                while mbarrier_try_wait_parity(bar0 + 8 * s, (it // NSTAGE) & 1) == 0:
                    pass
                tok0 = (p_begin + it * PPS) * PAGE
                n_tok = min(min(length, p_end * PAGE) - tok0, STAGE_TOK)  # valid tokens in stage
                for pg in range(PPS):
                    nv = n_tok - pg * PAGE   # valid tokens of this page (warp-uniform)
                    if nv > 0:
                        kb = s * STAGE_WORDS + pg * PAGE_WORDS + lane * W
                        vb = kb + PAGE * ROW
                        # 16 independent partial dot products over this lane's dims.
                        for t in range(PAGE):
                            a = float32(0.0)
                            for w in range(W):
                                k0, k1 = unpack_f16x2_to_f32(smu[kb + t * ROW + w])
                                a += qv[2 * w] * k0 + qv[2 * w + 1] * k1
                            sc[t] = a
                        # Transposed butterfly (NumPy model: transposed_butterfly): at offset
                        # o = 16, 8, 4, 2 a lane keeps the half of its tokens selected by its
                        # lane bit o and sends the other half to lane ^ o, so 8+4+2+1 shuffles
                        # instead of 16 x 5; the xor-1 round sums the one value left.  Lane L
                        # ends with token L >> 1.
                        for i in range(8):
                            x, y = sc[i], sc[i + 8]
                            hi = (lane & 16) != 0
                            sc[i] = (y if hi else x) + cuda.shfl_xor_sync(FULL, x if hi else y, 16)
                        for i in range(4):
                            x, y = sc[i], sc[i + 4]
                            hi = (lane & 8) != 0
                            sc[i] = (y if hi else x) + cuda.shfl_xor_sync(FULL, x if hi else y, 8)
                        for i in range(2):
                            x, y = sc[i], sc[i + 2]
                            hi = (lane & 4) != 0
                            sc[i] = (y if hi else x) + cuda.shfl_xor_sync(FULL, x if hi else y, 4)
                        x, y = sc[0], sc[1]
                        hi = (lane & 2) != 0
                        sc[0] = (y if hi else x) + cuda.shfl_xor_sync(FULL, x if hi else y, 2)
                        score = sc[0] + cuda.shfl_xor_sync(FULL, sc[0], 1)
                        ok = t_own < nv
                        score = score if ok else NEG    # tail slots hold stale K (NaN even)
                        pm = score
                        pm = max(pm, cuda.shfl_xor_sync(FULL, pm, 2))
                        pm = max(pm, cuda.shfl_xor_sync(FULL, pm, 4))
                        pm = max(pm, cuda.shfl_xor_sync(FULL, pm, 8))
                        pm = max(pm, cuda.shfl_xor_sync(FULL, pm, 16))
                        m_new = max(m, pm)
                        alpha = math.exp2(m - m_new)
                        p = math.exp2(score - m_new)
                        p = p if ok else float32(0.0)
                        l_part = l_part * alpha + (p if even else float32(0.0))
                        m = m_new
                        for j in range(DPL):
                            acc[j] *= alpha
                        for t in range(PAGE):
                            pt = cuda.shfl_sync(FULL, p, 2 * t)
                            okt = t < nv
                            for w in range(W):
                                v0, v1 = unpack_f16x2_to_f32(smu[vb + t * ROW + w])
                                # Zero stale V past the length: p = 0 must contribute nothing.
                                acc[2 * w] += pt * (v0 if okt else float32(0.0))
                                acc[2 * w + 1] += pt * (v1 if okt else float32(0.0))
                # Every consumer thread arrives (count G*32): each thread's own reads of the
                # stage are ordered before the refill by its own release.
                mbarrier_arrive(bar0 + 8 * (NSTAGE + s))
            l_part = wsum(l_part)
            for j in range(DPL):
                part_acc[split, h, lane * DPL + j] = acc[j]
            if lane == 0:
                part_ml[split, h, 0] = m
                part_ml[split, h, 1] = l_part

    return attn_split


@functools.cache
def _combine_kernel(head_dim: int, max_splits: int, min_pps: int):
    """attn_combine_d{head_dim}_s{max_splits}: merge split partials, o fp16."""
    from numba import cuda
    from numba.cuda.types import float16, float32

    from nq.kernels.common import dev, warp_max, warp_sum
    from nq.ptx import griddepcontrol_launch_dependents, griddepcontrol_wait

    D, MAXS, MINP = head_dim, max_splits, min_pps
    NEG = float32(NEG_BIG)
    wsum, wmax = dev(warp_sum), dev(warp_max)   # nq/kernels/common.py
    RED = CSG * head_dim

    def attn_combine(state, part_acc, part_ml, o):
        # part_acc (max_splits, Hq, D) f32; part_ml (max_splits, Hq, 2) f32; o (Hq*D,) f16
        wts = cuda.shared.array(MAXS, float32)     # exp2(m_s - max m) per split
        red = cuda.shared.array(RED, float32)  # per split group sums
        inv = cuda.shared.array(1, float32)        # 1 / sum_s l_s w_s
        # PDL: trigger before waiting -- this kernel is tiny, so o_proj (next) is scheduled at
        # once and streams its weights into L2 while the merge runs.
        griddepcontrol_launch_dependents()
        griddepcontrol_wait()
        h = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        d = tid % D
        sg = tid // D
        length = state[STATE_POS] + 1
        n_pages = (length + PAGE - 1) // PAGE
        pps = max(MINP, (n_pages + MAXS - 1) // MAXS)
        n_splits = (n_pages + pps - 1) // pps
        if tid < 32:
            mx = NEG
            for s in range(tid, n_splits, 32):
                mx = max(mx, part_ml[s, h, 0])
            mx = wmax(mx)
            den = float32(0.0)
            for s in range(tid, n_splits, 32):
                w = math.exp2(part_ml[s, h, 0] - mx)
                wts[s] = w
                den += part_ml[s, h, 1] * w
            # Fixed butterfly: every lane ends with the same sum, the same every run.
            den = wsum(den)
            if tid == 0:
                inv[0] = float32(1.0) / den
        cuda.syncthreads()
        # Group sg sums splits sg, sg+CSG, ...; 4 loads in flight per round.  Rows past
        # n_splits (clamped, never written: maybe NaN) are dropped by select, not by weight.
        a = float32(0.0)
        for s0 in range(sg, n_splits, 4 * CSG):
            for u in range(4):
                s = s0 + u * CSG
                sc = min(s, MAXS - 1)
                x = part_acc[sc, h, d] * wts[sc]
                a += x if s < n_splits else float32(0.0)
        red[sg * D + d] = a
        cuda.syncthreads()
        if sg == 0:
            t = red[d]
            for g in range(1, CSG):
                t += red[g * D + d]
            o[h * D + d] = float16(t * inv[0])

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


def check_attention_args(cfg, q, state, table, kv_layer, o, part_acc, part_ml) -> None:
    """The launchers' shared argument check (this kernel's and nq/kernels/attention/decode.py's)."""
    G, D, hq = cfg.gqa_ratio, cfg.head_dim, cfg.num_heads
    if not 1 <= G <= 8:
        raise ValueError(f"attention supports 1..8 query heads per kv head, got {G}")
    if D not in (64, 128):
        raise ValueError(f"attention supports head_dim 64 or 128, got {D}")
    ms = part_acc.shape[0]
    want = {"q": (q, (hq * D,), np.float32), "o": (o, (hq * D,), np.float16),
            "part_acc": (part_acc, (ms, hq, D), np.float32),
            "part_ml": (part_ml, (ms, hq, 2), np.float32)}
    for name, (a, shape, dt) in want.items():
        if tuple(a.shape) != shape or a.dtype != dt:
            raise ValueError(f"attention: {name} is {a.dtype}{tuple(a.shape)}, want {np.dtype(dt)}{shape}")
    check_paged_args("attention", cfg, kv_layer, table, state)
    from nq.ptx import SIMULATOR  # the simulator's arrays are host arrays, aligned as numpy likes
    if not SIMULATOR and kv_layer.__cuda_array_interface__["data"][0] % 128:
        raise ValueError("attention: kv_layer must be 128-byte aligned (bulk copies)")


def attn_decode_launcher(cfg, q, state, table, kv_layer, o, part_acc, part_ml,
                         pages_per_stage: int | None = None, min_pps: int = MIN_PPS):
    """Check shapes once; return `launch(stream=0)` running attn_split then attn_combine.

    q (num_heads*head_dim,) f32 (rope_kv's output), state int32 (STATE_LEN,), table int32
    (max_pages,), kv_layer (n_pages, num_kv_heads, 2, 16, head_dim) f16 (nq/runtime/kv_cache.py),
    o (num_heads*head_dim,) f16, part_acc/part_ml from attn_workspace.  The context length is
    state[STATE_POS] + 1 at run time; the caller guarantees table covers it.
    """
    G, D, hq, hkv = cfg.gqa_ratio, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    check_attention_args(cfg, q, state, table, kv_layer, o, part_acc, part_ml)
    ms = part_acc.shape[0]
    pps = pages_per_stage or default_pages_per_stage(D)
    split = _jit("split", G, D, hkv, pps, ms, min_pps)
    combine = _jit("combine", D, ms, min_pps)
    nbytes = smem_bytes(D, pps)
    if nbytes + 64 > SMEM_LIMIT:
        _allow_smem(split, nbytes)

    def launch(stream=0):
        split[(ms, hkv), (G + 1) * 32, stream, nbytes](q, state, table, kv_layer, part_acc, part_ml)
        combine[hq, D * CSG, stream](state, part_acc, part_ml, o)

    return launch
