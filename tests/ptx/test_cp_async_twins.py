"""The cp.async twins (nq/ptx/async_copy.py): the copy and its zero fill, and the alignment the
GPU would fault on.  test_cp_async_gpu.py holds the instruction to the same behaviour."""
import numpy as np
import pytest

import nq.ptx as P


def test_copy_and_zero_fill():
    tile = np.full(16, 0xDEADBEEF, dtype=np.uint32)
    src = np.arange(32, dtype=np.uint32) + np.uint32(100)
    dst = int(P.cvta_to_shared_u32.twin(tile))
    P.cp_async_cg_shared_global_16_zfill.twin(dst, src, 8, 16)         # words 8..11
    P.cp_async_cg_shared_global_16_zfill.twin(dst + 16, src, 4, 0)     # nothing read: zeros
    P.cp_async_cg_shared_global_16_zfill.twin(dst + 32, src, 0, 8)     # 8 bytes, then 8 zero bytes
    P.cp_async_commit_group.twin()
    P.cp_async_wait_group.twin(0)
    np.testing.assert_array_equal(tile[:4], src[8:12])
    np.testing.assert_array_equal(tile[4:8], 0)
    np.testing.assert_array_equal(tile[8:12], [100, 101, 0, 0])
    assert (tile[12:] == 0xDEADBEEF).all()          # nothing else touched


def test_nd_source_index():
    pool = np.arange(2 * 3 * 16, dtype=np.float16).reshape(2, 3, 16)
    tile = np.zeros(8, dtype=np.float16)
    P.cp_async_cg_shared_global_16_zfill.twin(P.cvta_to_shared_u32.twin(tile), pool, (1, 2, 8), 16)
    assert not tile.any()                           # in flight: lands at the wait, not before
    P.cp_async_commit_group.twin()
    P.cp_async_wait_group.twin(0)
    np.testing.assert_array_equal(tile, pool[1, 2, 8:])


def test_rejects_what_the_gpu_would_fault_on():
    tile, src = np.zeros(16, dtype=np.uint32), np.zeros(32, dtype=np.uint32)
    dst = int(P.cvta_to_shared_u32.twin(tile))
    with pytest.raises(AssertionError, match="16-byte aligned dst"):
        P.cp_async_cg_shared_global_16_zfill.twin(dst + 4, src, 0, 16)
    with pytest.raises(AssertionError, match="misaligned"):
        P.cp_async_cg_shared_global_16_zfill.twin(dst, src, 1, 16)


def test_byte_offset_form_reads_what_the_index_form_reads():
    pool = np.arange(2 * 3 * 16, dtype=np.float16).reshape(2, 3, 16)
    a, b = np.zeros(8, dtype=np.float16), np.zeros(8, dtype=np.float16)
    P.cp_async_cg_shared_global_16_zfill.twin(P.cvta_to_shared_u32.twin(a), pool, (1, 2, 8), 16)
    off = 2 * ((1 * 3 + 2) * 16 + 8)                # the same element, in bytes
    P.cp_async_cg_shared_global_16_zfill_off.twin(P.cvta_to_shared_u32.twin(b), pool, off, 16)
    assert not b.any()                              # lands at the wait, as the indexed form
    P.cp_async_commit_group.twin()
    P.cp_async_wait_group.twin(0)
    np.testing.assert_array_equal(a, b)
    c = np.full(8, 7, dtype=np.float16)
    P.cp_async_cg_shared_global_16_zfill_off.twin(P.cvta_to_shared_u32.twin(c), pool, 10 ** 6, 0)
    P.cp_async_commit_group.twin()
    P.cp_async_wait_group.twin(0)
    assert not c.any()                              # src_bytes 0: zeros, nothing read
    with pytest.raises(AssertionError, match="misaligned"):
        P.cp_async_cg_shared_global_16_zfill_off.twin(P.cvta_to_shared_u32.twin(c), pool, 8, 16)
    with pytest.raises(AssertionError, match="past the array"):
        P.cp_async_cg_shared_global_16_zfill_off.twin(P.cvta_to_shared_u32.twin(c), pool, pool.nbytes, 16)
