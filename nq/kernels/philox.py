"""Philox4x32-10, the counter-based generator the device sampler draws with, and its NumPy twin.

Why counter-based: a decode step is one replay of a captured graph, so the generator can keep
no state between replays that the graph would have to carry.  Philox maps (counter, key) to
four random 32-bit words with no state at all (Salmon et al., "Parallel random numbers: as easy
as 1, 2, 3", SC'11): the sampler keys it with the user's seed and counts with (token id / 4,
decode step, position), so the same seed and prompt give the same tokens whether the step ran
eagerly or as a replay, and any thread can draw the noise of any token without coordination.

    philox4x32_10(c0, c1, c2, c3, k0, k1) -> (x0, x1, x2, x3)      device body (int64 lanes)
    philox4x32_10_np(ctr, key)           -> uint32 (..., 4)          NumPy twin, vectorised
    uniform_open01(x)                                                 fp32 in (0, 1), 2^-24 grid

The device body keeps every 32-bit word in an int64 (numba types Python int constants as int64,
and mixing them with uint32/uint64 operands silently promotes to float64); the high half of
each product comes from `mul.hi.u32` (nq/ptx/mulhi.py) and the low half from a masked multiply
that LLVM narrows to 32 bits, so a round is two multiplies of each kind, no 64-bit multiply.
Known-answer vectors: Random123's tests/kat_vectors (tests/kernels/test_sampler_cpu.py).
"""
from __future__ import annotations

import numpy as np
from numba.cuda.types import int64

from nq.ptx import mul_hi_u32

PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57        # round multipliers
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85        # key schedule (golden ratio, sqrt(3)-1)
MASK32 = 0xFFFFFFFF


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Ten Philox rounds on counter (c0..c3) with key (k0, k1); every argument and result is a
    32-bit word held in an int64.  A plain body: kernels wrap it with `dev` (common.py)."""
    for _ in range(10):
        hi0 = int64(mul_hi_u32(c0, PHILOX_M0))
        hi1 = int64(mul_hi_u32(c2, PHILOX_M1))
        lo0 = (c0 * PHILOX_M0) & MASK32
        lo1 = (c2 * PHILOX_M1) & MASK32
        c0, c1, c2, c3 = (hi1 ^ c1 ^ k0), lo1, (hi0 ^ c3 ^ k1), lo0
        k0 = (k0 + PHILOX_W0) & MASK32
        k1 = (k1 + PHILOX_W1) & MASK32
    return c0, c1, c2, c3


def philox4x32_10_np(ctr, key) -> np.ndarray:
    """NumPy twin: ctr (..., 4) and key (..., 2) of 32-bit words -> uint32 (..., 4)."""
    ctr = np.asarray(ctr, np.uint64)
    key = np.asarray(key, np.uint64)
    c = [ctr[..., i].copy() for i in range(4)]
    k0, k1 = key[..., 0].copy(), key[..., 1].copy()
    m = np.uint64(MASK32)
    for _ in range(10):
        p0 = c[0] * np.uint64(PHILOX_M0)
        p1 = c[2] * np.uint64(PHILOX_M1)
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & m, (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & m]
        k0 = (k0 + np.uint64(PHILOX_W0)) & m
        k1 = (k1 + np.uint64(PHILOX_W1)) & m
    return np.stack(c, axis=-1).astype(np.uint32)


def uniform_open01(x):
    """A 32-bit word -> fp32 in (0, 1): (2*(x >> 9) + 1) * 2^-24, exact in fp32 (an odd
    integer below 2^24 times a power of two), never 0 or 1, so -log(-log(u)) is finite."""
    return np.float32((((x >> 9) << 1) + 1)) * np.float32(5.9604644775390625e-08)


def uniform_open01_np(x) -> np.ndarray:
    """NumPy twin of uniform_open01 over uint32 words."""
    x = np.asarray(x, np.uint32)
    return (((x >> 9).astype(np.float32) * np.float32(2) + np.float32(1))
            * np.float32(5.9604644775390625e-08))
