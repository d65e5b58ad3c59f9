"""NumPy models of decode attention: the float64 reference the kernels are tested against, the
split + combine arithmetic, and attn_split's tensor-core fragment mapping.

The tests check each model against the one above it on the CPU (split + combine equals the
reference; the fragment mapping gives q K^T), so the GPU tests only have to compare the
kernels with `attention_reference`.
"""
from __future__ import annotations

import math

import numpy as np

from nq.kernels.attention.plan import LOG2E, MIN_PPS, split_plan
from nq.paged import PAGE


def attention_reference(q, k, v):
    """q (Hq, D), k and v (length, Hkv, D) -> o (Hq, D) float64: softmax(q k^T / sqrt(D)) v, GQA.

    Computed in float64 from the values given (the tests pass the same fp16 K/V the kernel
    reads), so the only differences left are the kernel's fp32 rounding and exp2 approximation.
    """
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    hq, d = q.shape
    gqa = hq // k.shape[1]
    kk = np.repeat(k, gqa, axis=1)  # (length, Hq, D)
    vv = np.repeat(v, gqa, axis=1)
    s = np.einsum("hd,thd->ht", q, kk) / math.sqrt(d)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return np.einsum("ht,thd->hd", p, vv)


def split_combine_model(q, k, v, max_splits: int, min_pps: int = MIN_PPS):
    """attn_split + attn_combine in float64: per split the log2-domain partial (m, l, acc),
    then the merge weighted by exp2(m_split - max m).  Equals attention_reference up to
    rounding."""
    q = np.asarray(q, np.float64)
    hq, d = q.shape
    gqa = hq // k.shape[1]
    length = k.shape[0]
    pps, n_splits = split_plan(length, max_splits, min_pps)
    qs = q * (LOG2E / math.sqrt(d))
    kk = np.repeat(np.asarray(k, np.float64), gqa, axis=1)
    vv = np.repeat(np.asarray(v, np.float64), gqa, axis=1)
    ms, ls, accs = [], [], []
    for split in range(n_splits):
        lo, hi = split * pps * PAGE, min((split + 1) * pps * PAGE, length)
        sc = np.einsum("hd,thd->ht", qs, kk[lo:hi])  # (Hq, tokens) log2-domain scores
        m = sc.max(axis=1)
        p = np.exp2(sc - m[:, None])
        ms.append(m)
        ls.append(p.sum(axis=1))
        accs.append(np.einsum("ht,thd->hd", p, vv[lo:hi]))
    m = np.stack(ms)  # (n_splits, Hq)
    w = np.exp2(m - m.max(axis=0))
    num = np.einsum("sh,shd->hd", w, np.stack(accs))
    den = np.einsum("sh,sh->h", w, np.stack(ls))
    return num / den[:, None]


def split_q_hi_lo(x):
    """x float32 -> (hi, lo) fp16 with hi + lo = x to ~2^-22 relative (the kernel's q split)."""
    x = np.asarray(x, np.float32)
    hi = x.astype(np.float16)
    lo = (x - hi.astype(np.float32)).astype(np.float16)
    return hi, lo


def page_scores_model(q_scaled, k_page):
    """One consumer warp's scores Q K^T for a page through the warp models of nq/ptx/mma.py,
    with the kernel's fragment mapping: q_scaled (GQA, D) float32, k_page (16, D) fp16 ->
    (GQA, 16).

    Checks the mapping (q_hi rows 0-7, q_lo rows 8-15, ldmatrix lane addressing, c0 + c2), not
    the hardware; tests/kernels/attention/test_decode_cpu.py compares it with q K^T in float64.
    """
    from nq.ptx.mma import ldmatrix_x4_warp, mma_m16n8k16_f16_f32_warp
    gqa, d = q_scaled.shape
    hi, lo = split_q_hi_lo(q_scaled)
    hi_bits, lo_bits = hi.view(np.uint16), lo.view(np.uint16)
    kb = np.asarray(k_page, np.float16).view(np.uint16)
    scores = np.zeros((gqa, PAGE))
    for kstep in range(d // 16):
        a = np.zeros((32, 4), np.uint32)
        for lane in range(32):
            g, t = divmod(lane, 4)
            if g < gqa:
                for reg, (src, col) in enumerate(((hi_bits, 2 * t), (lo_bits, 2 * t),
                                                  (hi_bits, 2 * t + 8), (lo_bits, 2 * t + 8))):
                    dim = kstep * 16 + col
                    a[lane, reg] = int(src[g, dim]) | (int(src[g, dim + 1]) << 16)
        rows = [kb[(i % 8) + 8 * (i // 16), kstep * 16 + 8 * ((i // 8) % 2):][:8]
                for i in range(32)]
        b = ldmatrix_x4_warp(rows)
        for nt in range(2):
            c = mma_m16n8k16_f16_f32_warp(a, b[:, 2 * nt:2 * nt + 2], np.zeros((32, 4), np.float32))
            for lane in range(32):
                g, t = divmod(lane, 4)
                if g < gqa:
                    for e in range(2):
                        scores[g, nt * 8 + 2 * t + e] += float(c[lane, e]) + float(c[lane, 2 + e])
    return scores
