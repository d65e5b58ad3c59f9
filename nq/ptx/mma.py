"""Tensor cores: ldmatrix (shared -> fragments), mma.sync m16n8k16 fp16 -> fp32, and
mma.sync m16n8k32 s8 -> s32 (the GEMVs' integer path, gemv_mma.py "i8").

Prefill multiplies many tokens at once, so it is compute-bound where decode is memory-bound;
one `mma.sync.m16n8k16` is 4096 multiply-adds.  numba has no tensor-core API.  These are
warp-collective: all 32 lanes execute them together, each holding a slice of the matrices
("fragments") laid out as the PTX ISA fixes.  With g = lane // 4 and t = lane % 4:

    A (16x16 fp16, row-major):  a0 = A[g, 2t:2t+2]    a1 = A[g+8, 2t:2t+2]
                                a2 = A[g, 2t+8:2t+10] a3 = A[g+8, 2t+8:2t+10]
    B (16x8 fp16, K x N):       b0 = B[2t:2t+2, g]    b1 = B[2t+8:2t+10, g]
    C, D (16x8 fp32):           c0, c1 = C[g, 2t], C[g, 2t+1]   c2, c3 = C[g+8, 2t], C[g+8, 2t+1]

each aN/bN a uint32 holding two fp16 (lower half = lower column/row index).  m16n8k32 with
signed bytes (s8 in, s32 out) keeps the rows and columns and widens k:

    A (16x32 s8):  a0 = A[g, 4t:4t+4]   a1 = A[g+8, 4t:4t+4]   a2 = A[g, 16+4t:..]   a3 = A[g+8, 16+4t:..]
    B (32x8 s8):   b0 = B[4t:4t+4, g]   b1 = B[16+4t:16+4t+4, g]
    C, D (16x8 s32) as above, byte i of a register the element i of its run.  ldmatrix.x4 of a
16x16 row-major fp16 tile, lane i addressing row i % 16 at column 8 * (i // 16), yields exactly
a0..a3; of a B tile stored N-major (Bt, 16 x 16, rows = n), lane i addressing Bt row
(i % 8) + 8 * (i // 16) at column 8 * ((i // 8) % 2), yields (b0, b1) for n 0-7 and n 8-15.

The *_warp functions are the whole-warp models the tests check against numpy; the twins (used
by the simulator) exchange operands between lanes with nq/ptx/_sim.warp_exchange.
"""
from __future__ import annotations

import numpy as np

from nq.ptx import _sim
from nq.ptx._asm import ptx


def a_coords(lane: int, reg: int, half: int) -> tuple[int, int]:
    """(row, col) in the 16x16 A tile of half `half` of register a{reg} of `lane`."""
    g, t = divmod(lane, 4)
    return g + 8 * (reg & 1), 2 * t + half + 8 * (reg >> 1)


def b_coords(lane: int, reg: int, half: int) -> tuple[int, int]:
    """(k, n) in the 16x8 B tile of half `half` of register b{reg} of `lane`."""
    g, t = divmod(lane, 4)
    return 2 * t + half + 8 * reg, g


def c_coords(lane: int, reg: int) -> tuple[int, int]:
    """(row, col) in the 16x8 C/D tile of register c{reg} of `lane`."""
    g, t = divmod(lane, 4)
    return g + 8 * (reg >> 1), 2 * t + (reg & 1)


def _s8(u32: int, byte: int) -> int:
    b = (int(u32) >> (8 * byte)) & 0xFF
    return b - 256 if b & 0x80 else b


def mma_m16n8k32_s8_s32_warp(a, b, c) -> np.ndarray:
    """Whole-warp model of m16n8k32 s8 x s8 + s32: a (32, 4) and b (32, 2) uint32 of four
    signed bytes, c (32, 4) int32 -> d (32, 4) int32, exact, wrapping at 2^32 as the tensor
    core does without .satfinite."""
    A = np.zeros((16, 32), np.int64)
    B = np.zeros((32, 8), np.int64)
    C = np.zeros((16, 8), np.int64)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for reg in range(4):
            for i in range(4):
                A[g + 8 * (reg & 1), 16 * (reg >> 1) + 4 * t + i] = _s8(a[lane][reg], i)
            C[c_coords(lane, reg)] = int(c[lane][reg])
        for reg in range(2):
            for i in range(4):
                B[16 * reg + 4 * t + i, g] = _s8(b[lane][reg], i)
    D = ((A @ B + C + 2**31) % 2**32 - 2**31).astype(np.int32)
    return np.array([[D[c_coords(lane, reg)] for reg in range(4)] for lane in range(32)],
                    dtype=np.int32)


def _f16(u32: int, half: int) -> float:
    return float(np.array((int(u32) >> (16 * half)) & 0xFFFF, dtype=np.uint16).view(np.float16))


def mma_m16n8k16_f16_f32_warp(a, b, c) -> np.ndarray:
    """Whole-warp model: a (32, 4) uint32, b (32, 2) uint32, c (32, 4) float32 -> d (32, 4).

    The products of fp16 are exact in fp32; the model sums in float64 and rounds once, while
    the tensor core adds in its own order and precision, so compare with a tolerance of a few
    fp32 ulps of the largest partial sum.
    """
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    C = np.zeros((16, 8))
    for lane in range(32):
        for reg in range(4):
            for half in range(2):
                A[a_coords(lane, reg, half)] = _f16(a[lane][reg], half)
            C[c_coords(lane, reg)] = float(c[lane][reg])
        for reg in range(2):
            for half in range(2):
                B[b_coords(lane, reg, half)] = _f16(b[lane][reg], half)
    D = (A @ B + C).astype(np.float32)
    return np.array([[D[c_coords(lane, reg)] for reg in range(4)] for lane in range(32)],
                    dtype=np.float32)


def ldmatrix_x4_warp(rows, trans=False) -> np.ndarray:
    """Whole-warp model: rows (32, 8) uint16, the 16 bytes lane i's address points at
    (lanes 8j..8j+7 give rows 0-7 of matrix j) -> registers (32, 4) uint32.

    Without .trans lane l's register j holds matrix j's row l // 4, columns 2(l % 4) and
    2(l % 4) + 1; with .trans it holds column l // 4, rows 2(l % 4) and 2(l % 4) + 1.
    """
    rows = np.asarray(rows, dtype=np.uint16).reshape(32, 8)
    out = np.zeros((32, 4), dtype=np.uint32)
    for j in range(4):
        m = rows[8 * j: 8 * j + 8]          # (8, 8) matrix j
        if trans:
            m = m.T
        for lane in range(32):
            r, c = divmod(lane, 4)
            out[lane, j] = int(m[r, 2 * c]) | (int(m[r, 2 * c + 1]) << 16)
    return out


def _ldmatrix_lane(addr, trans):
    addrs = _sim.warp_exchange(int(addr))
    assert len(addrs) == 32, "ldmatrix needs a full warp"
    for a in addrs:
        assert a % 16 == 0, "ldmatrix rows must be 16-byte aligned"
    rows = [_sim.shared_bytes(a, 16).view(np.uint16).copy() for a in addrs]
    regs = ldmatrix_x4_warp(rows, trans)[_sim.lane_id()]
    return tuple(np.uint32(r) for r in regs)


@ptx("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];",
     out=("u32",) * 4, args=("u32",), effect="load")
def ldmatrix_x4(addr):
    """`ldmatrix.sync.aligned.m8n8.x4.shared.b16 {r0, r1, r2, r3}, [addr];` -- four 8x8 fp16
    matrices from shared memory into mma fragments, one instruction per warp.

    addr: this lane's row (16 bytes, 16-byte aligned) as a shared address; lanes 8j..8j+7 name
    the 8 rows of matrix j.  See the module doc for the A and B tile addressing.
    """
    return _ldmatrix_lane(addr, False)


@ptx("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];",
     out=("u32",) * 4, args=("u32",), effect="load")
def ldmatrix_x4_trans(addr):
    """`ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {r0..r3}, [addr];` -- same, transposed:
    B fragments straight from a K-major (row-major K x N) tile."""
    return _ldmatrix_lane(addr, True)


@ptx("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};",
     out=("f32",) * 4, args=("u32",) * 6 + ("f32",) * 4)
def mma_sync_m16n8k16_f16_f32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """`mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0..d3}, {a0..a3}, {b0, b1}, {c0..c3};`

    D = A @ B + C for a 16x16 fp16 A, 16x8 fp16 B, fp32 C/D; fragments as in the module doc.
    Returns (d0, d1, d2, d3).  Pure (no memory), but warp-collective: call it with all 32
    lanes converged.
    """
    mine = ((a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3))
    lanes = _sim.warp_exchange(mine)
    assert len(lanes) == 32, "mma.sync needs a full warp"
    d = mma_m16n8k16_f16_f32_warp([x[0] for x in lanes], [x[1] for x in lanes],
                                  [x[2] for x in lanes])[_sim.lane_id()]
    return tuple(np.float32(v) for v in d)


@ptx("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};",
     out=("s32",) * 4, args=("u32",) * 6 + ("s32",) * 4)
def mma_sync_m16n8k32_s8_s32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """`mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {d0..d3}, {a0..a3}, {b0, b1}, {c0..c3};`

    D = A @ B + C for a 16x32 A and a 32x8 B of signed bytes, s32 C/D: exact integer sums
    (wrapping past 2^31); fragments as in the module doc.  Returns (d0, d1, d2, d3).
    Warp-collective, as the fp16 form."""
    mine = ((a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3))
    lanes = _sim.warp_exchange(mine)
    assert len(lanes) == 32, "mma.sync needs a full warp"
    d = mma_m16n8k32_s8_s32_warp([x[0] for x in lanes], [x[1] for x in lanes],
                                 [x[2] for x in lanes])[_sim.lane_id()]
    return tuple(np.int32(v) for v in d)
