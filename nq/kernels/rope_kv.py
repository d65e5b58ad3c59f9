"""RoPE on q and k of one decode token, and the K/V store into the paged cache.

Input is the qkv GEMV's fp32 output (q_size + 2*kv_size,), bias already added, laid out
[q heads | k heads | v heads].  The position comes from state[STATE_POS] (nq/runtime/kv_cache.py), so
the captured graph replays unchanged.  Outputs:
    q_out  (num_heads*head_dim,) fp32   rotated q; attention keeps scores in fp32, and fp32 q
                                        costs 14 KiB of reads per layer, nothing next to KV
    kv_layer[table[pos//16], h, 0, pos%16, :]  rotated k, fp16
    kv_layer[table[pos//16], h, 1, pos%16, :]  v, fp16

cos/sin are computed in-kernel from pos and an fp32 inv_freq table (head_dim/2,) made once
(`rope_inv_freq`, the same float64-then-fp32 constants as nq.ref.rope_cos_sin): the angle
pos*inv_freq is formed in fp32 as HF and the reference do, then precise cosf/sinf (libdevice,
with full range reduction; this kernel is not built with fastmath because sin.approx is wrong
by ~1e-3 at angles of 10^4 rad).  A (max_pos, head_dim/2) table would read 2 x 256 B per
token instead of computing 64 sincos, and would cap the position; the computation is free at
this size (one block per head, 64 threads).

Grid (num_heads + 2*num_kv_heads,), block head_dim/2: block b < num_heads rotates q head b,
the next num_kv_heads blocks rotate and store k, the last num_kv_heads store v.
"""
from __future__ import annotations

import functools

import numpy as np

from nq.kernels.build import compile_kernel, kernel_name
from nq.paged import PAGE, STATE_POS, check_paged_args


# ---- NumPy reference ---------------------------------------------------------------------------

def rope_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """(head_dim/2,) fp32 inverse frequencies, rounded once from float64 (as nq.ref)."""
    return (1.0 / (float(theta) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
            ).astype(np.float32)


def rope_kv_reference(cfg, qkv: np.ndarray, pos: int):
    """qkv (qkv_size,) fp32 -> (q (num_heads, D) fp32, k (num_kv, D) fp16, v (num_kv, D) fp16)."""
    from nq.ref import apply_rope
    d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    qkv = np.asarray(qkv, np.float32)
    q = qkv[: hq * d].reshape(1, hq, d)
    k = qkv[hq * d: (hq + hkv) * d].reshape(1, hkv, d)
    v = qkv[(hq + hkv) * d:].reshape(hkv, d)
    q = apply_rope(q, [pos], cfg.rope_theta)[0]
    k = apply_rope(k, [pos], cfg.rope_theta)[0]
    return q, k.astype(np.float16), v.astype(np.float16)


# ---- kernel ------------------------------------------------------------------------------------

@functools.cache
def rope_kv_body(num_heads: int, num_kv: int, head_dim: int):
    """The kernel body for num_heads query heads, num_kv kv heads of head_dim."""
    import math

    from numba import cuda
    from numba.cuda.types import float16, float32

    from nq.ptx import griddepcontrol_launch_dependents, griddepcontrol_wait

    HQ, HKV, D, HALF = num_heads, num_kv, head_dim, head_dim // 2

    def rope_kv(qkv, state, inv_freq, table, kv, q_out):
        # qkv (qkv_size,) f32; state int32; inv_freq (D/2,) f32; table (max_pages,) int32
        # kv (n_pages, HKV, 2, 16, D) f16; q_out (HQ*D,) f32
        griddepcontrol_wait()  # PDL: qkv comes from the GEMV before
        griddepcontrol_launch_dependents()
        b = cuda.blockIdx.x
        i = cuda.threadIdx.x  # pair (i, i + D/2)
        pos = state[STATE_POS]
        page = table[pos // PAGE]
        slot = pos % PAGE
        if b < HQ + HKV:
            ang = float32(pos) * inv_freq[i]
            c = math.cos(ang)
            s = math.sin(ang)
            x1 = qkv[b * D + i]
            x2 = qkv[b * D + i + HALF]
            y1 = x1 * c - x2 * s
            y2 = x2 * c + x1 * s
            if b < HQ:
                q_out[b * D + i] = y1
                q_out[b * D + i + HALF] = y2
            else:
                h = b - HQ
                kv[page, h, 0, slot, i] = float16(y1)
                kv[page, h, 0, slot, i + HALF] = float16(y2)
        else:
            h = b - HQ - HKV
            base = (HQ + HKV + h) * D
            kv[page, h, 1, slot, i] = float16(qkv[base + i])
            kv[page, h, 1, slot, i + HALF] = float16(qkv[base + i + HALF])

    return rope_kv



ROPE_KV_SIG = ("void(float32[::1], int32[::1], float32[::1], int32[::1], "
               "float16[:, :, :, :, ::1], float32[::1])")


@functools.cache
def rope_kv_kernel(num_heads: int, num_kv: int, head_dim: int):
    """rope_kv compiled for sm_90, named e.g. rope_kv_hq28_hkv4_d128; no fastmath (module doc)."""
    name = kernel_name("rope_kv", hq=num_heads, hkv=num_kv, d=head_dim)
    return compile_kernel(rope_kv_body(num_heads, num_kv, head_dim), ROPE_KV_SIG, name)


# ---- launcher ------------------------------------------------------------------------------------

def rope_kv_launcher(cfg, qkv, state, inv_freq, table, kv_layer, q_out):
    """Check shapes once; return `launch(stream=0)`.  Arrays as in the module doc; inv_freq
    from rope_inv_freq(cfg.head_dim, cfg.rope_theta), uploaded once."""
    d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    checks = [("qkv", qkv, (cfg.qkv_size,), np.float32), ("q_out", q_out, (hq * d,), np.float32),
              ("inv_freq", inv_freq, (d // 2,), np.float32)]
    for name, a, shape, dt in checks:
        if tuple(a.shape) != shape or a.dtype != dt:
            raise ValueError(f"rope_kv: {name} is {a.dtype}{tuple(a.shape)}, want {np.dtype(dt)}{shape}")
    check_paged_args("rope_kv", cfg, kv_layer, table, state)
    kern = rope_kv_kernel(hq, hkv, d)
    grid = hq + 2 * hkv

    def launch(stream=0):
        kern[grid, d // 2, stream](qkv, state, inv_freq, table, kv_layer, q_out)

    return launch
