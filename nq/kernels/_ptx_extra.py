"""PTX wrappers the GEMV kernels need beyond nq.ptx's first delivery (to be absorbed by nq/ptx).

Built exactly like nq/ptx (the same `ptx` decorator, a Python twin each), kept here so the
GEMVs were not blocked; nothing in this file is GEMV-specific.  Candidates for nq/ptx/memory.py:

- ld_shared_v4_u32: one 16-byte shared load (LDS.128).  numba's indexing emits four 4-byte
  loads and NVVM's load/store vectoriser cannot always prove the 16-byte alignment; the
  activations of a GEMV are read from shared memory once per 8 weights, so the width matters.
- ld_global_nc_u16 / ld_global_nc_v2_u32 / ld_global_nc_v4_f32: read-only loads of scales,
  fp16 vectors and fp32 vectors without numba's negative-index wraparound code.
- st_global_u16: store fp16 bits into an fp16 array (numba has no f32->f16 store we control).
"""
from __future__ import annotations

import numpy as np

from nq.ptx._asm import ptx


def _bytes_at(arr, idx, n=16):
    """Writable uint8 view of the n bytes at arr[idx] (twins only), checking n-byte alignment."""
    a = np.asarray(getattr(arr, "_ary", arr))  # the simulator wraps arrays in FakeCUDAArray
    assert a.flags.c_contiguous, "the twins model C-contiguous arrays only"
    off = int(np.ravel_multi_index(idx if isinstance(idx, tuple) else (idx,), a.shape))
    off *= a.itemsize
    assert (a.ctypes.data + off) % n == 0, f"{n}-byte access at a misaligned address"
    return a.reshape(-1).view(np.uint8)[off:off + n]


@ptx("{ .reg .u64 nq_sa; cvta.to.shared.u64 nq_sa, %4; "
     "ld.shared.v4.u32 {%0, %1, %2, %3}, [nq_sa]; }",
     out=("u32",) * 4, args=("arr", "idx"), effect="load")
def ld_shared_v4_u32(arr, idx):
    """`cvta.to.shared.u64 a, &arr[idx]; ld.shared.v4.u32 {d0..d3}, [a];` -- 16 bytes of shared.

    arr must be a shared array and &arr[idx] 16-byte aligned.  Pure (no memory clobber): the
    caller orders it after the stores with a barrier (syncthreads), which LLVM never crosses.
    """
    w = _bytes_at(arr, idx).view(np.uint32)
    return (w[0], w[1], w[2], w[3])


@ptx("ld.global.nc.u16 %0, [%1];", out="u16", args=("arr", "idx"), effect="load")
def ld_global_nc_u16(arr, idx):
    """`ld.global.nc.u16 h, [&arr[idx]];` -- 2 bytes (an fp16's bits) via the read-only path."""
    return _bytes_at(arr, idx, 2).view(np.uint16)[0]


@ptx("ld.global.nc.v2.u32 {%0, %1}, [%2];", out=("u32",) * 2, args=("arr", "idx"), effect="load")
def ld_global_nc_v2_u32(arr, idx):
    """`ld.global.nc.v2.u32 {d0, d1}, [&arr[idx]];` -- 8 bytes (four fp16), 8-byte aligned."""
    w = _bytes_at(arr, idx, 8).view(np.uint32)
    return (w[0], w[1])


@ptx("ld.global.nc.v4.f32 {%0, %1, %2, %3}, [%4];", out=("f32",) * 4, args=("arr", "idx"), effect="load")
def ld_global_nc_v4_f32(arr, idx):
    """`ld.global.nc.v4.f32 {f0..f3}, [&arr[idx]];` -- four float32, 16-byte aligned, read-only."""
    w = _bytes_at(arr, idx).view(np.float32)
    return (w[0], w[1], w[2], w[3])


@ptx("st.global.u16 [%0], %2;", args=("arr", "idx", "u16"), effect="memory")
def st_global_u16(arr, idx, h):
    """`st.global.u16 [&arr[idx]], h;` -- store fp16 bits (from cvt_rn_f16_f32) into any array."""
    _bytes_at(arr, idx, 2).view(np.uint16)[0] = np.uint16(int(h) & 0xFFFF)


@ptx("mov.b32 %0, %1;", out="u32", args=("f32",))
def mov_b32_u32_from_f32(f):
    """`mov.b32 r, f;` -- the bits of a float32 (to read its exponent without frexp's calls)."""
    return np.array([f], np.float32).view(np.uint32)[0]


@ptx("mov.b32 %0, %1;", out="f32", args=("u32",))
def mov_b32_f32_from_u32(r):
    """`mov.b32 f, r;` -- a float32 from its bits (to build an exact power of two)."""
    return np.array([int(r) & 0xFFFFFFFF], np.uint32).view(np.float32)[0]


@ptx("{ .reg .u64 nq_sa; cvta.to.shared.u64 nq_sa, %4; "
     "ld.shared.v4.f32 {%0, %1, %2, %3}, [nq_sa]; }",
     out=("f32",) * 4, args=("arr", "idx"), effect="load")
def ld_shared_v4_f32(arr, idx):
    """`ld.shared.v4.f32 {f0..f3}, [a];` -- four float32 of a shared array, 16-byte aligned."""
    w = _bytes_at(arr, idx).view(np.float32)
    return (w[0], w[1], w[2], w[3])
