"""The Python twins of nq.ptx that act as a warp or a grid -- ldmatrix and mma fragments, the
warp exchange under the simulator, the cycle counter, the grid barrier's counters -- checked
against hand-worked cases and independent models (test_ptx_twins.py has the per-thread ones).
"""
import numpy as np
import pytest

import nq.ptx as P
from nq.ptx.mma import ldmatrix_x4_warp, mma_m16n8k16_f16_f32_warp, mma_m16n8k32_s8_s32_warp

RNG = np.random.default_rng(1234)


# ---- ldmatrix and mma fragments --------------------------------------------------------------


def pack2(lo, hi):
    return int(np.array([lo, hi], dtype=np.float16).view("<u4")[0])


def a_fragments(A):
    """A 16x16 -> (32, 4) uint32, written out from the PTX ISA's figure for m16n8k16 .row."""
    out = np.zeros((32, 4), dtype=np.uint32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        out[lane] = [pack2(A[g, 2 * t], A[g, 2 * t + 1]),
                     pack2(A[g + 8, 2 * t], A[g + 8, 2 * t + 1]),
                     pack2(A[g, 2 * t + 8], A[g, 2 * t + 9]),
                     pack2(A[g + 8, 2 * t + 8], A[g + 8, 2 * t + 9])]
    return out


def b_fragments(B):
    """B 16x8 (K x N) -> (32, 2) uint32 (.col operand)."""
    out = np.zeros((32, 2), dtype=np.uint32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        out[lane] = [pack2(B[2 * t, g], B[2 * t + 1, g]), pack2(B[2 * t + 8, g], B[2 * t + 9, g])]
    return out


def c_fragments(C):
    out = np.zeros((32, 4), dtype=np.float32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        out[lane] = [C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]]
    return out


def test_mma_warp_model_is_a_matmul():
    A = RNG.standard_normal((16, 16)).astype(np.float16)
    B = RNG.standard_normal((16, 8)).astype(np.float16)
    C = RNG.standard_normal((16, 8)).astype(np.float32)
    d = mma_m16n8k16_f16_f32_warp(a_fragments(A), b_fragments(B), c_fragments(C))
    want = A.astype(np.float64) @ B.astype(np.float64) + C
    np.testing.assert_allclose(d, c_fragments(want), rtol=1e-6, atol=1e-6)
    # a single nonzero in A and B lands exactly where D[row, col] says
    A, B = np.zeros((16, 16), np.float16), np.zeros((16, 8), np.float16)
    A[13, 9], B[9, 6] = 3.0, -2.0
    d = mma_m16n8k16_f16_f32_warp(a_fragments(A), b_fragments(B), np.zeros((32, 4), np.float32))
    lane, reg = 4 * (13 - 8) + 6 // 2, 2 + 6 % 2
    assert d[lane, reg] == -6.0 and np.count_nonzero(d) == 1


def pack4(v):
    return int(np.array(v, np.int8).view(np.uint32)[0])


def s8_fragments(A, B):
    """A 16x32 and B 32x8 int8 -> (32, 4) and (32, 2) uint32, written out from the PTX ISA's
    figure for m16n8k32 .s8 (four consecutive k a register)."""
    a, b = np.zeros((32, 4), np.uint32), np.zeros((32, 2), np.uint32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        a[lane] = [pack4(A[g, 4 * t:4 * t + 4]), pack4(A[g + 8, 4 * t:4 * t + 4]),
                   pack4(A[g, 16 + 4 * t:20 + 4 * t]), pack4(A[g + 8, 16 + 4 * t:20 + 4 * t])]
        b[lane] = [pack4(B[4 * t:4 * t + 4, g]), pack4(B[16 + 4 * t:20 + 4 * t, g])]
    return a, b


def test_mma_s8_warp_model_is_an_exact_matmul():
    A = RNG.integers(-128, 128, (16, 32)).astype(np.int8)
    B = RNG.integers(-128, 128, (32, 8)).astype(np.int8)
    C = RNG.integers(-2**20, 2**20, (16, 8)).astype(np.int64)
    a, b = s8_fragments(A, B)
    d = mma_m16n8k32_s8_s32_warp(a, b, c_fragments(C).astype(np.int32))
    want = A.astype(np.int64) @ B.astype(np.int64) + C
    np.testing.assert_array_equal(d, c_fragments(want).astype(np.int32))
    # a single nonzero in A and B lands exactly where D[row, col] says; sums wrap as int32
    A, B = np.zeros((16, 32), np.int8), np.zeros((32, 8), np.int8)
    A[13, 21], B[21, 6] = -3, 127
    a, b = s8_fragments(A, B)
    d = mma_m16n8k32_s8_s32_warp(a, b, np.full((32, 4), 2**31 - 1, np.int32))
    lane, reg = 4 * (13 - 8) + 6 // 2, 2 + 6 % 2
    assert d[lane, reg] == 2**31 - 1 - 381 and (d == 2**31 - 1).sum() == 127


def test_cvt_rni_twin_rounds_ties_to_even():
    got = [int(P.cvt_rni_s32_f32.twin(np.float32(v))) for v in
           (2.5, 3.5, -2.5, -0.5, 1e10, -1e10, float("nan"), 4194303.75, float("inf"),
            float("-inf"))]
    assert got == [2, 4, -2, 0, 2**31 - 1, -2**31, 0, 4194304, 2**31 - 1, -2**31]


def rows_for(tile, lane_rc):
    """The 8 fp16 (as uint16) that each lane's ldmatrix address points at: lane_rc(i) -> (r, c)."""
    u = tile.view(np.uint16)
    return np.array([u[r, c:c + 8] for r, c in (lane_rc(i) for i in range(32))])


def test_ldmatrix_a_tile_gives_mma_a_fragments():
    A = RNG.standard_normal((16, 16)).astype(np.float16)
    regs = ldmatrix_x4_warp(rows_for(A, lambda i: (i % 16, 8 * (i // 16))))
    np.testing.assert_array_equal(regs, a_fragments(A))


def test_ldmatrix_b_tiles_give_mma_b_fragments():
    B = RNG.standard_normal((16, 16)).astype(np.float16)  # K x N, two n-blocks of 8
    # stored N-major (Bt[n, k]), no transpose
    regs = ldmatrix_x4_warp(rows_for(np.ascontiguousarray(B.T),
                                     lambda i: ((i % 8) + 8 * (i // 16), 8 * ((i // 8) % 2))))
    np.testing.assert_array_equal(regs[:, 0:2], b_fragments(B[:, 0:8]))
    np.testing.assert_array_equal(regs[:, 2:4], b_fragments(B[:, 8:16]))
    # stored K-major (B[k, n]) with .trans: lane i addresses B row (i % 8) + 8 * ((i // 8) % 2)
    # at column 8 * (i // 16)
    regs = ldmatrix_x4_warp(rows_for(B, lambda i: ((i % 8) + 8 * ((i // 8) % 2), 8 * (i // 16))),
                            trans=True)
    np.testing.assert_array_equal(regs[:, 0:2], b_fragments(B[:, 0:8]))
    np.testing.assert_array_equal(regs[:, 2:4], b_fragments(B[:, 8:16]))


def test_warp_twins_refuse_to_run_outside_a_simulated_kernel():
    with pytest.raises(RuntimeError, match="inside a simulated kernel"):
        P.mma_sync_m16n8k16_f16_f32.twin(0, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0)


def test_clock64_twin_counts_up():
    from nq.ptx import clock64
    a = clock64.twin()
    b = clock64.twin()
    assert isinstance(a, int) and b >= a


def test_warp_exchange_survives_a_recycled_block_manager(monkeypatch):
    """Launch after launch with alternating partial warps (8 and 16 live lanes): each launch's
    rendezvous must be sized for its own block.  Keyed by id(manager), a freed manager's id came
    back for the next launch and its 16 lanes met a barrier sized for 8, which never opened."""
    import threading

    from nq.ptx import _sim

    monkeypatch.setattr(_sim, "WARP_TIMEOUT_S", 5.0)

    class Manager:
        def __init__(self, nthreads):
            self._block_dim = (nthreads, 1, 1)

    def launch(nthreads):
        manager, got, errors = Manager(nthreads), {}, []

        def lane(tid):
            t = threading.current_thread()
            t.thread_id, t._manager, t.blockIdx = tid, manager, (0, 0, 0)
            try:
                got[tid] = _sim.warp_exchange(tid)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=lane, args=(i,)) for i in range(nthreads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for tid in range(32, nthreads):
            assert got[tid] == list(range(32, nthreads))

    for i in range(12):
        launch(40 if i % 2 == 0 else 48)


def test_gridsync_twins_count_publish_and_read():
    # the twins of a grid barrier (gridsync.py's doc): the add returns the value before,
    # acquire reads what release wrote, the L2 load reads 16 bytes in memory order
    from nq.ptx import (atom_add_acq_rel_gpu_u32, ld_acquire_gpu_u32, ld_global_cg_v4_u32,
                        red_release_gpu_add_u32, st_release_gpu_u32)
    flag = np.zeros(2, np.uint32)
    olds = [int(atom_add_acq_rel_gpu_u32.twin(flag, 0, 1)) for _ in range(5)]
    assert olds == [0, 1, 2, 3, 4] and flag[0] == 5
    flag[0] = 0xFFFFFFFF
    assert atom_add_acq_rel_gpu_u32.twin(flag, 0, 2) == 0xFFFFFFFF and flag[0] == 1   # wraps
    assert red_release_gpu_add_u32.twin(flag, 0, 3) is None and flag[0] == 4   # adds, returns nothing
    st_release_gpu_u32.twin(flag, 1, 7)
    assert ld_acquire_gpu_u32.twin(flag, 1) == 7
    data = np.arange(8, dtype=np.uint32)
    assert [int(v) for v in ld_global_cg_v4_u32.twin(data, 4)] == [4, 5, 6, 7]
    from nq.ptx import red_relaxed_gpu_add_u64
    acc = np.zeros(4, np.uint32)   # one int64 as two words at 2, 3: carries, and adding -1
    red_relaxed_gpu_add_u64.twin(acc, 2, np.uint64(2**32 + 5))
    assert red_relaxed_gpu_add_u64.twin(acc, 2, np.uint64(2**64 - 1)) is None
    assert acc.tolist() == [0, 0, 4, 1]
