"""Tensor-core paged attention (nq/kernels/attention/decode.py) on the GPU against the float64 reference
from the same fp16 K/V; mirrors tests/test_attn_gpu.py.

Tolerance, rtol 2e-3 / atol 1e-3 as for the fp32 kernel: scores are ~fp32 (q split hi + lo in
fp16, K exact, fp32 accumulation) and so are the weights (P split hi + lo in fp16, ~2^-22
relative; P in fp16 alone would allow up to 9.8e-4 x max|v|), so what is left is fp32
accumulation, ex2.approx and o's own fp16 rounding (2.4e-4 relative).  A wrong tail, page,
split or merge gives errors of order 1e-1.

The fused combine (counters=...) is held to more: o bit for bit the two-kernel path's, and the
counters back at zero after every launch and graph replay.
"""
import numpy as np
import pytest

from nq.kernels.attention import combine as attn_decode
from nq.kernels.attention import decode as attn_mma
from nq.paged import PAGE

from test_attn_gpu import CFGS, _setup, check_graph_follows_device_length  # 7b, tiny, g8, g1

pytestmark = pytest.mark.gpu

RTOL, ATOL = 2e-3, 1e-3


def _poison_tail(d, length, value):
    """Overwrite the slots past `length` in the last page (K and V, every kv head) with value:
    NaN or inf there must not reach o (0 * NaN = NaN in the tensor core too)."""
    from numba import cuda
    need = -(-length // PAGE)
    pool, table = d["kv"].copy_to_host(), d["table"].copy_to_host()
    pool[table[need - 1], :, :, length - (need - 1) * PAGE:] = value
    d["kv"] = cuda.to_device(pool)


def _run(cfg, d, max_splits=None, **kw):
    pa, pm = attn_mma.attn_mma_workspace(cfg, max_splits)
    launch = attn_mma.attn_mma_launcher(cfg, d["q"], d["state"], d["table"], d["kv"], d["o"],
                                        pa, pm, **kw)
    launch()
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
                                dict(early=True), dict(early=True, max_splits=3)],
                         ids=["c1", "c4", "c4st2", "st2", "c1st4", "rpc2", "rpc32", "s66", "s132",
                              "s3", "early", "early-s3"])
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


def test_matches_fp32_kernel():
    """Same inputs through attn_decode: the two kernels agree to the tolerance of either."""
    cfg = CFGS["7b"]
    d, ref = _setup(cfg, 2000, seed=13)
    got = _run(cfg, d)
    pa, pm = attn_decode.attn_workspace(cfg)
    attn_decode.attn_decode_launcher(cfg, d["q"], d["state"], d["table"], d["kv"], d["o"], pa, pm)()
    fp32 = d["o"].copy_to_host().astype(np.float64).reshape(ref.shape)
    np.testing.assert_allclose(got, fp32, rtol=RTOL, atol=ATOL)


def test_attention_graph_replay_follows_device_length():
    def make_launch(cfg, d):
        pa, pm = attn_mma.attn_mma_workspace(cfg)
        return attn_mma.attn_mma_launcher(cfg, d["q"], d["state"], d["table"], d["kv"], d["o"],
                                          pa, pm)
    check_graph_follows_device_length(make_launch, rtol=RTOL, atol=ATOL)


# ---- the combine fused into the split kernel (counters=) --------------------------------------

def _two_and_fused(cfg, d, max_splits=None, repeats=2, fused_kw=None, **kw):
    """o of the two-kernel path, then of the fused one `repeats` times with the same counters
    (o poisoned before each): asserts each fused o is the two-kernel o bit for bit and the
    counters are zero after each launch; returns the two-kernel o (float64, (Hq, D))."""
    from numba import cuda
    pa, pm = attn_mma.attn_mma_workspace(cfg, max_splits)
    args = (cfg, d["q"], d["state"], d["table"], d["kv"], d["o"], pa, pm)
    attn_mma.attn_mma_launcher(*args, **kw)()
    two = d["o"].copy_to_host()
    counters = attn_mma.attn_mma_counters(cfg)
    fused = attn_mma.attn_mma_launcher(*args, counters=counters, **(fused_kw or {}), **kw)
    for _ in range(repeats):
        d["o"].copy_to_device(np.full(cfg.q_size, np.nan, np.float16))
        fused()
        cuda.synchronize()
        np.testing.assert_array_equal(d["o"].copy_to_host().view(np.uint16), two.view(np.uint16))
        np.testing.assert_array_equal(counters.copy_to_host(), 0)
    return two.astype(np.float64).reshape(cfg.num_heads, cfg.head_dim)


@pytest.mark.parametrize("length", [1, 15, 16, 17, 49, 1000, 9000])
@pytest.mark.parametrize("name", ["7b", "tiny"])
def test_fused_combine_is_the_two_kernel_path(name, length):
    cfg = CFGS[name]
    d, ref = _setup(cfg, length, seed=length + 3)
    np.testing.assert_allclose(_two_and_fused(cfg, d), ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("length", [17, 49, 1000, 9000])
@pytest.mark.parametrize("kw", [dict(early=True), dict(consumers=4), dict(consumers=2, nstage=2),
                                dict(rows_per_copy=32), dict(max_splits=1), dict(max_splits=3),
                                dict(max_splits=132), dict(early=True, max_splits=3),
                                dict(fused_kw=dict(combine_warps=4)),
                                dict(fused_kw=dict(combine_warps=8, combine_rows=8)),
                                dict(fused_kw=dict(combine_rows=4), consumers=2)],
                         ids=["early", "c4", "c2st2", "rpc32", "s1", "s3", "s132", "early-s3",
                              "w4", "w8r8", "r4c2"])
def test_fused_combine_variants(length, kw):
    cfg = CFGS["7b"]
    d, ref = _setup(cfg, length, seed=23)
    np.testing.assert_allclose(_two_and_fused(cfg, d, **kw), ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("length", [1, 17, 3001])
@pytest.mark.parametrize("name", ["g8", "g1"])
def test_fused_combine_gqa_extremes(name, length):
    cfg = CFGS[name]
    d, ref = _setup(cfg, length, seed=length + 9)
    np.testing.assert_allclose(_two_and_fused(cfg, d, repeats=1), ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("length", [17, 1000])
def test_fused_combine_ignores_a_stale_tail(length):
    cfg = CFGS["7b"]
    d, ref = _setup(cfg, length, seed=length + 1)
    _poison_tail(d, length, np.nan)
    got = _two_and_fused(cfg, d, repeats=1)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("early", [False, True], ids=["plain", "early"])
def test_fused_graph_replay_follows_device_length(early):
    def make_launch(cfg, d):
        pa, pm = attn_mma.attn_mma_workspace(cfg)
        return attn_mma.attn_mma_launcher(cfg, d["q"], d["state"], d["table"], d["kv"], d["o"],
                                          pa, pm, early=early,
                                          counters=attn_mma.attn_mma_counters(cfg))
    check_graph_follows_device_length(make_launch, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("early", [False, True], ids=["plain", "early"])
def test_fused_layers_in_a_programmatic_graph(early):
    """Three fused launches in a row sharing counters and partial buffers, as the layers of a
    decode step do, captured with programmatic (PDL) edges and replayed at several lengths:
    each launch may start while the one before runs, so the counters and buffers are only safe
    if nothing touches them before griddepcontrol.wait.  Every replay gives the eager
    two-kernel o bit for bit and leaves the counters at zero."""
    from numba import cuda

    from nq.runtime.graphs import CapturedGraph
    from nq.paged import STATE_POS
    cfg = CFGS["7b"]
    d, _ = _setup(cfg, 2000, seed=5)
    pa, pm = attn_mma.attn_mma_workspace(cfg)
    counters = attn_mma.attn_mma_counters(cfg)
    args = (cfg, d["q"], d["state"], d["table"], d["kv"], d["o"], pa, pm)
    two = attn_mma.attn_mma_launcher(*args, early=early)
    fused = attn_mma.attn_mma_launcher(*args, early=early, counters=counters)
    stream = cuda.stream()
    fused(stream)
    stream.synchronize()
    g = CapturedGraph(stream, lambda: [fused(stream) for _ in range(3)], programmatic=True)
    for length in (2000, 1, 33, 700, 17, 2000):
        st = np.zeros(d["state"].shape, np.int32)
        st[STATE_POS] = length - 1
        d["state"].copy_to_device(st, stream=stream)
        two(stream)
        stream.synchronize()
        want = d["o"].copy_to_host()
        d["o"].copy_to_device(np.full(cfg.q_size, np.nan, np.float16), stream=stream)
        g.replay(stream)
        stream.synchronize()
        np.testing.assert_array_equal(d["o"].copy_to_host().view(np.uint16), want.view(np.uint16))
        np.testing.assert_array_equal(counters.copy_to_host(), 0)


def test_launcher_rejects_bad_shapes():
    from numba import cuda
    cfg = CFGS["tiny"]
    d, _ = _setup(cfg, 20, seed=0)
    pa, pm = attn_mma.attn_mma_workspace(cfg)
    with pytest.raises(ValueError, match="q is"):
        attn_mma.attn_mma_launcher(cfg, cuda.device_array(3, np.float32), d["state"],
                                   d["table"], d["kv"], d["o"], pa, pm)
    with pytest.raises(ValueError, match="part_ml is"):
        attn_mma.attn_mma_launcher(cfg, d["q"], d["state"], d["table"], d["kv"], d["o"], pa,
                                   cuda.device_array((pa.shape[0] + 1, cfg.num_heads, 2), np.float32))
    with pytest.raises(ValueError, match="unsupported consumers"):
        attn_mma.attn_mma_launcher(cfg, d["q"], d["state"], d["table"], d["kv"], d["o"], pa, pm,
                                   rows_per_copy=3)
    args = (cfg, d["q"], d["state"], d["table"], d["kv"], d["o"], pa, pm)
    with pytest.raises(ValueError, match="counters is"):
        attn_mma.attn_mma_launcher(*args, counters=cuda.to_device(np.zeros(cfg.num_kv_heads + 1,
                                                                           np.int32)))
    with pytest.raises(ValueError, match="counters is"):
        attn_mma.attn_mma_launcher(*args, counters=cuda.to_device(np.zeros(cfg.num_kv_heads,
                                                                           np.uint32)))
    with pytest.raises(ValueError, match="unsupported combine_warps"):
        attn_mma.attn_mma_launcher(*args, counters=attn_mma.attn_mma_counters(cfg),
                                   combine_rows=32)
