"""INT4 quantisation (symmetric, group 128) and the ValueShuffle nibble packing; the int8
lm_head's per-row quantisation.

The format decisions live here and in docs/FORMAT.md; kernels cite them.

Quantisation: for every output row n and every group g of GROUP_SIZE consecutive input
columns, scale[n, g] = fp16(absmax / 7) and q = clip(rint(w / scale), -7, 7), zero-point 0.
The scale is computed in fp32, rounded to fp16, and q is computed against the *rounded*
scale, so `q * float32(scale)` (what every kernel computes) is exactly the dequantisation the
quantiser intended; there is no hidden fp32 scale that the file does not store.  All-zero
groups get scale 0 and q 0 (never 0/0 = NaN).  -8 is never produced: the grid is symmetric.

ValueShuffle: eight consecutive input columns w0..w7 of one row share one uint32, the nibble
slots from the lowest up holding [w0, w2, w4, w6, w1, w3, w5, w7], each as 4-bit two's
complement.  Why this order: a kernel that shifts the word right by 0, 4, 8, 12 and masks with
0x000F000F gets (w0, w1), (w2, w3), (w4, w5), (w6, w7) in the low/high 16-bit halves, i.e.
adjacent pairs already laid out as the two lanes an fp16x2 conversion (the magic-number
trick, `lop3` + `sub.f16x2`) wants, with one mask per pair and no byte permutes.

int8 lm_head (`nq pack --lm-head int8`): one scale per row (per output token), symmetric,
scale[n] = fp32(absmax(W[n]) / 127) and q = clip(rint(w / scale), -127, 127), q against the
stored fp32 scale as above.  Per row, not per group: the kernel applies the scale once to a
row's finished sum, so the inner loop is integer-to-float and fma only.  fp32, not fp16: the
scales are 4 bytes a row against the row's 3,584 (0.1 %), and need no rounding story.
"""
from __future__ import annotations

import numpy as np

from nq.config import GROUP_SIZE

QMAX = 7
# Slot s (bits 4s..4s+3 from the lowest) holds input column SHUFFLE[s] of its group of 8.
SHUFFLE = (0, 2, 4, 6, 1, 3, 5, 7)
# Rows per chunk in the chunked paths: 1024 rows x 3584 fp32 is 14 MiB of temporaries.
CHUNK_ROWS = 1024


def _check_2d(w: np.ndarray, what: str) -> tuple[int, int]:
    if w.ndim != 2:
        raise ValueError(f"{what}: expected a 2-D (out, in) matrix, got shape {w.shape}")
    n, k = w.shape
    if k % GROUP_SIZE:
        raise ValueError(f"{what}: {k} input columns is not a multiple of the group size {GROUP_SIZE}")
    return n, k


def _quantize_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantise a (n, K) block; the unchunked core of quantize_int4."""
    n, k = w.shape
    g = w.reshape(n, k // GROUP_SIZE, GROUP_SIZE).astype(np.float32, copy=False)
    absmax = np.abs(g).max(axis=2)                                     # (n, G) fp32
    if not np.isfinite(absmax).all():
        raise ValueError("weights contain inf or NaN; the checkpoint is corrupt")
    with np.errstate(over="ignore"):
        scales = (absmax / np.float32(QMAX)).astype(np.float16)        # (n, G) fp16
    if np.isinf(scales).any():
        raise ValueError(f"a weight group has absmax {absmax.max():g}, beyond what an fp16 "
                         "scale can represent (65504 * 7)")
    s32 = scales.astype(np.float32)[:, :, None]
    # Dividing by 1 where the scale is 0 keeps the zero group at q = 0 instead of NaN.
    q = np.rint(g / np.where(s32 == 0, np.float32(1), s32))
    q[np.broadcast_to(s32 == 0, q.shape)] = 0
    # The fp16 rounding of the scale can push |w/scale| just past 7.5; clip, never wrap.
    np.clip(q, -QMAX, QMAX, out=q)
    return q.astype(np.int8).reshape(n, k), scales


def quantize_int4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, K) float -> (q int8 (N, K) in [-7, 7], scales fp16 (N, K // 128)); chunked over rows."""
    n, k = _check_2d(w, "quantize_int4")
    q = np.empty((n, k), np.int8)
    scales = np.empty((n, k // GROUP_SIZE), np.float16)
    for r in range(0, n, CHUNK_ROWS):
        q[r:r + CHUNK_ROWS], scales[r:r + CHUNK_ROWS] = _quantize_rows(w[r:r + CHUNK_ROWS])
    return q, scales


def dequantize_int4(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """q int8 (N, K), scales fp16 (N, K // 128) -> float32 (N, K): q * float32(scale)."""
    n, k = _check_2d(q, "dequantize_int4")
    if scales.shape != (n, k // GROUP_SIZE):
        raise ValueError(f"dequantize_int4: scales shape {scales.shape} does not match "
                         f"q shape {q.shape} (expected {(n, k // GROUP_SIZE)})")
    g = q.reshape(n, k // GROUP_SIZE, GROUP_SIZE).astype(np.float32)
    return (g * scales.astype(np.float32)[:, :, None]).reshape(n, k)


def pack_value_shuffle(q: np.ndarray) -> np.ndarray:
    """int8 (N, K) in [-8, 7] -> uint32 (N, K // 8), nibble slots [w0,w2,w4,w6,w1,w3,w5,w7]."""
    if q.ndim != 2 or q.shape[1] % 8:
        raise ValueError(f"pack_value_shuffle: expected (N, K) with K % 8 == 0, got {q.shape}")
    n, k = q.shape
    nib = (q.reshape(n, k // 8, 8).astype(np.uint32) & 0xF)            # two's complement nibbles
    packed = np.zeros((n, k // 8), np.uint32)
    for slot, col in enumerate(SHUFFLE):
        packed |= nib[:, :, col] << np.uint32(4 * slot)
    return packed


def unpack_value_shuffle(packed: np.ndarray) -> np.ndarray:
    """uint32 (N, K // 8) -> int8 (N, K); the inverse of pack_value_shuffle."""
    if packed.ndim != 2 or packed.dtype != np.uint32:
        raise ValueError(f"unpack_value_shuffle: expected a 2-D uint32 array, got "
                         f"{packed.dtype} {packed.shape}")
    n, k8 = packed.shape
    out = np.empty((n, k8, 8), np.int8)
    for slot, col in enumerate(SHUFFLE):
        nib = ((packed >> np.uint32(4 * slot)) & 0xF).astype(np.int8)
        out[:, :, col] = np.where(nib > 7, nib - 16, nib)              # sign-extend 4 bits
    return out.reshape(n, k8 * 8)


def dequantize_packed(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """ValueShuffle uint32 (N, K // 8) + fp16 scales (N, K // 128) -> float32 (N, K)."""
    n = packed.shape[0]
    out = np.empty((n, packed.shape[1] * 8), np.float32)
    for r in range(0, n, CHUNK_ROWS):
        out[r:r + CHUNK_ROWS] = dequantize_int4(unpack_value_shuffle(packed[r:r + CHUNK_ROWS]),
                                                scales[r:r + CHUNK_ROWS])
    return out


def quantize_pack(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, K) float -> (qweight uint32 (N, K // 8), scales fp16 (N, K // 128)), chunked.

    The pack path: never holds the int8 (N, K) matrix, only CHUNK_ROWS rows of temporaries,
    so a 37888 x 3584 matrix costs its two outputs plus ~30 MiB.
    """
    n, k = _check_2d(w, "quantize_pack")
    packed = np.empty((n, k // 8), np.uint32)
    scales = np.empty((n, k // GROUP_SIZE), np.float16)
    for r in range(0, n, CHUNK_ROWS):
        q, scales[r:r + CHUNK_ROWS] = _quantize_rows(w[r:r + CHUNK_ROWS])
        packed[r:r + CHUNK_ROWS] = pack_value_shuffle(q)
    return packed, scales


def fake_quantize_matrix(w: np.ndarray) -> np.ndarray:
    """dequantize(quantize(w)): the fp32 matrix an INT4 engine effectively multiplies by."""
    return dequantize_int4(*quantize_int4(w))


# ---- int8 rows (the lm_head) ------------------------------------------------------------------
INT8_QMAX = 127


def quantize_int8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, K) float -> (q int8 (N, K) in [-127, 127], scales fp32 (N,)); chunked over rows.

    scale = fp32(absmax_row / 127), q = clip(rint(w / scale), -127, 127); an all-zero row
    gets scale 0 and q 0.  |w - q * scale| <= scale / 2 (plus fp32 rounding of w / scale)."""
    if w.ndim != 2:
        raise ValueError(f"quantize_int8_rows: expected a 2-D (out, in) matrix, got shape {w.shape}")
    n, k = w.shape
    q = np.empty((n, k), np.int8)
    scales = np.empty(n, np.float32)
    for r in range(0, n, CHUNK_ROWS):
        part = np.asarray(w[r:r + CHUNK_ROWS], np.float32)
        absmax = np.abs(part).max(axis=1)                              # (rows,) fp32
        if not np.isfinite(absmax).all():
            raise ValueError("weights contain inf or NaN; the checkpoint is corrupt")
        s = absmax / np.float32(INT8_QMAX)
        # dividing by 1 where the scale is 0 keeps a zero row at q = 0 instead of NaN
        qr = np.rint(part / np.where(s == 0, np.float32(1), s)[:, None])
        np.clip(qr, -INT8_QMAX, INT8_QMAX, out=qr)
        q[r:r + CHUNK_ROWS], scales[r:r + CHUNK_ROWS] = qr, s
    return q, scales


def dequantize_int8_rows(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """q int8 (N, K), scales fp32 (N,) -> float32 (N, K): q * scale, the lm_head the int8
    kernel multiplies by (it applies the scale to the row's sum instead: the same to fp32
    rounding)."""
    if q.ndim != 2 or q.dtype != np.int8 or scales.shape != (q.shape[0],):
        raise ValueError(f"dequantize_int8_rows: q {q.dtype} {q.shape} and scales {scales.shape} "
                         "are not int8 (N, K) and (N,)")
    out = np.empty(q.shape, np.float32)
    for r in range(0, q.shape[0], CHUNK_ROWS):
        out[r:r + CHUNK_ROWS] = q[r:r + CHUNK_ROWS] * scales[r:r + CHUNK_ROWS, None].astype(np.float32)
    return out


def row_bounds(scales) -> np.ndarray:
    """fp32 (V,): each row's largest group scale, from the file's fp16 (V, H/128) scales
    (host NumPy, in row chunks: the 7B's are 8.5 MB) -- an INT4 lm_head's rounding bound,
    nq/kernels/lm_head_rescore.py."""
    s = np.asarray(scales)
    out = np.empty(s.shape[0], np.float32)
    for r in range(0, s.shape[0], 16384):
        out[r:r + 16384] = np.abs(s[r:r + 16384].astype(np.float32)).max(axis=1)
    return out
