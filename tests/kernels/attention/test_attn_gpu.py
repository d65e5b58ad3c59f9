"""Paged attention decode on the GPU against the float64 reference from the same fp16 K/V.

Tolerance: o is rounded to fp16 (half an ulp = 2.4e-4 relative near 1); the kernel adds fp32
accumulation over up to 9000 tokens (~1e-6 relative), ex2.approx (2 ulp of fp32) and fp32
scores.  |o| <= max|v| ~ 4 here, so rtol 2e-3 / atol 1e-3 is ~4x the fp16 rounding and far
below what a wrong tail, page or split (errors of order 1e-1) would produce.
"""
import numpy as np
import pytest

from nq.config import PRESETS, tiny_config
from nq.kernels.attention import combine as attn_decode
from nq.paged import PAGE, STATE_POS, gather_kv, pool_shape
from nq.runtime.kv_cache import make_state

pytestmark = pytest.mark.gpu

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
    ref = attn_decode.attention_reference(q.reshape(cfg.num_heads, cfg.head_dim), k, v)
    return d, ref


def _run(cfg, d, max_splits=None, **kw):
    pa, pm = attn_decode.attn_workspace(cfg, max_splits)
    launch = attn_decode.attn_decode_launcher(cfg, d["q"], d["state"], d["table"], d["kv"], d["o"],
                                              pa, pm, **kw)
    launch()
    return d["o"].copy_to_host().astype(np.float64).reshape(cfg.num_heads, cfg.head_dim)


@pytest.mark.parametrize("length", [1, 15, 16, 17, 49, 1000, 9000])
@pytest.mark.parametrize("name", ["7b", "tiny"])
def test_attention_matches_reference(name, length):
    cfg = CFGS[name]
    d, ref = _setup(cfg, length, seed=length)
    got = _run(cfg, d)
    np.testing.assert_allclose(got, ref, rtol=2e-3, atol=1e-3)


@pytest.mark.parametrize("length", [49, 1000, 3001])
def test_attention_single_split_many_stage_rounds(length):
    """max_splits=1: one CTA per kv head walks every page, wrapping the 3 stages many times."""
    cfg = CFGS["7b"]
    d, ref = _setup(cfg, length, seed=7)
    np.testing.assert_allclose(_run(cfg, d, max_splits=1), ref, rtol=2e-3, atol=1e-3)


@pytest.mark.parametrize("length", [17, 1000])
@pytest.mark.parametrize("kw", [dict(pages_per_stage=2), dict(pages_per_stage=3, min_pps=2),
                                dict(min_pps=4)],
                         ids=["pps2", "pps3_minpps2", "minpps4"])
def test_attention_variants(length, kw):
    cfg = CFGS["7b"]
    d, ref = _setup(cfg, length, seed=11)
    np.testing.assert_allclose(_run(cfg, d, **kw), ref, rtol=2e-3, atol=1e-3)


@pytest.mark.parametrize("length", [1, 17, 49, 3001])
@pytest.mark.parametrize("name", ["g8", "g1"])
def test_attention_gqa_extremes(name, length):
    cfg = CFGS[name]
    d, ref = _setup(cfg, length, seed=length + 5)
    np.testing.assert_allclose(_run(cfg, d), ref, rtol=2e-3, atol=1e-3)


def check_graph_follows_device_length(make_launch, rtol, atol):
    """One captured graph, replayed after the length in `state` changes, gives each answer,
    and an eager launch at the same length gives it bit for bit.  make_launch(cfg, d) returns
    the launcher under test (attn_decode's here, attn_mma's in test_attn_mma_gpu.py)."""
    from numba import cuda
    from nq.runtime.graphs import CapturedGraph
    cfg = CFGS["7b"]
    d, _ = _setup(cfg, 700, seed=3)
    launch = make_launch(cfg, d)
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
        ref = attn_decode.attention_reference(q, k, v)
        got = d["o"].copy_to_host()
        np.testing.assert_allclose(got.astype(np.float64).reshape(ref.shape), ref, rtol=rtol, atol=atol)
        launch(stream)  # eager launch at the same length: bit for bit the graph's answer
        stream.synchronize()
        np.testing.assert_array_equal(d["o"].copy_to_host(), got)


def test_attention_graph_replay_follows_device_length():
    def make_launch(cfg, d):
        pa, pm = attn_decode.attn_workspace(cfg)
        return attn_decode.attn_decode_launcher(cfg, d["q"], d["state"], d["table"], d["kv"],
                                                d["o"], pa, pm)
    check_graph_follows_device_length(make_launch, rtol=2e-3, atol=1e-3)


def test_launcher_rejects_bad_shapes():
    from numba import cuda
    cfg = CFGS["tiny"]
    d, _ = _setup(cfg, 20, seed=0)
    pa, pm = attn_decode.attn_workspace(cfg)
    with pytest.raises(ValueError, match="q is"):
        attn_decode.attn_decode_launcher(cfg, cuda.device_array(3, np.float32), d["state"],
                                         d["table"], d["kv"], d["o"], pa, pm)
