"""The INT4 weight layouts the kernels read, as NumPy models (the kernels' address arithmetic
mirrors them; the upload re-tiles on the GPU with nq/kernels/int4/retile.py).

Two layouts, both (N, K/8) uint32 words of 8 ValueShuffle nibbles, fixed per projection by its
decode tiling (`Tiling.layout()`):
  * row layout (`tile_rows`): each row's 16-byte chunks permuted so that the `ks` lanes of a
    CUDA-core GEMV segment read contiguous runs (qkv, gate_up; o_proj at small sizes);
  * mma fragment layout (`mma_layout`): each word is the A fragment of one lane of an
    `mma.m16n8k16` (o_proj, down, gate_up; nq/kernels/int4/gemv_mma.py's docstring draws it).
Scales keep the file's (N, K/128) fp16 layout in both.  (qkv's rope-ordered mma layout,
`rope_row`, went with NQ_MMA_QKV=1: tiling.py's epitaph, code at 29184bc.)
"""
from __future__ import annotations

import numpy as np

from nq.config import GROUP_SIZE
from nq.loader.quant import unpack_value_shuffle

TILE = 16          # rows of an mma tile (m16)
CHUNK = 16         # columns of an mma step (k16)


def chunk_permutation(k: int, ks: int) -> np.ndarray:
    """perm (K/32,): tiled row chunk p holds file chunk perm[p] (a chunk = 16 bytes = 32 weights).

    Step s covers groups s*ks .. s*ks+gs-1 (gs = ks except in a short last step); inside a step
    the chunks are ordered (chunk-in-group i, lane j), so the four loads a lane issues per step
    are, across the ks lanes, four contiguous runs of ks*16 bytes (coalesced, no sector split).
    """
    g = k // GROUP_SIZE
    perm = []
    for s in range(-(-g // ks)):
        gs = min(ks, g - s * ks)
        for i in range(4):
            perm.extend(4 * (s * ks + j) + i for j in range(gs))
    return np.asarray(perm, np.int64)


def tile_rows(qweight: np.ndarray, ks: int) -> np.ndarray:
    """(N, K/8) uint32 file layout -> (N, K/8) uint32 kernel layout (each row permuted alone)."""
    n, k8 = qweight.shape
    chunks = np.ascontiguousarray(qweight).reshape(n, k8 // 4, 4)
    return np.ascontiguousarray(chunks[:, chunk_permutation(k8 * 8, ks)].reshape(n, k8))


def untile_rows(tiled: np.ndarray, ks: int) -> np.ndarray:
    """The inverse of tile_rows."""
    n, k8 = tiled.shape
    out = np.empty((n, k8 // 4, 4), np.uint32)
    out[:, chunk_permutation(k8 * 8, ks)] = tiled.reshape(n, k8 // 4, 4)
    return out.reshape(n, k8)


def prepare_weights(parts, ks: int) -> tuple[np.ndarray, np.ndarray]:
    """[(qweight (Ni, K/8) uint32, scales (Ni, K/128) fp16), ...] -> concatenated, row-tiled
    (qw, scales)."""
    qws = [np.asarray(q) for q, _ in parts]
    scs = [np.asarray(s) for _, s in parts]
    k8 = qws[0].shape[1]
    for q, s in zip(qws, scs):
        if q.dtype != np.uint32 or q.ndim != 2 or q.shape[1] != k8:
            raise ValueError(f"prepare_weights: qweight must be uint32 (N, {k8}), got {q.dtype} {q.shape}")
        if s.dtype != np.float16 or s.shape != (q.shape[0], k8 * 8 // GROUP_SIZE):
            raise ValueError(f"prepare_weights: scales must be fp16 {(q.shape[0], k8 * 8 // GROUP_SIZE)}, "
                             f"got {s.dtype} {s.shape}")
    tiled = tile_rows(np.concatenate(qws), ks)
    return tiled, np.ascontiguousarray(np.concatenate(scs))


def mma_layout(qweight: np.ndarray) -> np.ndarray:
    """File-layout (N, K/8) ValueShuffle words -> (N, K/8) words in the fragment order (module doc):
    C-order memory [tile][group][lane][8 words]."""
    n, k8 = qweight.shape
    k = k8 * 8
    if n % TILE or k % GROUP_SIZE:
        raise ValueError(f"mma_layout: N={n} must be a multiple of {TILE} and K={k} of {GROUP_SIZE}")
    nt, g = n // TILE, k // GROUP_SIZE
    nib = (unpack_value_shuffle(np.asarray(qweight)).astype(np.uint32) & 0xF)   # two's complement
    # (tile, group, row in tile, chunk in group, column in chunk)
    r = nib.reshape(nt, TILE, g, GROUP_SIZE // CHUNK, CHUNK).transpose(0, 2, 1, 3, 4)
    top, bot = r[:, :, :8], r[:, :, 8:]                  # rows g and g + 8: (nt, g, 8, 8, 16)

    def cols(x, first):                                   # column first + 2t, t = 0..3
        return x[..., first:first + 8:2]                  # (nt, g, 8 rows, 8 chunks, 4 t)

    word = (cols(top, 0) | cols(bot, 0) << 4 | cols(top, 8) << 8 | cols(bot, 8) << 12
            | cols(top, 1) << 16 | cols(bot, 1) << 20 | cols(top, 9) << 24 | cols(bot, 9) << 28)
    # (nt, g, row g, chunk i, t) -> (nt, g, lane = 4 row + t, chunk i)
    word = word.transpose(0, 1, 2, 4, 3).reshape(nt, g, 32, GROUP_SIZE // CHUNK)
    return np.ascontiguousarray(word.astype(np.uint32).reshape(n, k8))


def mma_unlayout(words: np.ndarray) -> np.ndarray:
    """The inverse of mma_layout (tests): fragment-order words -> file-layout ValueShuffle words."""
    from nq.loader.quant import pack_value_shuffle
    n, k8 = words.shape
    k = k8 * 8
    nt, g = n // TILE, k // GROUP_SIZE
    w = np.asarray(words, np.uint32).reshape(nt, g, 8, 4, GROUP_SIZE // CHUNK)  # nt, g, row, t, i
    out = np.zeros((nt, g, TILE, GROUP_SIZE // CHUNK, CHUNK), np.int8)
    for slot, (half, col) in enumerate([(0, 0), (1, 0), (0, 8), (1, 8), (0, 1), (1, 1), (0, 9), (1, 9)]):
        v = ((w >> np.uint32(4 * slot)) & 0xF).astype(np.int8)
        v = np.where(v > 7, v - 16, v).transpose(0, 1, 2, 4, 3)              # nt, g, row, i, t
        out[:, :, 8 * half:8 * half + 8, :, col:col + 8:2] = v
    return pack_value_shuffle(out.transpose(0, 2, 1, 3, 4).reshape(n, k))
