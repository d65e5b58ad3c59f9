"""GPU tests of the prefill GEMM (nq/kernels/int4/gemm.py; H200: -m gpu): every projection of
the 0.5B and 7B configs, M from 1 to 2048, against the fp64 NumPy reference.

Tolerance, from the arithmetic: x is fp16 in the kernel and in the reference alike (exact); a
weight is q*s rounded to fp16 once (the scale folded in: relative error <= 2^-11, ~2^-11/sqrt(3)
rms over random mantissas), each product of two fp16 is exact in the tensor core's fp32, and
the sums are fp32 (~sqrt(K) * 2^-24 relative: 1e-5 at K = 18944).  Over a row of random
signs the folded scales dominate, ~3e-4 of the result's norm (measured 1.3-1.8e-4 under the
simulator), so 6e-4 for fp32 outputs; gate_up's fp16 output adds 2^-12 rms: 1e-3.  Residual
outputs are compared as out - residual, so the products carry the whole error.

Weights: the 0.5B's from quantize_pack of random normals; the 7B's as random packed words (every
nibble -8..7, -8 included, which quantize_pack never writes but the format allows) with random
fp16 scales, made in a second instead of a minute; both uploaded in the decode layouts
(tile_rows / mma_layout).  The reference covers
all tokens up to M = 512 and 64 random tokens beyond, over 256 random output features (fp64
over every row would take minutes at 7B x 2048).
"""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from numba import cuda  # noqa: E402  (the marker deselects this module on CPU-only runs)

from nq.config import PRESETS  # noqa: E402
from nq.kernels.int4 import gemm as M  # noqa: E402
from nq.loader.quant import dequantize_packed  # noqa: E402

from gemm_cases import SHAPES, weights  # noqa: E402  (tests/: both GEMMs' cases)

MS = (1, 7, 16, 33, 100, 512, 2048)      # 33: the medium tiles (17..64) run too


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("model,kind,n,k,layout", SHAPES, ids=[f"{s[0]}-{s[1]}" for s in SHAPES])
def test_gemm_against_the_reference(model, kind, n, k, layout, m):
    rng = np.random.default_rng(m + n)
    qw_d, sc_d, qw, sc = weights(model, kind, n, k, layout)
    g = M.make_gemm(kind, n, k, layout)
    x = rng.standard_normal((m + 5, k)).astype(np.float16)      # allocated for more than m
    x[rng.integers(0, m), rng.integers(0, k)] = 400.0              # a "massive activation"
    out_t = np.float16 if kind == "gate_up" else np.float32
    out0 = rng.standard_normal((m + 3, n)).astype(out_t)
    out = cuda.to_device(out0)
    bias = rng.standard_normal(n).astype(np.float16)
    args = [cuda.to_device(x), qw_d, sc_d] + ([cuda.to_device(bias)] if kind == "qkv" else [])
    g(*args, out, m)
    got = out.copy_to_host()
    assert np.array_equal(got[m:], out0[m:]), "rows past m were written"
    assert np.isfinite(got[:m].astype(np.float32)).all()

    toks = np.arange(m) if m <= 512 else np.sort(rng.choice(m, 64, replace=False))
    cols = np.sort(rng.choice(n, min(n, 256), replace=False))
    wrows = np.concatenate([cols, n + cols]) if kind == "gate_up" else cols
    ref = M.ref_gemm(kind, x[toks], dequantize_packed(qw[wrows], sc[wrows]), bias[cols],
                     out0[toks][:, cols])
    got = got[toks][:, cols].astype(np.float64)
    if kind in ("o_proj", "down"):
        got, ref = got - out0[toks][:, cols], ref - out0[toks][:, cols]
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < (1e-3 if kind == "gate_up" else 6e-4), (g.pick(m)[2], err)


def test_gemm_is_deterministic_and_skips_m0():
    """One writer per element and the wk warps' sums added in a fixed order: the same bits."""
    cfg = PRESETS["7b"]
    n, k = cfg.hidden_size, cfg.intermediate_size
    qw_d, sc_d, _, _ = weights("7b", "down", n, k, "mma")
    g = M.make_gemm("down", n, k, "mma")
    rng = np.random.default_rng(1)
    for m in (16, 512):
        x = cuda.to_device(rng.standard_normal((m, k)).astype(np.float16))
        outs = []
        for _ in range(2):
            out = cuda.to_device(np.zeros((m, n), np.float32))
            g(x, qw_d, sc_d, out, m)
            outs.append(out.copy_to_host())
        assert np.array_equal(outs[0], outs[1])
    out = cuda.to_device(np.full((4, n), 7.0, np.float32))
    g(x, qw_d, sc_d, out, 0)
    assert (out.copy_to_host() == 7.0).all()


def test_launcher_refuses_what_it_cannot_run():
    cfg = PRESETS["0.5b"]
    n, k = cfg.hidden_size, cfg.q_size
    qw_d, sc_d, _, _ = weights("0.5b", "o_proj", n, k, "mma")
    g = M.make_gemm("o_proj", n, k, "mma")
    x = cuda.to_device(np.zeros((8, k), np.float16))
    out = cuda.to_device(np.zeros((8, n), np.float32))
    with pytest.raises(ValueError, match="at least m=9 rows"):
        g(x, qw_d, sc_d, out, 9)
    with pytest.raises(ValueError, match="x: expected float16"):
        g(cuda.to_device(np.zeros((8, k + 128), np.float16)), qw_d, sc_d, out, 8)
    with pytest.raises(ValueError, match="out: expected float32"):
        g(x, qw_d, sc_d, cuda.to_device(np.zeros((8, n), np.float16)), 8)
    with pytest.raises(ValueError, match="qweight"):
        g(x, cuda.to_device(np.zeros((n, k // 4), np.uint32)), sc_d, out, 8)


def test_gemm_does_not_spill_on_the_device():
    cfg = PRESETS["7b"]
    g = M.make_gemm("gate_up", cfg.intermediate_size, cfg.hidden_size, ("rows", 4))
    for max_m, _ in g.configs:
        tiles, kern, name = g.pick(max_m or 4096)
        assert kern.get_local_mem_per_thread() == 0, (name, kern.get_regs_per_thread())
