"""The INT4 weight layouts the kernels read, as NumPy models (the kernels' address arithmetic
mirrors them; the upload re-tiles on the GPU with nq/kernels/int4/retile.py).

Two layouts, both (N, K/8) uint32 words of 8 ValueShuffle nibbles, fixed per projection by its
decode tiling (`Tiling.layout()`):
  * row layout (`tile_rows`): each row's 16-byte chunks permuted so that the `ks` lanes of a
    CUDA-core GEMV segment read contiguous runs (qkv, gate_up; o_proj at small sizes);
  * mma fragment layout (`mma_layout`): each word is the A fragment of one lane of an
    `mma.m16n8k16` (o_proj, down, gate_up; nq/kernels/int4/gemv_mma.py's docstring draws it);
    qkv's (`mma_layout(..., rope=D)`, NQ_MMA_QKV=1) first reorders the rows of each head
    (`rope_rows`) so that a tile's rows g and g + 8 are a RoPE pair.
Scales keep the file's (N, K/128) fp16 layout in all (the kernels find a permuted row's scale
at its natural row: `rope_row`).
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


def rope_row(r, d: int):
    """The natural row (file order) that row r of qkv's rope-ordered mma layout holds, for
    head_dim d (works on ints and NumPy arrays alike; the kernels inline the same arithmetic).

    A RoPE pair is rows i and i + d/2 of a head; an m16n8k16 lane holds tile rows g and g + 8.
    So tile j of a head (d/16 tiles) takes the head's rows 8j .. 8j+7 as its rows 0..7 and
    their partners 8j + d/2 .. 8j+7 + d/2 as rows 8..15:

        row 16j + 8h + g of a head  <-  natural row 8j + g + h * d/2      (g < 8, h in 0, 1)

    A tile's rows g, g + 8 are then the natural rows r0, r0 + d/2 (r0 = rope_row of row g), and
    every head keeps its rows (the heads are whole tiles: d is a multiple of 16)."""
    head, rr = r // d * d, r % d
    return head + (rr // 16) * 8 + (rr & 7) + ((rr >> 3) & 1) * (d // 2)


def rope_rows(n: int, d: int) -> np.ndarray:
    """perm (N,): row p of the rope-ordered layout is natural row perm[p] (`rope_row`)."""
    if d <= 0 or d % 16 or n % d:
        raise ValueError(f"rope_rows: head_dim={d} must be a multiple of 16 and divide N={n}")
    return rope_row(np.arange(n, dtype=np.int64), d)


def mma_layout(qweight: np.ndarray, rope: int = 0) -> np.ndarray:
    """File-layout (N, K/8) ValueShuffle words -> (N, K/8) words in the fragment order (module doc):
    C-order memory [tile][group][lane][8 words].  rope = head_dim: the rows first reordered by
    `rope_rows` (qkv's layout on the tensor cores); 0: in file order."""
    n, k8 = qweight.shape
    k = k8 * 8
    if n % TILE or k % GROUP_SIZE:
        raise ValueError(f"mma_layout: N={n} must be a multiple of {TILE} and K={k} of {GROUP_SIZE}")
    if rope:
        qweight = np.asarray(qweight)[rope_rows(n, rope)]
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


def mma_unlayout(words: np.ndarray, rope: int = 0) -> np.ndarray:
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
    rows = pack_value_shuffle(out.transpose(0, 2, 1, 3, 4).reshape(n, k))
    if rope:
        natural = np.empty_like(rows)
        natural[rope_rows(n, rope)] = rows
        return natural
    return rows
