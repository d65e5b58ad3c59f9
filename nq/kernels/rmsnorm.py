"""Standalone RMSNorm: fp32 rows x (T, hidden) -> fp16 h (T, hidden), optionally adding a
residual first (x += r, written back, then h = norm(x) * w).

Decode fuses the norm into the qkv and gate_up GEMV prologues (int4/gemv.py); this kernel is
for prefill, the final norm before lm_head if the engine wants it separate, and tests.
One block of 256 threads per row: the sum of squares is reduced in fp32 (per-thread partials,
warp xor-shuffles, then 8 warp sums in shared memory; nq/kernels/common.py), as HF's fp32
variance.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda  # a module global: the simulator swaps it for its fake module

from nq.kernels.build import compile_kernel, kernel_name

THREADS = 256


def rmsnorm_reference(x, w, eps, residual=None):
    """-> (x after the residual add fp32, h fp16)."""
    from nq.ref import rms_norm
    x = np.asarray(x, np.float32)
    if residual is not None:
        x = x + np.asarray(residual, np.float32)
    return x, rms_norm(x, w, eps).astype(np.float16)


@functools.cache
def rmsnorm_body(hidden: int, eps: float, with_residual: bool):
    """The kernel body for rows of `hidden`, eps, with or without the residual add."""
    from numba.cuda.types import float16, float32

    from nq.kernels.common import block_rstd, dev, warp_sum
    from nq.ptx import griddepcontrol_launch_dependents, griddepcontrol_wait

    H, EPS, RES = hidden, float32(eps), with_residual
    INV_H = np.float32(1.0 / hidden)     # times 1/H, as the fused norms in the decode GEMVs
    NW = THREADS // 32
    wsum, rstd_of = dev(warp_sum), dev(block_rstd)

    def rmsnorm(x, r, w, h):
        # x (T, H) f32 (updated in place when RES); r (T, H) f32 (ignored unless RES)
        # w (H,) f16; h (T, H) f16
        red = cuda.shared.array(NW, float32)
        griddepcontrol_wait()  # PDL (nq/ptx/griddep.py)
        griddepcontrol_launch_dependents()
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        ss = float32(0.0)
        for i in range(tid, H, THREADS):
            v = x[row, i]
            if RES:
                v += r[row, i]
                x[row, i] = v
            ss += v * v
        ss = wsum(ss)
        if tid % 32 == 0:
            red[tid // 32] = ss
        cuda.syncthreads()
        inv = rstd_of(red, NW, INV_H, EPS)
        for i in range(tid, H, THREADS):
            # Each thread re-reads the x it wrote itself: no cross-thread hazard.
            h[row, i] = float16((x[row, i] * inv) * float32(w[i]))

    return rmsnorm


RMSNORM_SIG = "void(float32[:, ::1], float32[:, ::1], float16[::1], float16[:, ::1])"


@functools.cache
def rmsnorm_kernel(hidden: int, eps: float, with_residual: bool):
    """rmsnorm compiled for sm_90, named e.g. rmsnorm_h3584_eps1em06_res1."""
    name = kernel_name("rmsnorm", h=hidden, eps=float(eps), res=bool(with_residual))
    return compile_kernel(rmsnorm_body(hidden, eps, with_residual), RMSNORM_SIG, name)


def rmsnorm_launcher(x, w, h, eps: float, residual=None):
    """Check shapes once; return `launch(stream=0)`.  x (T, H) or (H,) fp32; residual the
    same shape fp32 or None; w (H,) fp16; h like x, fp16."""
    x2 = x.reshape(1, -1) if len(x.shape) == 1 else x
    h2 = h.reshape(1, -1) if len(h.shape) == 1 else h
    t, hid = x2.shape
    if x2.dtype != np.float32 or tuple(h2.shape) != (t, hid) or h2.dtype != np.float16:
        raise ValueError(f"rmsnorm: x {x.dtype}{tuple(x.shape)}, h {h.dtype}{tuple(h.shape)}")
    if tuple(w.shape) != (hid,) or w.dtype != np.float16:
        raise ValueError(f"rmsnorm: w is {w.dtype}{tuple(w.shape)}, want float16({hid},)")
    r2 = x2
    if residual is not None:
        r2 = residual.reshape(1, -1) if len(residual.shape) == 1 else residual
        if tuple(r2.shape) != (t, hid) or r2.dtype != np.float32:
            raise ValueError(f"rmsnorm: residual is {residual.dtype}{tuple(residual.shape)}")
    kern = rmsnorm_kernel(hid, float(eps), residual is not None)

    def launch(stream=0):
        kern[t, THREADS, stream](x2, r2, w, h2)

    return launch
