"""nq.ptx.wgmma.wgmma_wait_group_acc_a without a GPU: the wait that also ties the register A
fragments of the groups it retires (prefill_wgmma's overlap loop).  Its twin does nothing (the
simulator's wgmmas ran at once); what it must do is emit the one wait, carry both arrays in
registers (no local memory) and refuse arrays of the wrong type."""
import numpy as np
import pytest

from nq.ptx import wgmma as G

ptx_util = pytest.importorskip("ptx_util")


def test_twin_does_nothing_and_is_cached():
    wait = G.wgmma_wait_group_acc_a(64, 32)
    assert wait is G.wgmma_wait_group_acc_a(64, 32)
    acc, a = np.ones(64, np.float32), np.arange(32, dtype=np.uint32)
    assert wait.twin(acc, a, 0) is None
    assert (acc == 1).all() and (a == np.arange(32)).all()


def _probe(wait_a):
    from numba import cuda
    from numba.cuda.types import float32, uint32, uint64
    mma = G.wgmma_rs(64)
    fence = G.wgmma_fence_acc(32)
    zero = G.wgmma_zero_acc(32)
    commit = G.wgmma_commit_group

    def probe(regs, d, desc):
        acc = cuda.local.array(32, float32)
        pf = cuda.local.array(4, uint32)
        tid = cuda.threadIdx.x
        for j in range(4):
            pf[j] = regs[tid, j]
        zero(acc)
        fence(acc)
        mma(acc, pf[0], pf[1], pf[2], pf[3], uint64(desc[0]), 0)
        commit()
        wait_a(acc, pf, 0)
        for j in range(4):
            pf[j] = pf[j] ^ uint32(1)
        for j in range(32):
            d[tid, j] = acc[j] + float32(pf[j % 4])
    return probe


@pytest.mark.skipif(__import__("nq.ptx").ptx.SIMULATOR, reason="the simulator compiles nothing")
def test_wait_a_emits_one_wait_and_keeps_registers():
    ptx = ptx_util.compile_ptx_sm90(_probe(G.wgmma_wait_group_acc_a(32, 4)),
                                    "void(uint32[:, ::1], float32[:, ::1], uint64[::1])",
                                    cc=ptx_util.SM90A, launch_bounds=(128,))
    assert ptx_util.count(ptx, "wgmma.wait_group.sync.aligned") == 1
    assert "wgmma.wait_group.sync.aligned 0;" in ptx
    ptx_util.assert_no_local_memory(ptx)


@pytest.mark.skipif(__import__("nq.ptx").ptx.SIMULATOR, reason="the simulator compiles nothing")
def test_wait_a_refuses_float_fragments():
    from numba.core.errors import TypingError
    wait_a = G.wgmma_wait_group_acc_a(32, 4)
    from numba import cuda
    from numba.cuda.types import float32

    def bad(d):
        acc = cuda.local.array(32, float32)
        pf = cuda.local.array(4, float32)
        wait_a(acc, pf, 0)
        d[0] = acc[0] + pf[0]
    with pytest.raises(TypingError, match="uint32"):
        ptx_util.compile_ptx_sm90(bad, "void(float32[::1])", cc=ptx_util.SM90A)
