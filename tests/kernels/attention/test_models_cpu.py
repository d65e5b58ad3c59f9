"""CPU tier for decode attention's plan and NumPy models (nq/kernels/attention/plan.py and
reference.py): the split plan covers the context, split + combine equals softmax attention,
the tensor-core fragment mapping gives q K^T, and the shared-memory layout's promises."""
import numpy as np
import pytest

from nq.config import PRESETS
from nq.kernels.attention import plan, reference
from nq.paged import PAGE


@pytest.mark.parametrize("length", [1, 15, 16, 17, 49, 1000, 9000, 40000])
@pytest.mark.parametrize("max_splits", [1, 66])
@pytest.mark.parametrize("min_pps", [1, 2])
def test_split_plan_covers_context(length, max_splits, min_pps):
    pps, n = plan.split_plan(length, max_splits, min_pps)
    n_pages = -(-length // PAGE)
    assert n <= max_splits and pps >= min_pps
    assert (n - 1) * pps < n_pages <= n * pps  # every split has at least one page, none missed


@pytest.mark.parametrize("length", [1, 17, 100, 1000, 5000])
@pytest.mark.parametrize("gqa,d", [(7, 128), (2, 64)])
def test_split_combine_model_equals_softmax_attention(length, gqa, d):
    rng = np.random.default_rng(length)
    hkv = 2
    q = rng.standard_normal((hkv * gqa, d))
    k = rng.standard_normal((length, hkv, d)).astype(np.float16)
    v = rng.standard_normal((length, hkv, d)).astype(np.float16)
    ref = reference.attention_reference(q, k, v)
    got = reference.split_combine_model(q, k, v, max_splits=8)
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)


def test_reference_matches_nq_ref():
    from nq.ref import attention
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 8, 64)).astype(np.float32)
    k = rng.standard_normal((20, 2, 64)).astype(np.float32)
    v = rng.standard_normal((20, 2, 64)).astype(np.float32)
    want = attention(q, k, v, [19])[0]
    np.testing.assert_allclose(reference.attention_reference(q[0], k, v), want, rtol=1e-4, atol=1e-5)


def test_q_hi_lo_split_is_fp32_accurate():
    x = (np.random.default_rng(0).standard_normal(4096) * 3).astype(np.float32)
    hi, lo = reference.split_q_hi_lo(x)
    err = np.abs(hi.astype(np.float64) + lo.astype(np.float64) - x)
    assert (err <= np.abs(x) * 2.0 ** -21 + 2.0 ** -25).all()  # 22 bits kept; lo's subnormal floor


@pytest.mark.parametrize("gqa,d", [(7, 128), (8, 64), (1, 64), (3, 128)])
def test_page_scores_model_is_q_dot_k(gqa, d):
    """The kernel's fragment mapping (q hi/lo rows, ldmatrix lane rows, c0 + c2) on the warp
    models gives q K^T to ~fp32 accuracy (a plain fp16 q would be off by ~1e-3 relative)."""
    rng = np.random.default_rng(gqa * d)
    q = (rng.standard_normal((gqa, d)) * 0.3).astype(np.float32)
    k = rng.standard_normal((PAGE, d)).astype(np.float16)
    want = q.astype(np.float64) @ k.astype(np.float64).T
    got = reference.page_scores_model(q, k)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(q).sum(axis=1).max())


@pytest.mark.parametrize("d", [64, 128])
def test_padded_rows_make_ldmatrix_conflict_free(d):
    """8 consecutive token rows at one column (one ldmatrix phase) fall in 8 distinct 16-byte
    bank groups at rows_per_copy=1; 2**k rows per copy give a 2**k-way conflict."""
    for rpc, ways in ((1, 1), (2, 2), (4, 4), (32, 8)):
        for r0 in (0, 8, 16, 24):
            groups = [(plan.row_offset(r, d, rpc) // 16) % 8 for r in range(r0, r0 + 8)]
            assert 8 // len(set(groups)) == ways
        assert all(plan.row_offset(r, d, rpc) % 16 == 0 for r in range(2 * PAGE))


@pytest.mark.parametrize("d", [64, 128])
def test_merge_scratch_fits_a_page_slot(d):
    """With several consumers, each leaves (acc, m, l) of 8 heads in its own page slot."""
    for rpc in (1, 32):
        assert (8 * d + 16) * 4 <= plan.page_slot_bytes(d, rpc)


def test_defaults_for_the_7b():
    cfg = PRESETS["7b"]
    assert plan.default_max_splits(cfg.num_kv_heads) == 66  # 264 CTAs: two per SM
    # 3 stages x 1 page x 8320 B (K and V, a 16-byte pad after every 4 rows): under 48 KiB
    assert plan.smem_bytes(cfg.head_dim) == 3 * 8320 + plan.ALIGN < 48 * 1024
