"""GPU tests of the int8 lm_head (nq/kernels/lm_head_int8.py) against fp64 (H200: -m gpu).

The weights are random int8 rows (every byte value, -128 included, a superset of what the
quantiser writes) with fp32 scales; the reference is the same GEMV in fp64, h = rmsnorm(x)
included.  Outputs are poisoned with NaN first, so an unwritten row fails.

Tolerance 1e-5 of the logits' largest magnitude: the int8 -> fp32 conversion is exact and
each product of it with the fp32 h is exact in the fma, so the kernel's only errors are h's
fp32 rounding (2^-24 relative) and the fp32 sums over 896..3584 terms (a few 2^-24 of the
largest partial each): measured 4e-7 of the largest logit in the simulator (CPU tier).
"""
from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from numba import cuda  # noqa: E402  (the marker deselects this module on CPU-only runs)

from nq.config import PRESETS  # noqa: E402
from nq.kernels import lm_head_int8 as L  # noqa: E402
from nq.kernels.lm_head import make_lm_head  # noqa: E402

TOL = 1e-5


def ref64(x, nw, eps, q, s):
    x = x.astype(np.float64)
    h = x / np.sqrt(np.mean(x * x) + eps) * nw.astype(np.float64)
    return (q.astype(np.float64) @ h) * s.astype(np.float64)


def run(vocab, k, seed, **tiling):
    rng = np.random.default_rng(seed)
    cfg = SimpleNamespace(vocab_size=vocab, hidden_size=k, rms_norm_eps=1e-6)  # all it reads
    x = (rng.standard_normal(k) * 2).astype(np.float32)
    x[3] = 300.0                                                   # an outlier channel
    nw = (1 + 0.2 * rng.standard_normal(k)).astype(np.float16)
    q = rng.integers(-128, 128, size=(vocab, k), dtype=np.int8)
    s = rng.uniform(1e-4, 1e-3, size=vocab).astype(np.float32)
    w = L.Int8Rows(cuda.to_device(q), cuda.to_device(s))
    head = make_lm_head(cfg, w, **tiling)
    assert isinstance(head, L.LmHeadInt8)
    out = cuda.to_device(np.full(vocab, np.nan, np.float32))
    head(cuda.to_device(x), cuda.to_device(nw), w, out, 0)
    got = out.copy_to_host()
    assert np.isfinite(got).all(), f"{int((~np.isfinite(got)).sum())} rows not written"
    return got, ref64(x, nw, cfg.rms_norm_eps, q, s)


@pytest.mark.parametrize("size", ["7b", "0.5b"])
def test_lm_head_int8_against_fp64(size):
    cfg = PRESETS[size]
    got, ref = run(cfg.vocab_size, cfg.hidden_size, seed=cfg.hidden_size)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < TOL, err
    assert int(np.argmax(got)) == int(np.argmax(ref)) or np.sort(ref)[-1] - np.sort(ref)[-2] < \
        TOL * np.abs(ref).max()


@pytest.mark.parametrize("tiling", [dict(rows=1, unroll=7), dict(rows=2, unroll=2),
                                    dict(threads=128, unroll=8, rows=1, grid=7),
                                    dict(rows=2, unroll=3, grid=5)], ids=str)
@pytest.mark.parametrize("vocab,k", [(152064, 3584), (1001, 656)])
def test_lm_head_int8_tilings(vocab, k, tiling):
    """Odd vocabularies (a lone last row of a pair), rows that do not fill a lane's chunks,
    a grid smaller than the work."""
    got, ref = run(vocab, k, seed=vocab + k, **tiling)
    assert np.abs(got - ref).max() / np.abs(ref).max() < TOL


def test_default_kernel_does_not_spill_on_the_device():
    """The launch bounds cap it at 64 registers (4 blocks of 256 an SM); read the local memory
    of what the device's JIT built."""
    for size in ("7b", "0.5b"):
        kern = L.make_lm_head_int8(PRESETS[size]).kernel
        assert kern.get_local_mem_per_thread() == 0, (size, kern.get_regs_per_thread())


def test_deterministic():
    a, _ = run(152064, 3584, seed=1)
    b, _ = run(152064, 3584, seed=1)
    assert np.array_equal(a, b)
