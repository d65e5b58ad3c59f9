"""Paged-attention decode (nq/kernels/attention) on the GPU against the float64 reference from
the same fp16 K/V.

Tolerance, rtol 2e-3 / atol 1e-3: o is rounded to fp16 (half an ulp = 2.4e-4 relative near 1);
scores are ~fp32 (q split hi + lo in fp16, K exact, fp32 accumulation) and so are the weights (P
split hi + lo in fp16, ~2^-22 relative; P in fp16 alone would allow up to 9.8e-4 x max|v|), so
what is left is fp32 accumulation over up to 9000 tokens, ex2.approx and o's own rounding.
|o| <= max|v| ~ 4 here, so the tolerance is ~4x the fp16 rounding and far below what a wrong
tail, page, split or merge (errors of order 1e-1) would produce.
"""
import numpy as np
import pytest

from nq.config import PRESETS, tiny_config
from nq.kernels import attention
from nq.paged import PAGE, STATE_POS, gather_kv, pool_shape
from nq.runtime.kv_cache import make_state

pytestmark = pytest.mark.gpu

RTOL, ATOL = 2e-3, 1e-3
CFGS = {"7b": PRESETS["7b"], "tiny": tiny_config(),  # GQA 7:1 d128, GQA 2:1 d64
        "g8": tiny_config(head_dim=128, num_heads=8, num_kv_heads=1),   # GQA 8:1 d128
        "g1": tiny_config(head_dim=64, num_heads=4, num_kv_heads=4)}    # MHA d64


def _setup(cfg, length, seed, n_pages=None):
    from numba import cuda
    rng = np.random.default_rng(seed)
    need = -(-length // PAGE)
    n_pages = n_pages or need + 7
    # Every slot random, the tail of the last page too: a kernel reading past `length` is wrong.
    pool = (rng.standard_normal(pool_shape(cfg, n_pages)[1:]) * 1.0).astype(np.float16)
    table = np.zeros(need + 3, np.int32)
    table[:need] = rng.permutation(n_pages)[:need]  # scattered pages
    q = (rng.standard_normal(cfg.q_size) * 2.0).astype(np.float32)
    d = dict(kv=cuda.to_device(pool), table=cuda.to_device(table), q=cuda.to_device(q),
             state=make_state(pos=length - 1), o=cuda.device_array(cfg.q_size, np.float16))
    k, v = gather_kv(pool, table, length)
    ref = attention.attention_reference(q.reshape(cfg.num_heads, cfg.head_dim), k, v)
    return d, ref


def _poison_tail(d, length, value):
    """Overwrite the slots past `length` in the last page (K and V, every kv head) with value:
    NaN or inf there must not reach o (0 * NaN = NaN in the tensor core too)."""
    from numba import cuda
    need = -(-length // PAGE)
    pool, table = d["kv"].copy_to_host(), d["table"].copy_to_host()
    pool[table[need - 1], :, :, length - (need - 1) * PAGE:] = value
    d["kv"] = cuda.to_device(pool)


def _launcher(cfg, d, max_splits=None, **kw):
    pa, pm = attention.decode_workspace(cfg, max_splits)
    return attention.decode_launcher(cfg, d["q"], d["state"], d["table"], d["kv"], d["o"],
                                     pa, pm, **kw)


def _run(cfg, d, max_splits=None, **kw):
    _launcher(cfg, d, max_splits, **kw)()
    return d["o"].copy_to_host().astype(np.float64).reshape(cfg.num_heads, cfg.head_dim)


@pytest.mark.parametrize("length", [1, 15, 16, 17, 49, 1000, 9000])
@pytest.mark.parametrize("name", ["7b", "tiny"])
def test_attention_matches_reference(name, length):
    cfg = CFGS[name]
    d, ref = _setup(cfg, length, seed=length)
    np.testing.assert_allclose(_run(cfg, d), ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("length", [17, 49, 1000])
@pytest.mark.parametrize("stale", [np.nan, np.inf, 6e4], ids=["nan", "inf", "big"])
def test_stale_tail_is_ignored(length, stale):
    cfg = CFGS["7b"]
    d, ref = _setup(cfg, length, seed=length + 1)
    _poison_tail(d, length, stale)
    got = _run(cfg, d)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("length", [49, 1000, 3001])
def test_attention_single_split_many_stage_rounds(length):
    """max_splits=1: one CTA per kv head walks every page, wrapping the stages many times."""
    cfg = CFGS["7b"]
    d, ref = _setup(cfg, length, seed=7)
    np.testing.assert_allclose(_run(cfg, d, max_splits=1), ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("length", [17, 49, 1000, 9000])
@pytest.mark.parametrize("kw", [dict(consumers=1), dict(consumers=4), dict(consumers=4, nstage=2),
                                dict(nstage=2), dict(consumers=1, nstage=4),
                                dict(rows_per_copy=2), dict(rows_per_copy=32),
                                dict(max_splits=66), dict(max_splits=132), dict(max_splits=3),
                                dict(min_pps=2), dict(min_pps=4),
                                dict(early=True), dict(early=True, max_splits=3),
                                dict(early=True, min_pps=2, rows_per_copy=2),
                                dict(max_splits=264),
                                dict(consumers=4, ppc=2, early=True, min_pps=2, rows_per_copy=2),
                                dict(consumers=4, ppc=2, early=True, min_pps=2, max_splits=3),
                                dict(consumers=3, ppc=1, max_splits=3),
                                dict(consumers=4, ppc=2, early=True, min_pps=2, tma=True),
                                dict(consumers=4, ppc=1, max_splits=3, tma=True),
                                dict(consumers=1, nstage=4, max_splits=3, tma=True),
                                dict(consumers=6, nstage=2, ppc=2, early=True, min_pps=2, tma=True),
                                dict(consumers=4, ppc=2, early=True, min_pps=2, rows_per_copy=2,
                                     tma=True, tma_from=12),
                                dict(consumers=4, ppc=2, early=True, min_pps=2, rows_per_copy=2,
                                     tma=True, tma_from=12, max_splits=3)],
                         ids=["c1", "c4", "c4st2", "st2", "c1st4", "rpc2", "rpc32", "s66", "s132",
                              "s3", "minpps2", "minpps4", "early", "early-s3", "engine", "s264",
                              "c4-ppc2", "c4-ppc2-s3", "c3-ppc1-s3", "c4-ppc2-tma",
                              "c4-ppc1-s3-tma", "c1st4-s3-tma", "c6st2-ppc2-tma",
                              "c4-ppc2-tma-from12", "c4-ppc2-tma-from12-s3"])
def test_attention_variants(length, kw):
    cfg = CFGS["7b"]
    d, ref = _setup(cfg, length, seed=11)
    np.testing.assert_allclose(_run(cfg, d, **kw), ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("length", [1, 17, 49, 3001])
@pytest.mark.parametrize("name", ["g8", "g1"])
@pytest.mark.parametrize("consumers", [1, 2, 4])
def test_attention_gqa_extremes(name, length, consumers):
    cfg = CFGS[name]
    d, ref = _setup(cfg, length, seed=length + 5)
    np.testing.assert_allclose(_run(cfg, d, consumers=consumers), ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("length", [1, 17, 49, 3001])
@pytest.mark.parametrize("name", ["tiny", "g8", "g1"])
def test_attention_tma_other_shapes(name, length):
    """Tensor-map copies at d64 (one 64-dim half: one copy a page) and GQA 8 / 1."""
    cfg = CFGS[name]
    d, ref = _setup(cfg, length, seed=length + 9)
    np.testing.assert_allclose(_run(cfg, d, consumers=4, ppc=2, early=True, min_pps=2, tma=True),
                               ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("length", [17, 49, 1000])
@pytest.mark.parametrize("stale", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("tma_from", [0, 12])
def test_attention_tma_ignores_a_stale_tail(length, stale, tma_from):
    cfg = CFGS["7b"]
    d, ref = _setup(cfg, length, seed=length + 13)
    _poison_tail(d, length, stale)
    got = _run(cfg, d, consumers=4, ppc=2, early=True, min_pps=2, max_splits=3, tma=True,
               tma_from=tma_from)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kw", [dict(early=False), dict(early=True),
                                dict(early=True, consumers=4, ppc=2, min_pps=2, max_splits=3),
                                dict(early=True, consumers=4, ppc=2, min_pps=2, tma=True),
                                dict(early=True, consumers=4, ppc=2, min_pps=2, max_splits=3,
                                     tma=True),
                                dict(early=True, consumers=4, ppc=2, min_pps=2, max_splits=3,
                                     tma=True, tma_from=12)],
                         ids=["plain", "early", "c4-ppc2", "c4-ppc2-tma",
                              "c4-ppc2-s3-tma", "c4-ppc2-s3-tma-from12"])
def test_graph_replay_follows_device_length(kw):
    """One captured graph, replayed after the length in `state` changes, gives each answer,
    and an eager launch at the same length gives it bit for bit (tma_from 12 with 3 splits:
    700 tokens take the tensor-map path, 33 and 350 the bulk one)."""
    from numba import cuda

    from nq.runtime.graphs import CapturedGraph
    cfg = CFGS["7b"]
    d, _ = _setup(cfg, 700, seed=3)
    launch = _launcher(cfg, d, **kw)
    stream = cuda.stream()
    launch(stream)
    stream.synchronize()
    g = CapturedGraph(stream, lambda: launch(stream))
    pool = d["kv"].copy_to_host()
    table = d["table"].copy_to_host()
    q = d["q"].copy_to_host().reshape(cfg.num_heads, cfg.head_dim)
    for length in (700, 33, 350):
        st = np.zeros(d["state"].shape, np.int32)
        st[STATE_POS] = length - 1
        d["state"].copy_to_device(st, stream=stream)
        g.replay(stream)
        stream.synchronize()
        k, v = gather_kv(pool, table, length)
        ref = attention.attention_reference(q, k, v)
        got = d["o"].copy_to_host()
        np.testing.assert_allclose(got.astype(np.float64).reshape(ref.shape), ref, rtol=RTOL,
                                   atol=ATOL)
        launch(stream)  # eager launch at the same length: bit for bit the graph's answer
        stream.synchronize()
        np.testing.assert_array_equal(d["o"].copy_to_host(), got)


def test_launcher_rejects_bad_shapes():
    from numba import cuda
    cfg = CFGS["tiny"]
    d, _ = _setup(cfg, 20, seed=0)
    pa, pm = attention.decode_workspace(cfg)
    args = (cfg, d["q"], d["state"], d["table"], d["kv"], d["o"])
    with pytest.raises(ValueError, match="q is"):
        attention.decode_launcher(cfg, cuda.device_array(3, np.float32), *args[2:], pa, pm)
    with pytest.raises(ValueError, match="part_ml is"):
        attention.decode_launcher(*args, pa, cuda.device_array((pa.shape[0] + 1, cfg.num_heads, 2),
                                                               np.float32))
    with pytest.raises(ValueError, match="unsupported consumers"):
        attention.decode_launcher(*args, pa, pm, rows_per_copy=3)
    with pytest.raises(ValueError, match="ppc=-1"):
        attention.decode_launcher(*args, pa, pm, consumers=4, ppc=-1)
    with pytest.raises(ValueError, match="tma_from=-1"):
        attention.decode_launcher(*args, pa, pm, tma=True, tma_from=-1)
    with pytest.raises(TypeError, match="fresh"):       # retired (launch.py says why)
        attention.decode_launcher(*args, pa, pm, fresh=True)
