"""A vectorised stand-in for nq/ptx/mma.py's whole-warp mma model, for long simulator runs.

Under the CUDA simulator every lane of a warp evaluates the whole warp's mma model
(nq/ptx/mma.py) element by element in Python, 1.5 ms a lane: ~50 ms per mma.sync, which makes
a prefill attention tile cost seconds.  This builds the same matrices with numpy index arrays
and computes them the same way (float64 A @ B + C, rounded once to float32), so the results
are bit for bit the model's (tests/kernels/attention/test_prefill_attn_cpu.py checks it on
random operands) in a tenth of the time.  `install()` swaps it in; the mma twin looks the
model up at call time.
"""
from __future__ import annotations

import numpy as np

from nq.ptx import mma as _mma

_LANE = np.arange(32)[:, None, None]
_REG4 = np.arange(4)[None, :, None]
_REG2 = np.arange(2)[None, :, None]
_HALF = np.arange(2)[None, None, :]
_G, _T = _LANE // 4, _LANE % 4
A_ROW, A_COL = _G + 8 * (_REG4 & 1), 2 * _T + _HALF + 8 * (_REG4 >> 1)   # (32, 4, 2)
B_K, B_N = 2 * _T + _HALF + 8 * _REG2, _G + 0 * _HALF                     # (32, 2, 2)
C_ROW, C_COL = (_G + 8 * (_REG4 >> 1))[..., 0], (2 * _T + (_REG4 & 1))[..., 0]   # (32, 4)


def _halves(words, n):
    """32 lanes' n uint32 registers -> (32, n, 2) float64 of their fp16 halves (lo, hi)."""
    w = np.array(words, dtype=np.uint32).reshape(32, n)
    return w.view(np.float16).reshape(32, n, 2).astype(np.float64)


def mma_m16n8k16_f16_f32_warp(a, b, c) -> np.ndarray:
    """nq.ptx.mma.mma_m16n8k16_f16_f32_warp, vectorised."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    C = np.zeros((16, 8))
    A[A_ROW, A_COL] = _halves(a, 4)
    B[B_K, B_N] = _halves(b, 2)
    C[C_ROW, C_COL] = np.asarray(c, dtype=np.float32).reshape(32, 4)
    D = (A @ B + C).astype(np.float32)
    return D[C_ROW, C_COL]


def install() -> None:
    _mma.mma_m16n8k16_f16_f32_warp = mma_m16n8k16_f16_f32_warp


def record_l2_prefetches(module) -> list:
    """Wrap `module`'s cp_async_bulk_prefetch_l2 (the twin a kernel body looks up at call time)
    so that every call is also logged as (source array's size, index, bytes); returns the log,
    which the caller clears between launches."""
    asked = []
    twin = module.cp_async_bulk_prefetch_l2

    def recorded(src, i, nbytes):
        asked.append((src.size, int(i), int(nbytes)))
        return twin(src, i, nbytes)
    module.cp_async_bulk_prefetch_l2 = recorded
    return asked


def patch_simulator(syncwarp: bool = False) -> None:
    """What the CUDA simulator lacks for nq's kernels, for scripts run under it: warp shuffles
    and ballots (and, with syncwarp, __syncwarp) as a rendezvous of the caller's warp, and a throttle on the
    block manager's busy polling of its threads' is_alive(), which holds the GIL against every
    32-thread rendezvous (each mma and ldmatrix): a short sleep every 64 polls makes a run
    ~2.5x faster and changes nothing else."""
    import time

    from numba.cuda.simulator import kernel as simk, kernelapi

    from nq.ptx import _sim

    kernelapi.FakeCUDAModule.shfl_xor_sync = \
        lambda self, mask, value, lanemask: _sim.warp_exchange(value)[_sim.lane_id() ^ lanemask]
    # int32, as numba types the device's ballot (lane 31's bit is the sign)
    kernelapi.FakeCUDAModule.ballot_sync = lambda self, mask, predicate: np.uint32(sum(
        1 << i for i, v in enumerate(_sim.warp_exchange(bool(predicate))) if v)).view(np.int32)
    if syncwarp:
        kernelapi.FakeCUDAModule.syncwarp = lambda self, mask=0xFFFFFFFF: _sim.warp_exchange(None)
    polls = [0]
    is_alive = simk.BlockThread.is_alive

    def throttled_is_alive(self):
        polls[0] += 1
        if polls[0] % 64 == 0:
            time.sleep(2e-4)
        return is_alive(self)
    simk.BlockThread.is_alive = throttled_is_alive


# ---- what the int4 GEMV simulator scripts share --------------------------------------------------

def rel(a, b) -> float:
    """||a - b|| / ||b||, after asserting a is finite (a NaN would compare as a small error)."""
    assert np.isfinite(a).all()
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def packed(rng, n: int, k: int, dtype=np.float32):
    """A random (n, k) int4 matrix as the packer stores it and its dequant in `dtype`:
    (qweight, scales, dense)."""
    from nq.loader.quant import dequantize_packed, quantize_pack
    qw, sc = quantize_pack(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
    return qw, sc, dequantize_packed(qw, sc).astype(dtype)
