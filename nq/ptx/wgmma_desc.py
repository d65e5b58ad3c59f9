"""The shared-memory matrix descriptor of a wgmma operand (nq/ptx/wgmma.py) and the layout
it names, as Python: the descriptor's bits (built on the host, a kernel ORs in the address),
and models of where each element of a K-major or MN-major operand sits, which the twins read
the simulator's shared memory through.  Host code only: nothing here is compiled into a kernel.

Shared-memory layout of a K-major operand (B: N rows x 16 k, each row's k contiguous; A in
"ss": 64 rows x 16 k), as the descriptor names it (`smem_offset` is the model):
    swizzle NONE: 8 x 8 "core matrices" of 128 contiguous bytes (row r at 16 r); the core
        matrix of rows 8i.., k 8j.. at start + i * SBO + j * LBO.
    swizzle 128B / 64B / 32B: rows of W = 128 / 64 / 32 bytes (W/2 k of a row), row r of each
        8-row atom at r * W, atoms SBO apart; the 16-byte chunk bits [4, 4+b) of every address
        XORed with bits [7, 7+b) (b = 3 / 2 / 1), i.e. the pattern repeats every 1024 / 512 /
        256 bytes of *absolute* shared address (align the buffer to that).  The k16 step j of
        a row starts 32 j bytes in (advance the descriptor's start by 32 j; LBO is unused).
A B operand whose N is contiguous instead ("MN-major", V of attention as the cache holds it)
takes `wgmma_rs_tb` (trans-b = 1) and the layout `smem_offset_mn` models: with the 128B
swizzle it is the same 128-byte rows, each holding 64 consecutive n of one k.

Descriptor (`desc_hi` + `desc_lo`; the PTX ISA's "matrix descriptor"): bits 0-13 start address
>> 4, 16-29 LBO >> 4, 32-45 SBO >> 4, 49-51 base offset (0: atoms aligned), 62-63 swizzle
(0 none, 1 128B, 2 64B, 3 32B).  The constant high part is built on the host; a kernel ORs in
`(addr >> 4) & 0x3FFF` for each stage and k step.
"""
from __future__ import annotations

import numpy as np

from nq.ptx import _sim

SWIZZLE_NONE, SWIZZLE_128B, SWIZZLE_64B, SWIZZLE_32B = 0, 1, 2, 3
SWIZZLE_ROW_BYTES = {SWIZZLE_128B: 128, SWIZZLE_64B: 64, SWIZZLE_32B: 32}
SWIZZLE_BITS = {SWIZZLE_NONE: 0, SWIZZLE_128B: 3, SWIZZLE_64B: 2, SWIZZLE_32B: 1}


def desc_hi(lbo: int, sbo: int, swizzle: int, base_offset: int = 0) -> int:
    """The address-independent bits of a matrix descriptor (a Python int; use it as a constant
    in the kernel): LBO, SBO in bytes (multiples of 16, < 2^18), swizzle mode, base offset."""
    for name, v in (("LBO", lbo), ("SBO", sbo)):
        if v % 16 or not 0 <= v < 1 << 18:
            raise ValueError(f"wgmma descriptor: {name}={v} must be a multiple of 16 below 2^18")
    if swizzle not in SWIZZLE_BITS or not 0 <= base_offset < 8:
        raise ValueError(f"wgmma descriptor: swizzle {swizzle} must be 0-3, base offset 0-7")
    return ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (base_offset << 49) | (swizzle << 62)


def desc_lo(addr):
    """The start-address field of a descriptor for shared address addr (16-byte aligned)."""
    return (addr >> 4) & 0x3FFF


def desc_fields(desc: int) -> tuple[int, int, int, int]:
    """(start address, LBO, SBO, swizzle) in bytes of a descriptor (the twins' decoder)."""
    desc = int(desc)
    return ((desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4,
            (desc >> 62) & 3)


def smem_offset(row, k, lbo: int, sbo: int, swizzle: int, start: int = 0):
    """Shared byte address of element (row, k) (k < 16) of the K-major fp16 operand a
    descriptor (start, lbo, sbo, swizzle) names: the layout model of the module doc.  Works on
    NumPy integer arrays too."""
    row = np.asarray(row, np.int64)
    k = np.asarray(k, np.int64)
    if swizzle == SWIZZLE_NONE:
        return start + (row // 8) * sbo + (k // 8) * lbo + (row % 8) * 16 + (k % 8) * 2
    width, bits = SWIZZLE_ROW_BYTES[swizzle], SWIZZLE_BITS[swizzle]
    u = start + (row // 8) * sbo + (row % 8) * width + k * 2
    return u ^ (((u >> 7) & ((1 << bits) - 1)) << 4)


def read_operand(desc, rows: int) -> np.ndarray:
    """(rows, 16) float64: the K-major fp16 operand a descriptor names, read from simulated
    shared memory (nq/ptx/_sim)."""
    start, lbo, sbo, sw = desc_fields(desc)
    r, k = np.meshgrid(np.arange(rows), np.arange(16), indexing="ij")
    addrs = smem_offset(r, k, lbo, sbo, sw, start)
    lo, hi = int(addrs.min()), int(addrs.max()) + 2
    window = _sim.shared_bytes(lo, hi - lo)
    assert (addrs % 2 == 0).all()
    out = np.empty((rows, 16), np.float64)
    flat = (addrs - lo).reshape(-1)
    vals = window[flat].astype(np.uint16) | (window[flat + 1].astype(np.uint16) << 8)
    out[:] = vals.view(np.float16).astype(np.float64).reshape(rows, 16)
    return out


def smem_offset_mn(n, k, lbo: int, sbo: int, swizzle: int, start: int = 0):
    """Shared byte address of element (n, k) (k < 16) of an MN-major fp16 B operand (the
    wgmma's trans-b = 1: along N contiguous, as V sits in the cache, [key][dim] = [k][n]):

        swizzle NONE: 8 x 8 core matrices of 128 contiguous bytes, each 8 k rows of 16 bytes
            (8 n); n's 8-element blocks SBO apart, k's 8-row blocks LBO apart.
        swizzle 128B / 64B / 32B: k rows of W = 128 / 64 / 32 bytes (W/2 consecutive n), 8 k
            rows to an atom (k at (k % 8) W), atoms along k SBO apart and along n LBO apart,
            XOR-swizzled on absolute addresses as the K-major layout.

    (The PTX ISA's "MN-major" strides: for swizzled layouts LBO steps (swizzle bytes / 16)
    16-byte units of N, SBO steps 8 of K.)  So V's tile stored as K's -- 128-byte key rows of
    64 dims, swizzled -- is already this layout: SBO = 1024 (8 keys), LBO = the distance to
    the next 64 dims."""
    n = np.asarray(n, np.int64)
    k = np.asarray(k, np.int64)
    if swizzle == SWIZZLE_NONE:
        return start + (n // 8) * sbo + (k // 8) * lbo + (k % 8) * 16 + (n % 8) * 2
    width, bits = SWIZZLE_ROW_BYTES[swizzle], SWIZZLE_BITS[swizzle]
    per_row = width // 2
    u = start + (n // per_row) * lbo + (k // 8) * sbo + (k % 8) * width + (n % per_row) * 2
    return u ^ (((u >> 7) & ((1 << bits) - 1)) << 4)


def read_operand_mn(desc, n: int) -> np.ndarray:
    """(n, 16) float64: the MN-major fp16 B operand (N x 16, transposed into the K-major
    model's rows) a descriptor names, read from simulated shared memory."""
    start, lbo, sbo, sw = desc_fields(desc)
    nn, k = np.meshgrid(np.arange(n), np.arange(16), indexing="ij")
    addrs = smem_offset_mn(nn, k, lbo, sbo, sw, start)
    lo, hi = int(addrs.min()), int(addrs.max()) + 2
    window = _sim.shared_bytes(lo, hi - lo)
    flat = (addrs - lo).reshape(-1)
    vals = window[flat].astype(np.uint16) | (window[flat + 1].astype(np.uint16) << 8)
    return vals.view(np.float16).astype(np.float64).reshape(n, 16)
