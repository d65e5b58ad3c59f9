"""GPU tests of down as a stream-K GEMV into xacc (nq/kernels/int4/gemv_streamk.py; H200: -m gpu),
and of the CUDA-core qkv_rope reading x + xacc beside it.

xacc gains W . a in units of 2^-32: within 1e-4 of the float64 reference's norm, as the
tile-per-block kernel (test_gemv_mma_gpu.py's tolerance: fp32 sums in another order), each
row's fp32 total truncated to 2^-32 once a block.  xacc starts with random contents, kept; x is
never written; a second launch adds the same integers (the blocks' order does not enter)."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from numba import cuda  # noqa: E402  (the marker deselects this module on CPU-only runs)

from nq.kernels.int4.gemv_streamk import reference_streamk  # noqa: E402
from nq.kernels.int4.launch import ResidualMmaGemv  # noqa: E402
from nq.kernels.int4.tiling import MmaTiling as T  # noqa: E402
from nq.loader.quant import dequantize_packed  # noqa: E402

TOL = 1e-4


@pytest.mark.parametrize("n,k,threads,skn", [
    (3584, 18944, 1024, 1),    # the 7B: 132 blocks, 33152 units, ~7.8 a warp
    (3584, 18944, 768, 1),     # 24 warps an SM (room beside for qkv_rope's blocks)
    (3584, 18944, 512, 2),     # two blocks an SM
    (5120, 13824, 1024, 1),    # the 14B
    (5120, 27648, 1024, 1),    # the 32B: 55 KB of activations in dynamic shared memory
    (896, 4864, 1024, 1),      # the 0.5B's shape: some warps with no unit
])
def test_streamk_down(n, k, threads, skn):
    rng = np.random.default_rng(n + k + threads)
    qw = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    sc = rng.uniform(0.002, 0.02, size=(n, k // 128)).astype(np.float16)
    a = (rng.standard_normal(k) * 3).astype(np.float16)
    a[rng.integers(0, k)] = 3000.0                     # a "massive activation" channel
    g = ResidualMmaGemv("down", n, k, T(warps=1, threads=threads, xacc=1, sk=skn))
    pq, ps = g.prepare([(qw, sc)])
    prior = (rng.integers(-2**40, 2**40, n) * 4).astype(np.int64)
    xa = cuda.to_device(prior.view(np.uint32))
    xd = cuda.to_device(np.full(n, np.nan, np.float32))
    args = (cuda.to_device(a), cuda.to_device(pq), cuda.to_device(ps), xd)
    g(*args, 0, xa)
    cuda.synchronize()
    first = xa.copy_to_host().view(np.int64) - prior
    got = first.astype(np.float64) * 2.0 ** -32
    ref = reference_streamk(dequantize_packed(qw, sc), a)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    print(f"\nstream-K down {n}x{k} t{threads} sk{skn} ({g.grid} blocks): rel err {err:.2e}")
    assert err < TOL
    assert np.isnan(xd.copy_to_host()).all()           # x untouched
    for _ in range(3):
        g(*args, 0, xa)
    cuda.synchronize()
    assert np.array_equal(xa.copy_to_host().view(np.int64) - prior, 4 * first)


def test_qkv_rope_with_xacc_is_qkv_rope_of_the_sum():
    """The 7B's CUDA-core qkv_rope (its default tiling with xacc) bit for bit the kernel without
    it given x + xacc * 2^-32: q and the K/V slot."""
    import dataclasses

    from nq.config import PRESETS
    from nq.kernels import rope_kv as R
    from nq.kernels.int4 import launch
    from nq.loader.quant import quantize_pack
    from nq.paged import pool_shape
    from nq.runtime.kv_cache import make_state
    cfg = PRESETS["7b"]
    rng = np.random.default_rng(11)
    k, d = cfg.hidden_size, cfg.head_dim
    words = (rng.integers(-2**40, 2**40, k) * 4).astype(np.int64).view(np.uint32)
    x = (rng.standard_normal(k) * 3).astype(np.float32)
    xe = x + words.view(np.int64).astype(np.float32) * np.float32(2.0 ** -32)
    nw = (1 + 0.1 * rng.standard_normal(k)).astype(np.float16)
    parts = [quantize_pack(rng.standard_normal((m, k)).astype(np.float32) * 0.05)
             for m in (cfg.q_size, cfg.kv_size, cfg.kv_size)]
    bias = (0.5 * rng.standard_normal(cfg.qkv_size)).astype(np.float16)
    D = cuda.to_device
    inv = D(R.rope_inv_freq(d, cfg.rope_theta))
    table = D(np.arange(4, dtype=np.int32))
    base = launch.gemv_tiling("qkv_rope", cfg)
    outs = []
    for t, xx, extra in [(base, xe, {}), (dataclasses.replace(base, xacc=1), x,
                                          {"xacc": D(words)})]:
        g = launch.make_qkv_rope_gemv(cfg, t)
        pq, ps = g.prepare(parts)
        pool = D(np.full(pool_shape(cfg, 4)[1:], 7.0, np.float16))
        q = D(np.full(cfg.q_size, np.nan, np.float32))
        g(D(xx), D(nw), D(pq), D(ps), D(bias), make_state(pos=37), inv, table, pool, q, 0,
          **extra)
        outs.append((q.copy_to_host(), pool.copy_to_host()))
    assert np.isfinite(outs[1][0]).all()
    assert np.array_equal(outs[0][0].view(np.uint32), outs[1][0].view(np.uint32))
    assert np.array_equal(outs[0][1].view(np.uint16), outs[1][1].view(np.uint16))
