"""GPU tests of the wgmma prefill GEMM (nq/kernels/int4/gemm_wgmma.py; H200, sm_90a: -m gpu):
every projection of the 0.5B and 7B configs at M = 65 .. 2048 against the fp64 NumPy
reference, each candidate tile configuration of scripts/bench_gemm.py --wgmma on one shape,
determinism.

Tolerance: tests/kernels/int4/test_gemm_gpu.py's derivation holds unchanged -- the same fp16
x, the same weights folded with their scale into fp16 once (~3e-4 of a row's norm over random
signs), products exact in fp32, fp32 sums (wgmma accumulates in fp32 like mma.sync): 6e-4 for
fp32 outputs, 1e-3 for gate_up's fp16.  Run tests/ptx/test_wgmma_gpu.py first: if the
one-tile probe fails, the descriptor / swizzle reading is wrong and everything here fails too.
"""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from numba import cuda  # noqa: E402

from nq.config import PRESETS  # noqa: E402
from nq.kernels.int4 import gemm as M  # noqa: E402
from nq.kernels.int4 import gemm_wgmma as W  # noqa: E402
from nq.kernels.int4 import wg_tiles as T  # noqa: E402
from nq.loader.quant import dequantize_packed  # noqa: E402

from gemm_cases import SHAPES, weights  # noqa: E402  (tests/: both GEMMs' cases)

MS = (65, 128, 300, 512, 2048)     # 65, 300: a partial last token block


def check_against_reference(g, model, kind, n, k, layout, m):
    rng = np.random.default_rng(m + n)
    qw_d, sc_d, qw, sc = weights(model, kind, n, k, layout)
    x = rng.standard_normal((m + 5, k)).astype(np.float16)
    x[rng.integers(0, m), rng.integers(0, k)] = 400.0
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
    bad = np.argwhere(np.abs(got - ref) > 0.05 * np.abs(ref).max())
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    where = "" if not len(bad) else (f"; {len(bad)} elements far off, first (token, feature): "
                                     f"{[(int(toks[i]), int(cols[j])) for i, j in bad[:6]]}")
    assert err < (1e-3 if kind == "gate_up" else 6e-4), (kind, n, k, m, err, where)


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("model,kind,n,k,layout", SHAPES, ids=[f"{s[0]}-{s[1]}" for s in SHAPES])
def test_gemm_wgmma_against_the_reference(model, kind, n, k, layout, m):
    g = M.make_gemm(kind, n, k, layout, backend="wgmma")
    assert isinstance(g, W.WgmmaGemm)
    check_against_reference(g, model, kind, n, k, layout, m)


@pytest.mark.parametrize("tiles", [
    T.WG_WIDE, T.WG_TALL, T.WgTiles(1, 2, 64, 4), T.WgTiles(2, 1, 128, 4),
    T.WgTiles(2, 2, 64, 4), T.WgTiles(1, 1, 256, 3), T.WgTiles(2, 2, 128, 4, 2),
    T.WgTiles(2, 2, 128, 4, 3), T.WgTiles(1, 2, 64, 4, 2), T.WgTiles(1, 2, 128, 4, 2),
    T.WgTiles(1, 4, 64, 3, 2)],
    ids=lambda t: t.tag())
@pytest.mark.parametrize("kind", ["o_proj", "gate_up"])
def test_candidate_tiles(kind, tiles):
    """The bench's alternatives (so a faster one can become the default), on a 7B shape."""
    cfg = PRESETS["7b"]
    n, k, layout = ((cfg.hidden_size, cfg.q_size, "mma") if kind == "o_proj"
                    else (cfg.intermediate_size, cfg.hidden_size, ("rows", 4)))
    try:
        T.check(kind, n, k, layout, tiles)
    except ValueError as e:
        pytest.skip(str(e))
    g = W.WgmmaGemm(kind, n, k, layout, tiles)
    check_against_reference(g, "7b", kind, n, k, layout, 300)


def test_gemm_wgmma_is_deterministic():
    cfg = PRESETS["7b"]
    n, k = cfg.hidden_size, cfg.intermediate_size
    qw_d, sc_d, _, _ = weights("7b", "down", n, k, "mma")
    g = M.make_gemm("down", n, k, "mma", backend="wgmma")
    rng = np.random.default_rng(1)
    x = cuda.to_device(rng.standard_normal((512, k)).astype(np.float16))
    outs = []
    for _ in range(2):
        out = cuda.to_device(np.zeros((512, n), np.float32))
        g(x, qw_d, sc_d, out, 512)
        outs.append(out.copy_to_host())
    assert np.array_equal(outs[0], outs[1])
