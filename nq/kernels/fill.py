"""Deterministic pseudo-random fill of device buffers, for random-weight models made on the GPU.

Why: `nq bench --random 7b` and the GPU tests of large shapes need ~4.5 GB of weights of the
right shapes without a download or a host copy.  Each element is a hash of (seed, index)
(splitmix32-style), so a buffer is the same on every run and independent of the launch shape.

    fill_u32(arr, seed)                  every bit random (INT4 nibbles: uniform in [-8, 7])
    fill_f16(arr, seed, center, radius)  uniform in [center - radius, center + radius]
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda
from numba.cuda.types import float16, float32, uint32

from nq.kernels.build import compile_kernel

THREADS = 256
BLOCKS = 4096  # grid-stride: any size, one launch


def hash_u32_reference(seed: int, idx: np.ndarray) -> np.ndarray:
    """The kernel's hash, in NumPy (uint32 wrap-around arithmetic)."""
    with np.errstate(over="ignore"):
        h = (np.asarray(idx, np.uint64) * np.uint64(0x9E3779B9) + np.uint64(seed)) & np.uint64(0xFFFFFFFF)
        h = h.astype(np.uint32)
        h ^= h >> np.uint32(16)
        h = (h.astype(np.uint64) * np.uint64(0x7FEB352D) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        h ^= h >> np.uint32(15)
        h = (h.astype(np.uint64) * np.uint64(0x846CA68B) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        h ^= h >> np.uint32(16)
    return h


@cuda.jit(device=True, inline=True)
def _mix(seed, i):
    """hash_u32_reference for one index."""
    h = uint32(uint32(i) * uint32(0x9E3779B9) + seed)
    h ^= h >> uint32(16)
    h = uint32(h * uint32(0x7FEB352D))
    h ^= h >> uint32(15)
    h = uint32(h * uint32(0x846CA68B))
    h ^= h >> uint32(16)
    return h


def fill_u32_body(a, seed):
    # a (n,) uint32; grid-stride.
    i = cuda.grid(1)
    while i < a.shape[0]:
        a[i] = _mix(seed, i)
        i += cuda.gridsize(1)


def fill_f16_body(a, seed, center, radius):
    # a (n,) fp16; uniform in [center - radius, center + radius] from the top 24 hash bits.
    i = cuda.grid(1)
    while i < a.shape[0]:
        u = float32(_mix(seed, i) >> uint32(8)) * float32(1.0 / 16777216.0)  # [0, 1)
        a[i] = float16(center + radius * (float32(2.0) * u - float32(1.0)))
        i += cuda.gridsize(1)


FILL_U32_SIG = "void(uint32[::1], uint32)"
FILL_F16_SIG = "void(float16[::1], uint32, float32, float32)"


@functools.cache
def fill_kernels():
    """(fill_u32, fill_f16) compiled for sm_90 (no baked-in constants)."""
    return (compile_kernel(fill_u32_body, FILL_U32_SIG, "fill_u32"),
            compile_kernel(fill_f16_body, FILL_F16_SIG, "fill_f16"))


def _flat(arr):
    return arr.reshape(arr.size) if len(arr.shape) != 1 else arr


def fill_u32(arr, seed: int, stream=0) -> None:
    if arr.dtype != np.uint32:
        raise ValueError(f"fill_u32: {arr.dtype} array, want uint32")
    fill_kernels()[0][BLOCKS, THREADS, stream](_flat(arr), np.uint32(seed & 0xFFFFFFFF))


def fill_f16(arr, seed: int, center: float, radius: float, stream=0) -> None:
    if arr.dtype != np.float16:
        raise ValueError(f"fill_f16: {arr.dtype} array, want float16")
    fill_kernels()[1][BLOCKS, THREADS, stream](_flat(arr), np.uint32(seed & 0xFFFFFFFF),
                                           np.float32(center), np.float32(radius))
