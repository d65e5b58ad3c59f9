"""Weight re-tiling on the GPU at load time: each row's 16-byte chunks into the GEMV's order.

Why: the GEMV kernels read a row's chunks in the order `gemv_int4.chunk_permutation` gives
(so that the four loads a lane issues per step are coalesced across lanes).  Permuting 3.4 GB
of 7B weights with NumPy on the host costs ~17 s on a 2-core machine; on the GPU it is a copy
at memory speed.  The file's layout is uploaded as it is into a staging buffer, then

    dst[row, p] = src[row, perm[p]]        (chunks of 4 uint32 = 32 INT4 weights)

with one thread per destination chunk.  `gemv_int4.tile_rows` is the NumPy reference.  For a
block-major tiling (`Tiling.block_major`) the destination is the flat array of
`gemv_int4.block_major_rows`: each chunk's place is computed from its row and word (block,
step, row in the block), in the same kernel pass.  For the tensor-core GEMV (`Tiling.mma`)
`retile_mma` gathers each fragment word's 8 nibbles from two rows (`gemv_mma.mma_layout`).
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


def retile_block_major_reference(src: np.ndarray, perm: np.ndarray, ks: int,
                                 rows_per_block: int) -> np.ndarray:
    """retile_reference, then gemv_int4.block_major_rows: (N, K/8) whose memory is block-major."""
    from nq.kernels.int4.gemv import block_major_rows
    return block_major_rows(retile_reference(src, perm), ks, rows_per_block)


def _retile_bm(src, dst, perm, ks, rpb):
    # dst (N*K/8,) uint32: the block-major flat layout (gemv_int4.block_major_rows; its kernel
    # address is load_row's block_major branch): block b of rpb rows, step s, row after row
    n_chunks = perm.shape[0]
    n = src.shape[0]
    k8 = src.shape[1]
    sw = ks * 16                          # words of a full step of one row
    steps = (k8 + sw - 1) // sw
    last = k8 - (steps - 1) * sw          # words of the last step of one row
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    total = n * n_chunks
    while i < total:
        row = i // n_chunks
        p = i - row * n_chunks
        a, b, c, d = ld_global_nc_v4_u32(src, (row, 4 * perm[p]))
        s = (4 * p) // sw
        blk = row // rpb
        rbe = min(rpb, n - blk * rpb)
        step_words = sw if s < steps - 1 else last
        f = blk * rpb * k8 + s * rbe * sw + (row - blk * rpb) * step_words + (4 * p - s * sw)
        st_global_v4_u32(dst, f, a, b, c, d)
        i += stride


RETILE_BM_SIG = "void(uint32[:, ::1], uint32[::1], int32[::1], int64, int64)"


def _retile_mma(src, dst):
    # dst (N*K/8,) uint32 in gemv_mma's fragment order [tile][group][lane][8 words], one thread
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
def _jit():
    return cuda.jit(RETILE_SIG)(_retile)


@functools.cache
def _jit_bm():
    return cuda.jit(RETILE_BM_SIG)(_retile_bm)


@functools.cache
def _jit_mma():
    return cuda.jit(RETILE_MMA_SIG)(_retile_mma)


def retile_mma(src, dst, stream=0) -> None:
    """File-layout (N, K/8) words -> gemv_mma's fragment layout in dst (same shape; the NumPy
    reference is gemv_mma.mma_layout).  N must be a multiple of 16."""
    if src.shape != dst.shape or src.dtype != np.uint32 or dst.dtype != np.uint32:
        raise ValueError(f"retile_mma: src {src.dtype}{src.shape} and dst {dst.dtype}{dst.shape} "
                         "must be equal-shape uint32")
    if src.shape[0] % 16 or src.shape[1] % 16:
        raise ValueError(f"retile_mma: {src.shape} is not whole 16-row tiles of 128-weight groups")
    blocks = min(4096, -(-src.shape[0] * src.shape[1] // THREADS))
    _jit_mma()[blocks, THREADS, stream](src, dst.reshape(dst.size))


def retile(src, dst, perm, stream=0, block_major=None) -> None:
    """Launch the permutation (src and dst device arrays of equal shape, perm a device int32);
    block_major=(ks, rows_per_block): dst's memory gets the block-major layout of that tiling."""
    if src.shape != dst.shape or src.dtype != np.uint32 or dst.dtype != np.uint32:
        raise ValueError(f"retile: src {src.dtype}{src.shape} and dst {dst.dtype}{dst.shape} "
                         "must be equal-shape uint32")
    if perm.shape[0] * 4 != src.shape[1]:
        raise ValueError(f"retile: {perm.shape[0]} chunks for rows of {src.shape[1]} words")
    blocks = min(4096, -(-src.shape[0] * perm.shape[0] // THREADS))
    if block_major is None:
        _jit()[blocks, THREADS, stream](src, dst, perm)
    else:
        ks, rpb = block_major
        _jit_bm()[blocks, THREADS, stream](src, dst.reshape(dst.size), perm, int(ks), int(rpb))
