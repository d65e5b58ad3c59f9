"""NumPy references of the INT4 GEMVs (fp32 on dequantised weights), one per kernel kind.

The GPU and simulator tests, `nq verify` and the notebooks compare the kernels with these; the
kernels' own numerics (fp16 activations, fp16 or fp32 partial sums) are described in gemv.py
and gemv_mma.py, with the tolerances that follow from them.
"""
from __future__ import annotations

import numpy as np

from nq.ref import linear, rms_norm, swiglu


def ref_qkv(x, norm_w, eps, w_deq, bias):
    """x fp32 (H,), norm_w (H,), w_deq (N, H) fp32 (q,k,v stacked), bias (N,) -> fp32 (N,)."""
    return linear(rms_norm(x, norm_w, eps), w_deq, bias)


def ref_qkv_rope(cfg, x, norm_w, w_deq, bias, pos):
    """ref_qkv, then rope_kv at position pos -> (q (Hq, D) fp32, k (Hkv, D) fp16, v (Hkv, D) fp16)."""
    from nq.kernels.rope_kv import rope_kv_reference
    return rope_kv_reference(cfg, ref_qkv(x, norm_w, cfg.rms_norm_eps, w_deq, bias), pos)


def ref_qkv_rope_mma(cfg, x, norm_w, w_deq, bias, inv_freq, pos):
    """qkv_rope in fp64, the tensor-core kernel's reference (nq/kernels/int4/gemv_mma.py):
    x fp32 (H,), w_deq (N, H) in natural row order (the kernel's rope-ordered layout is undone
    by construction: layout.rope_row), inv_freq the kernel's fp32 (D/2,), the angle formed in
    fp32 as the kernel forms it -> (qkv (N,), q (Hq, D), k (Hkv, D), v (Hkv, D)), all fp64."""
    x = np.asarray(x, np.float64)
    h = x / np.sqrt(np.mean(x * x) + cfg.rms_norm_eps) * np.asarray(norm_w, np.float64)
    y = np.asarray(w_deq, np.float64) @ h + np.asarray(bias, np.float64)
    d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    ang = (np.float32(pos) * np.asarray(inv_freq, np.float32)).astype(np.float64)
    c, s = np.cos(ang), np.sin(ang)
    heads = y.reshape(hq + 2 * hkv, d)
    a, b = heads[:, : d // 2], heads[:, d // 2:]
    rot = np.concatenate([a * c - b * s, b * c + a * s], axis=1)
    return y, rot[:hq], rot[hq:hq + hkv], heads[hq + hkv:]


def ref_o_proj(a, w_deq, x):
    """a (K,) (fp16 attention output), w_deq (H, K), x fp32 (H,) -> the new residual x + W.a."""
    return np.asarray(x, np.float32) + linear(np.asarray(a, np.float32), w_deq)


ref_down = ref_o_proj  # same contract: residual += W . a


def ref_gate_up(x, norm_w, eps, w_gate, w_up):
    """x fp32 (H,), w_gate / w_up (I, H) -> silu(gate) * up, fp32 (I,) (the kernel stores fp16)."""
    h = rms_norm(x, norm_w, eps)
    return swiglu(linear(h, w_gate), linear(h, w_up))
