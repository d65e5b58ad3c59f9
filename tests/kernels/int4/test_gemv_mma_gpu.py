"""GPU tests of the tensor-core GEMVs (nq/kernels/int4/gemv_mma.py; H200: -m gpu).

Tolerance 1e-4 of the reference's norm: the products of fp16 activations and small integers are
exact in fp32 and each group's sum is fp32 inside the mma, scaled in fp32, so only fp32
summation order differs from the reference (gemv_int4's fp16 partials need 5e-3).  Outputs
are the residual x + W.a; x is random, so an unwritten row fails.
"""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from numba import cuda  # noqa: E402  (the marker deselects this module on CPU-only runs)

from nq.config import PRESETS  # noqa: E402
from nq.kernels.int4 import gemv as G  # noqa: E402
from nq.kernels.int4 import gemv_mma as M  # noqa: E402
from nq.loader.quant import dequantize_packed  # noqa: E402

TOL = 1e-4
T = G.Tiling


def run(kind, n, k, tiling, seed):
    rng = np.random.default_rng(seed)
    qw = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    sc = rng.uniform(0.002, 0.02, size=(n, k // 128)).astype(np.float16)
    a = (rng.standard_normal(k) * 3).astype(np.float16)
    a[rng.integers(0, k)] = 3000.0                     # a "massive activation" channel
    x = rng.standard_normal(n).astype(np.float32)
    g = M.ResidualMmaGemv(kind, PRESETS["7b"], n, k, tiling)
    pq, ps = g.prepare([(qw, sc)])
    xd = cuda.to_device(x)
    g(cuda.to_device(a), cuda.to_device(pq), cuda.to_device(ps), xd, 0)
    got = xd.copy_to_host().astype(np.float64)
    ref = M.ref_residual(a, dequantize_packed(qw, sc).astype(np.float64), x.astype(np.float64))
    return got, ref, x


@pytest.mark.parametrize("kind,n,k,tiling", [
    ("down", 3584, 18944, T(ks=8, threads=512, mma=True)),     # 2 tiles a block, 112 blocks
    ("down", 3584, 18944, T(ks=16, threads=512, mma=True)),    # 1 tile a block, 224 blocks
    ("down", 3584, 18944, T(ks=4, threads=256, mma=True)),
    ("o_proj", 3584, 3584, T(ks=4, threads=256, mma=True)),    # 28 groups over 4 warps
    ("o_proj", 3584, 3584, T(ks=8, threads=512, mma=True)),    # 28 over 8: short last pair
    ("down", 896, 4864, T(ks=4, threads=384, mma=True)),       # 0.5B: 56 tiles over blocks of 3
    ("o_proj", 48, 384, T(ks=2, threads=128, mma=True)),       # a clamped tile in the last block
    ("down", 3584, 18944, T(ks=16, threads=1024, prefetch=2, mma=True)),   # two groups ahead
    ("down", 3584, 18944, T(ks=16, threads=512, prefetch=2, mma=True)),
    ("o_proj", 3584, 3584, T(ks=14, threads=448, prefetch=2, mma=True)),   # 2 groups a warp
    ("down", 3584, 18944, T(ks=16, threads=1024, splits=2, mma=True)),     # split-K
    ("down", 3584, 18944, T(ks=8, threads=256, splits=4, mma=True)),       # 896 blocks
    ("down", 3584, 18944, T(ks=4, threads=128, splits=5, mma=True)),       # 148 groups: 30 a split
    ("o_proj", 3584, 3584, T(ks=7, threads=224, splits=2, mma=True)),
])
def test_mma_gemv_against_the_reference(kind, n, k, tiling):
    got, ref, x = run(kind, n, k, tiling, seed=n + k + tiling.ks)
    assert np.isfinite(got).all()
    err = np.linalg.norm((got - x) - (ref - x)) / np.linalg.norm(ref - x)
    assert err < TOL, (tiling.tag(), err)


@pytest.mark.parametrize("n,k,tiling", [
    (18944, 3584, T(ks=4, threads=256, mma=True)),     # the 7B: 2 tiles a block, 592 blocks
    (18944, 3584, T(ks=2, threads=256, mma=True, min_blocks=3)),
    (4864, 896, T(ks=7, threads=448, mma=True)),       # 0.5B: 7 groups, one a warp
    (48, 384, T(ks=2, threads=128, mma=True)),         # a clamped spare tile
    (18944, 3584, T(ks=2, threads=256, prefetch=2, mma=True)),
])
def test_mma_gate_up_against_the_reference(n, k, tiling):
    """gate_up on the tensor cores: fp16 output (2^-11 a element) of fp32 sums, so 1e-3."""
    rng = np.random.default_rng(n + tiling.ks)
    parts = [(rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32),
              rng.uniform(0.002, 0.02, size=(n, k // 128)).astype(np.float16)) for _ in range(2)]
    x = (rng.standard_normal(k) * 2).astype(np.float32)
    x[rng.integers(0, k)] = 900.0                       # a "massive activation" channel
    nw = (1 + 0.2 * rng.standard_normal(k)).astype(np.float16)
    g = M.GateUpMmaGemv(PRESETS["7b"], n, k, tiling)
    pq, ps = g.prepare(parts)
    out = cuda.to_device(np.full(n, np.nan, np.float16))
    g(cuda.to_device(x), cuda.to_device(nw), cuda.to_device(pq), cuda.to_device(ps), out, 0)
    got = out.copy_to_host().astype(np.float64)
    ref = G.ref_gate_up(x, nw, PRESETS["7b"].rms_norm_eps,
                        *(dequantize_packed(q, s) for q, s in parts))
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-3, tiling.tag()


@pytest.mark.parametrize("tiling", [T(ks=8, threads=512, mma=True),
                                    T(ks=8, threads=256, splits=4, mma=True)], ids=lambda t: t.tag())
def test_mma_gemv_is_deterministic(tiling):
    a, _, _ = run("down", 3584, 18944, tiling, seed=3)
    b, _, _ = run("down", 3584, 18944, tiling, seed=3)
    assert np.array_equal(a, b)   # one writer per row, the warps' partials added in a fixed order


def test_split_k_counters_rearm_and_replays_agree():
    """Split-K's last block zeroes its counter: launch after launch on one GEMV object (as the
    step graph replays it, 28 layers a step) gives the same bits, and the counters end at 0."""
    rng = np.random.default_rng(5)
    n, k = 3584, 18944
    g = M.ResidualMmaGemv("down", PRESETS["7b"], n, k, T(ks=8, threads=256, splits=4, mma=True))
    pq, ps = g.prepare([(rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32),
                         rng.uniform(0.002, 0.02, size=(n, k // 128)).astype(np.float16))])
    a = cuda.to_device((rng.standard_normal(k) * 3).astype(np.float16))
    pq, ps = cuda.to_device(pq), cuda.to_device(ps)
    x0 = rng.standard_normal(n).astype(np.float32)
    outs = []
    for _ in range(5):
        xd = cuda.to_device(x0)
        g(a, pq, ps, xd, 0)
        outs.append(xd.copy_to_host())
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    assert not g._split[1].copy_to_host().any()


def test_mma_gemv_does_not_spill_on_the_device():
    # through make_down_gemv, as the engine and scripts/step_variants.py build it
    kern = G.make_down_gemv(PRESETS["7b"], T(ks=8, threads=512, mma=True)).kernel
    assert kern.get_local_mem_per_thread() == 0, kern.get_regs_per_thread()
