"""Page allocator, block tables, reserve-ahead and the NumPy paging models (CPU)."""
import numpy as np
import pytest

from nq.config import PRESETS, tiny_config
from nq.paged import PAGE, gather_kv, page_slice_bytes, pages_for, pool_bytes, pool_shape, write_token
from nq.runtime.kv_cache import KVCacheFull, PageAllocator, Sequence, release, reserve


def test_pages_for():
    assert [pages_for(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


def test_alloc_free_and_refusal():
    a = PageAllocator(4)
    p = a.alloc(3)
    assert sorted(p) == [0, 1, 2] and a.n_free == 1 and a.n_used == 3
    with pytest.raises(KVCacheFull, match=r"KV cache full: 3 pages of 16 tokens in use.*raise -c"):
        a.alloc(2)
    assert a.n_free == 1  # a refused request takes nothing
    a.free(p[:2])
    assert a.n_free == 3
    with pytest.raises(ValueError, match="double free"):
        a.free([p[0]])
    assert len(set(a.alloc(3))) == 3


def test_reserve_ahead_and_release():
    a = PageAllocator(10)
    s = Sequence(max_pages=8)
    reserve(a, s, 1)
    assert len(s.pages) == 1 and s.capacity == PAGE and s.dirty
    s.dirty = False
    reserve(a, s, 16)  # still fits: no allocation, table untouched
    assert len(s.pages) == 1 and not s.dirty
    reserve(a, s, 40)
    assert len(s.pages) == 3 and s.dirty
    assert list(s.table[:3]) == s.pages and not s.table[3:].any()
    assert s.slot(33) == (s.pages[2], 1)
    with pytest.raises(KVCacheFull, match="block table holds 8"):
        reserve(a, s, 8 * PAGE + 1)
    release(a, s)
    assert a.n_free == 10 and s.pages == [] and not s.table.any()


def test_pool_layout_sizes():
    cfg = PRESETS["7b"]
    assert pool_shape(cfg, 10) == (28, 10, 4, 2, 16, 128)
    assert page_slice_bytes(cfg) == 8192 and page_slice_bytes(tiny_config()) == 4096
    assert page_slice_bytes(cfg) % 128 == 0
    assert pool_bytes(cfg, 1) == 28 * 4 * 8192


def test_write_then_gather_scattered_pages():
    cfg = tiny_config()
    rng = np.random.default_rng(0)
    n_pages, length = 12, 37
    pool = np.zeros(pool_shape(cfg, n_pages)[1:], np.float16)  # one layer
    table = rng.permutation(n_pages).astype(np.int32)
    k = rng.standard_normal((length, cfg.num_kv_heads, cfg.head_dim)).astype(np.float16)
    v = rng.standard_normal((length, cfg.num_kv_heads, cfg.head_dim)).astype(np.float16)
    for pos in range(length):
        write_token(pool, table, pos, k[pos], v[pos])
    kk, vv = gather_kv(pool, table, length)
    np.testing.assert_array_equal(kk, k)
    np.testing.assert_array_equal(vv, v)


def test_check_paged_args_names_the_caller_and_the_fault():
    from nq.config import tiny_config
    from nq.paged import check_paged_args, pool_shape
    cfg = tiny_config()
    kv = np.zeros(pool_shape(cfg, 3)[1:], np.float16)
    ok = np.zeros(4, np.int32)
    check_paged_args("rope_kv", cfg, kv, ok, ok)
    with pytest.raises(ValueError, match=r"attention: kv_layer is float32"):
        check_paged_args("attention", cfg, kv.astype(np.float32), ok, ok)
    with pytest.raises(ValueError, match=r"rope_kv: table and state must be int32"):
        check_paged_args("rope_kv", cfg, kv, ok.astype(np.int64), ok)
