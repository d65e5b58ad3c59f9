"""CPU tier for nq/ptx/tensormap.py: the tensor map's rules, the twin's box gather against NumPy
indexing of the KV pool, and the 128-byte swizzle's promise (an ldmatrix phase's 8 rows in 8
bank groups).  The hardware's copy is compared with the same model in test_tensormap_gpu.py."""
import numpy as np
import pytest

from nq.kernels.attention import plan
from nq.paged import PAGE
from nq.ptx.tensormap import (SWIZZLE_128B, TensorMapSpec, box_bytes, cp_async_bulk_tensor_5d_g2s,
                              swizzle_128b)

from ptx_util import compile_ptx_sm90


def test_spec_refuses_what_the_driver_would():
    with pytest.raises(ValueError, match="multiples of 16"):
        TensorMapSpec(dims=(64, 4), strides=(24,), box=(64, 4))
    with pytest.raises(ValueError, match="at most 128 bytes"):
        TensorMapSpec(dims=(128, 4), strides=(256,), box=(128, 4), swizzle=SWIZZLE_128B)
    with pytest.raises(ValueError, match="rank 1..5"):
        TensorMapSpec(dims=(64, 4), strides=(), box=(64, 4))
    with pytest.raises(ValueError, match="l2_promotion"):
        TensorMapSpec(dims=(64, 4), strides=(128,), box=(64, 4), l2_promotion=32)
    with pytest.raises(ValueError, match="inner side"):
        TensorMapSpec(dims=(64, 4), strides=(128,), box=(4, 4))


@pytest.mark.parametrize("d", [64, 128])
def test_box_of_a_half_page_is_the_pool_page_in_slot_order(d):
    rng = np.random.default_rng(d)
    n_pages, n_kv = 5, 3
    pool = rng.standard_normal((n_pages, n_kv, 2, PAGE, d)).astype(np.float16)
    spec = plan.tma_spec(pool.shape)
    pid, kvh = 3, 2
    slot = np.zeros(plan.tma_slot_bytes(d) // 2, np.float16)
    for hf in range(d // 64):
        got = box_bytes(pool, spec, (0, hf, 0, 0, pid * n_kv + kvh)).view(np.float16)
        assert len(got) * 2 == plan.TMA_HALF_BYTES
        slot[hf * len(got):(hf + 1) * len(got)] = got
    # half h's 4 KB: K token rows 0-15, then V rows 16-31, one 128-byte row each (before the
    # swizzle, which only permutes 16-byte chunks inside a row)
    rows = slot.reshape(d // 64, 2, PAGE, 64)
    for hf in range(d // 64):
        np.testing.assert_array_equal(rows[hf], pool[pid, kvh, :, :, 64 * hf:64 * hf + 64])


def test_box_out_of_bounds_is_zero():
    src = np.arange(64 * 4, dtype=np.float16).reshape(4, 64)
    spec = TensorMapSpec(dims=(64, 4, 1, 1, 1), strides=(128, 512, 512, 512), box=(64, 2, 1, 1, 1))
    got = box_bytes(src, spec, (0, 3, 0, 0, 0)).view(np.float16)
    np.testing.assert_array_equal(got[:64], src[3])
    assert not got[64:].any()


def test_swizzle_puts_an_ldmatrix_phase_in_eight_bank_groups():
    # 8 consecutive 128-byte rows read at the same logical 16-byte chunk c
    for c in range(8):
        offs = swizzle_128b(np.arange(8) * 128 + 16 * c)
        assert len({(o % 128) // 16 for o in offs}) == 8
    # a permutation inside each 128-byte row, the identity on row 0
    o = np.arange(0, 1024, 16)
    assert sorted(swizzle_128b(o)) == list(o)
    assert list(swizzle_128b(np.arange(0, 128, 16))) == list(range(0, 128, 16))


def tensor_copy_ptx():
    """The tensor-copy wrapper compiled alone (also used by test_ptx_compile's coverage check)."""
    def k(tmap, x):
        cp_async_bulk_tensor_5d_g2s(x[0], tmap, 0, 1, 2, 3, x[1], x[2])
    return compile_ptx_sm90(k, "void(uint64[::1], uint32[::1])")


def test_tensor_copy_ptx():
    ptx = tensor_copy_ptx()
    assert ("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
            in ptx)
