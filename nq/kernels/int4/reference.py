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


def ref_o_proj(a, w_deq, x):
    """a (K,) (fp16 attention output), w_deq (H, K), x fp32 (H,) -> the new residual x + W.a."""
    return np.asarray(x, np.float32) + linear(np.asarray(a, np.float32), w_deq)


ref_down = ref_o_proj  # same contract: residual += W . a


def ref_gate_up(x, norm_w, eps, w_gate, w_up):
    """x fp32 (H,), w_gate / w_up (I, H) -> silu(gate) * up, fp32 (I,) (the kernel stores fp16)."""
    h = rms_norm(x, norm_w, eps)
    return swiglu(linear(h, w_gate), linear(h, w_up))
