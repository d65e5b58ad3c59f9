"""cp.async (nq/ptx/async_copy.py): the twins land a group's bytes only at the wait that retires
it, and the wrappers compile inline for sm_90."""
import numpy as np
import pytest
from numba import cuda

import nq.ptx as P
from nq.ptx import _sim
from nq.ptx.async_copy import pending_groups
from ptx_util import assert_no_local_memory, assert_uses, compile_ptx_sm90, count


def test_copies_land_at_the_wait_that_retires_their_group():
    src = np.arange(64, dtype=np.uint32)                  # 256 bytes of global memory
    smem = np.zeros(32, dtype=np.uint32)                  # 128 bytes of "shared" memory
    base = int(_sim.shared_address(smem))
    cp, commit, wait = (P.cp_async_cg_shared_global_16.twin, P.cp_async_commit_group.twin,
                        P.cp_async_wait_group.twin)
    wait(0)                                               # nothing left from another test
    cp(base, src, 0)                                      # group 1: words 0-3 -> smem 0-3
    cp(base + 16, src, 8)                                 #          words 8-11 -> smem 4-7
    commit()
    cp(base + 32, src, 60)                                # group 2: words 60-63 -> smem 8-11
    commit()
    commit()                                              # group 3: empty
    assert pending_groups() == 3 and not smem.any()       # issued, nothing landed yet
    wait(2)                                               # the oldest group only
    assert smem[:8].tolist() == [0, 1, 2, 3, 8, 9, 10, 11] and not smem[8:].any()
    wait(1)
    assert smem[8:12].tolist() == [60, 61, 62, 63] and pending_groups() == 1
    wait(0)
    assert pending_groups() == 0


def test_copy_twin_refuses_what_the_gpu_would_fault_on():
    src = np.zeros(64, dtype=np.uint32)
    smem = np.zeros(32, dtype=np.uint32)
    base = int(_sim.shared_address(smem))
    with pytest.raises(AssertionError, match="16-byte aligned"):
        P.cp_async_cg_shared_global_16.twin(base + 8, src, 0)
    with pytest.raises(AssertionError, match="misaligned"):
        P.cp_async_cg_shared_global_16.twin(base, src, 2)


def async_copy_set(w, out):
    tile = cuda.shared.array(256, dtype=np.uint32, alignment=16)
    base = P.cvta_to_shared_u32(tile)
    i = cuda.threadIdx.x
    P.cp_async_cg_shared_global_16(base + 16 * i, w, 4 * i)
    P.cp_async_commit_group()
    P.cp_async_cg_shared_global_16(base + 512 + 16 * i, w, 128 + 4 * i)
    P.cp_async_commit_group()
    P.cp_async_wait_group(1)
    cuda.syncthreads()
    a, b, c, d = P.ld_shared_v4_u32_at(base + 16 * (31 - i))
    P.cp_async_wait_group(0)
    cuda.syncthreads()
    e, f, g, h = P.ld_shared_v4_u32_at(base + 512 + 16 * i)
    out[i] = a + b + c + d + e + f + g + h


def async_copy_ptx():
    return compile_ptx_sm90(async_copy_set, "void(uint32[::1], uint32[::1])")


@pytest.mark.skipif(P.SIMULATOR, reason="the simulator compiles nothing")
def test_async_copy_wrappers_compile_inline():
    ptx = async_copy_ptx()
    assert_uses(ptx, "cp.async.cg.shared.global", "cp.async.commit_group", "cp.async.wait_group")
    assert count(ptx, "cp.async.cg.shared.global") == 2
    assert "cp.async.wait_group 1;" in ptx and "cp.async.wait_group 0;" in ptx
    assert count(ptx, "call") == 0
    assert_no_local_memory(ptx)
