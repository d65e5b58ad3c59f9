"""Weight re-tiling on the GPU at load time: each row's 16-byte chunks into the GEMV's order.

Why: the CUDA-core GEMV reads a row's chunks in the order `layout.chunk_permutation` gives
(so that the four loads a lane issues per step are coalesced across lanes).  Permuting 3.4 GB
of 7B weights with NumPy on the host costs ~17 s on a 2-core machine; on the GPU it is a copy
at memory speed.  The file's layout is uploaded as it is into a staging buffer, then

    dst[row, p] = src[row, perm[p]]        (chunks of 4 uint32 = 32 INT4 weights)

with one thread per destination chunk.  `layout.tile_rows` is the NumPy reference.  For the
tensor-core GEMV (an MmaTiling) `retile_mma` gathers each fragment word's 8 nibbles from two
rows (`layout.mma_layout`).  Retired: the block-major re-tile (Tiling.block_major's upload),
with that layout, which lost (gemv.py's epitaph); code at 13c221c.  qkv's rope-ordered mma
re-tile, with NQ_MMA_QKV=1 (tiling.py's epitaph); code at 29184bc.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from nq.kernels.build import compile_kernel, kernel_name
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


def _retile_mma(src, dst):
    # dst (N*K/8,) uint32 in the mma fragment order [tile][group][lane][8 words], one thread
    # a word: lane (g, t)'s word of k16 chunk i gathers W[g|g+8, 2t, 2t+1, 2t+8, 2t+9] of the
    # chunk from the file's ValueShuffle words (value v of a word sits in slot v/2 if v is
    # even, 4 + v//2 if odd: columns 2t, 2t+1 are slots t and 4+t of the chunk's first word,
    # 2t+8, 2t+9 the same slots of its second)
    n = src.shape[0]
    k8 = src.shape[1]
    groups = k8 // 16
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    total = n * k8
    while i < total:
        c = i % 8                       # chunk in the group
        lane = (i // 8) % 32
        grp = (i // 256) % groups
        tile = i // (256 * groups)
        g = lane >> 2
        t = lane & 3
        r0 = tile * 16 + g
        w = grp * 16 + c * 2           # the chunk's first file word in the row
        a0 = src[r0, w]
        a1 = src[r0, w + 1]
        b0 = src[r0 + 8, w]
        b1 = src[r0 + 8, w + 1]
        lo = 4 * t
        hi = 4 * (t + 4)
        word = (((a0 >> lo) & 0xF) | ((b0 >> lo) & 0xF) << 4 | ((a1 >> lo) & 0xF) << 8
                | ((b1 >> lo) & 0xF) << 12 | ((a0 >> hi) & 0xF) << 16 | ((b0 >> hi) & 0xF) << 20
                | ((a1 >> hi) & 0xF) << 24 | ((b1 >> hi) & 0xF) << 28)
        dst[i] = word
        i += stride


RETILE_MMA_SIG = "void(uint32[:, ::1], uint32[::1])"


@functools.cache
def compile_retile_rows():
    return compile_kernel(_retile, RETILE_SIG, kernel_name("int4_retile_rows"))


@functools.cache
def compile_retile_mma():
    return compile_kernel(_retile_mma, RETILE_MMA_SIG, kernel_name("int4_retile_mma"))


def retile_mma(src, dst, stream=0) -> None:
    """File-layout (N, K/8) words -> the mma fragment layout in dst (same shape; the NumPy
    reference is layout.mma_layout).  N must be a multiple of 16."""
    if src.shape != dst.shape or src.dtype != np.uint32 or dst.dtype != np.uint32:
        raise ValueError(f"retile_mma: src {src.dtype}{src.shape} and dst {dst.dtype}{dst.shape} "
                         "must be equal-shape uint32")
    if src.shape[0] % 16 or src.shape[1] % 16:
        raise ValueError(f"retile_mma: {src.shape} is not whole 16-row tiles of 128-weight groups")
    blocks = min(4096, -(-src.shape[0] * src.shape[1] // THREADS))
    compile_retile_mma()[blocks, THREADS, stream](src, dst.reshape(dst.size))


def retile(src, dst, perm, stream=0) -> None:
    """Launch the permutation (src and dst device arrays of equal shape, perm a device int32)."""
    if src.shape != dst.shape or src.dtype != np.uint32 or dst.dtype != np.uint32:
        raise ValueError(f"retile: src {src.dtype}{src.shape} and dst {dst.dtype}{dst.shape} "
                         "must be equal-shape uint32")
    if perm.shape[0] * 4 != src.shape[1]:
        raise ValueError(f"retile: {perm.shape[0]} chunks for rows of {src.shape[1]} words")
    blocks = min(4096, -(-src.shape[0] * perm.shape[0] // THREADS))
    compile_retile_rows()[blocks, THREADS, stream](src, dst, perm)
