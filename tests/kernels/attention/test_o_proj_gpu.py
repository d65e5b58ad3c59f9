"""attn_o_proj (nq/kernels/attention/o_proj.py) on the GPU: the split kernel's partials merged
and multiplied by o_proj's INT4 weights in one kernel, against float64 (the attention reference
rounded to fp16 as attn_combine writes o, times the dequantised weights) and against the two
kernels it replaces (attn_combine, then the tensor-core o_proj GEMV).

Tolerance: x's change relative to its norm within 2e-4 of float64 -- o's fp16 rounding is in
the reference too, so what is left is the attention's own error (test_decode_gpu: rtol 2e-3 on
o, which can move an o element across an fp16 rounding boundary) and fp32 sums; against the
two-kernel path within 1e-5 (the same fp16 o except where the merge's fp32 order rounds it
the other way, and another summation order).  Replays in a graph: x bit for bit the eager
launch's, the chunk counters back at 0."""
import numpy as np
import pytest

from nq.config import PRESETS, tiny_config
from nq.kernels import attention
from nq.kernels.attention.o_proj import make_o_proj_launcher
from nq.kernels.int4.launch import ResidualMmaGemv
from nq.kernels.int4.tiling import MmaTiling
from nq.loader.quant import dequantize_packed

from test_decode_gpu import _setup

pytestmark = pytest.mark.gpu

CFGS = {"7b": PRESETS["7b"], "14b": PRESETS["14b"], "tiny": tiny_config()}   # d128 / d64


def _weights(cfg, seed):
    rng = np.random.default_rng(seed)
    n = k = cfg.hidden_size
    qw = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    sc = rng.uniform(0.002, 0.02, size=(n, k // 128)).astype(np.float16)
    return qw, sc


@pytest.mark.parametrize("tpw", [1, 2, 4])
@pytest.mark.parametrize("length", [1, 40, 512, 8192, 32768])
@pytest.mark.parametrize("name", ["7b", "14b", "tiny"])
def test_o_proj_matches_combine_then_gemv(name, length, tpw):
    from numba import cuda
    cfg = CFGS[name]
    if name == "tiny" and length > 1000:
        pytest.skip("the tiny model's contexts are short")
    d, ref_o = _setup(cfg, length, seed=length + tpw)
    qw, sc = _weights(cfg, seed=length)
    n = cfg.hidden_size
    t = MmaTiling(warps=1, threads=32)
    gemv = ResidualMmaGemv("o_proj", n, cfg.q_size, t)
    pq, ps = gemv.prepare([(qw, sc)])
    dq, ds = cuda.to_device(pq), cuda.to_device(ps)
    x0 = np.random.default_rng(length).standard_normal(n).astype(np.float32)
    ms = 33
    pa, pm = attention.decode_workspace(cfg, ms)
    opts = dict(min_pps=2, consumers=4, ppc=2, nstage=4, tma=True, early=True, rows_per_copy=2)
    # the two kernels it replaces
    split_combine = attention.decode_launcher(cfg, d["q"], d["state"], d["table"], d["kv"],
                                              d["o"], pa, pm, **opts)
    xa = cuda.to_device(x0)
    split_combine()
    gemv(d["o"], dq, ds, xa)
    # the fused form (the split kernel triggering it at its start)
    split = attention.decode_launcher(cfg, d["q"], d["state"], d["table"], d["kv"], d["o"],
                                      pa, pm, merge=False, trigger=True, **opts)
    xb = cuda.to_device(x0)
    fused = make_o_proj_launcher(cfg, d["state"], pa, pm, xb, 2, tpw)
    split()
    fused(dq, ds)
    a, b = xa.copy_to_host(), xb.copy_to_host()
    o16 = ref_o.reshape(-1).astype(np.float16).astype(np.float64)
    want = dequantize_packed(qw, sc).astype(np.float64) @ o16
    scale = np.linalg.norm(want)
    assert np.linalg.norm((b - x0) - want) / scale < 2e-4
    assert np.linalg.norm(b - a) / scale < 1e-5
    # graph replays: bit for bit, counters back at 0 every time
    from nq.runtime.graphs import CapturedGraph
    stream = cuda.stream()
    xb.copy_to_device(x0)
    fused_s = make_o_proj_launcher(cfg, d["state"], pa, pm, xb, 2, tpw)
    g = CapturedGraph(stream, lambda: (split(stream), fused_s(dq, ds, stream)), name="o_proj",
                      programmatic=True)
    for _ in range(3):
        xb.copy_to_device(x0)
        g.replay()
        stream.synchronize()
        np.testing.assert_array_equal(xb.copy_to_host(), b)


@pytest.mark.parametrize("length", [40, 8192])
@pytest.mark.parametrize("name", ["7b", "14b"])
def test_o_proj_into_xacc(name, length):
    """The acc form: x untouched, xacc * 2^-32 within 2e-4 of float64 and within 1e-5 of the
    fold form's x change (the same shares; integer sums instead of fp32 ones)."""
    from numba import cuda
    from nq.kernels.attention.o_proj import xacc_workspace
    cfg = CFGS[name]
    d, ref_o = _setup(cfg, length, seed=length + 7)
    qw, sc = _weights(cfg, seed=length + 1)
    n = cfg.hidden_size
    pq, ps = ResidualMmaGemv("o_proj", n, cfg.q_size, MmaTiling(warps=1, threads=32)).prepare(
        [(qw, sc)])
    dq, ds = cuda.to_device(pq), cuda.to_device(ps)
    pa, pm = attention.decode_workspace(cfg, 33)
    attention.decode_launcher(cfg, d["q"], d["state"], d["table"], d["kv"], d["o"], pa, pm,
                              min_pps=2, consumers=4, ppc=2, nstage=4, tma=True, early=True,
                              rows_per_copy=2, merge=False, trigger=True)()
    x0 = np.zeros(n, np.float32)
    xf, xs = cuda.to_device(x0), cuda.to_device(x0)
    xa = xacc_workspace(n)
    make_o_proj_launcher(cfg, d["state"], pa, pm, xf, 2, 2)(dq, ds)
    make_o_proj_launcher(cfg, d["state"], pa, pm, xs, 2, 2, xa)(dq, ds)
    got = xa.copy_to_host().view(np.int64).astype(np.float64) * 2.0 ** -32
    o16 = ref_o.reshape(-1).astype(np.float16).astype(np.float64)
    want = dequantize_packed(qw, sc).astype(np.float64) @ o16
    scale = np.linalg.norm(want)
    assert not xs.copy_to_host().any()
    assert np.linalg.norm(got - want) / scale < 2e-4
    assert np.linalg.norm(got - xf.copy_to_host()) / scale < 1e-5
