"""Weight re-tiling on the GPU at load time: each row's 16-byte chunks into the GEMV's order.

Why: the GEMV kernels read a row's chunks in the order `gemv_int4.chunk_permutation` gives
(so that the four loads a lane issues per step are coalesced across lanes).  Permuting 3.4 GB
of 7B weights with NumPy on the host costs ~17 s on a 2-core machine; on the GPU it is a copy
at memory speed.  The file's layout is uploaded as it is into a staging buffer, then

    dst[row, p] = src[row, perm[p]]        (chunks of 4 uint32 = 32 INT4 weights)

with one thread per destination chunk.  `gemv_int4.tile_rows` is the NumPy reference.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from nq.ptx import ld_global_nc_v4_u32, st_global_v4_u32

THREADS = 256


def retile_reference(src: np.ndarray, perm: np.ndarray) -> np.ndarray:
    """src (N, K/8) uint32, perm (K/32,) -> (N, K/8) uint32 with row chunk p = src chunk perm[p]."""
    n, k8 = src.shape
    return np.ascontiguousarray(src.reshape(n, k8 // 4, 4)[:, perm].reshape(n, k8))


def _retile(src, dst, perm):
    # src, dst (N, K/8) uint32, 16-byte aligned rows (K/8 is a multiple of 16); perm (K/32,) int32
    n_chunks = perm.shape[0]
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    total = src.shape[0] * n_chunks
    while i < total:
        row = i // n_chunks
        p = i - row * n_chunks
        a, b, c, d = ld_global_nc_v4_u32(src, (row, 4 * perm[p]))
        st_global_v4_u32(dst, (row, 4 * p), a, b, c, d)
        i += stride


RETILE_SIG = "void(uint32[:, ::1], uint32[:, ::1], int32[::1])"


@functools.cache
def _jit():
    return cuda.jit(RETILE_SIG)(_retile)


def retile(src, dst, perm, stream=0) -> None:
    """Launch the permutation (src and dst device arrays of equal shape, perm a device int32)."""
    if src.shape != dst.shape or src.dtype != np.uint32 or dst.dtype != np.uint32:
        raise ValueError(f"retile: src {src.dtype}{src.shape} and dst {dst.dtype}{dst.shape} "
                         "must be equal-shape uint32")
    if perm.shape[0] * 4 != src.shape[1]:
        raise ValueError(f"retile: {perm.shape[0]} chunks for rows of {src.shape[1]} words")
    blocks = min(4096, -(-src.shape[0] * perm.shape[0] // THREADS))
    _jit()[blocks, THREADS, stream](src, dst, perm)
