"""GPU tests of gate_up on the tensor cores (gemv_mma kind "gate_up", the default unless NQ_MMA_GATE_UP=0;
H200: -m gpu), against silu(Wg.h) * (Wu.h), h = rmsnorm(x) * norm_w, in fp64.

Tolerance 2e-3 of the reference's norm (test_gemv_mma_gate_up_cpu.py derives it; with i8,
6e-4, and 1e-4 against the reference rounded to fp16): the staged
activations are fp16 (2^-11 each), the products exact, the sums fp32; a dominant channel moves
gate and up by the same 2^-11 and the fp16 store adds 2^-11, so at most ~1.5e-3.  The output
starts as NaN, so an unwritten row fails.
"""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from numba import cuda  # noqa: E402  (the marker deselects this module on CPU-only runs)

from nq.config import PRESETS  # noqa: E402
from nq.kernels.int4.launch import GateUpMmaGemv, make_gate_up_gemv  # noqa: E402
from nq.kernels.int4.tiling import MmaTiling as T  # noqa: E402
from nq.loader.quant import dequantize_packed  # noqa: E402

TOL = 2e-3
CFG = PRESETS["7b"]   # eps 1e-6, as every preset


def ref64(x, nw, eps, wg, wu):
    x = x.astype(np.float64)
    h = x / np.sqrt(np.mean(x * x) + eps) * nw.astype(np.float64)
    g, u = wg @ h, wu @ h
    return g / (1.0 + np.exp(-g)) * u


def run(n, k, tiling, seed):
    rng = np.random.default_rng(seed)
    qw = rng.integers(0, 2**32, size=(2 * n, k // 8), dtype=np.uint32)
    sc = rng.uniform(0.002, 0.02, size=(2 * n, k // 128)).astype(np.float16)
    x = (rng.standard_normal(k) * 2).astype(np.float32)
    x[rng.integers(0, k)] = 900.0                      # a "massive activation" channel
    nw = (1 + 0.2 * rng.standard_normal(k)).astype(np.float16)
    g = GateUpMmaGemv(CFG, n, k, tiling)
    pq, ps = g.prepare([(qw[:n], sc[:n]), (qw[n:], sc[n:])])
    out = cuda.to_device(np.full(n, np.nan, np.float16))
    g(cuda.to_device(x), cuda.to_device(nw), cuda.to_device(pq), cuda.to_device(ps), out, 0)
    w = dequantize_packed(qw, sc).astype(np.float64)
    return out.copy_to_host().astype(np.float64), ref64(x, nw, CFG.rms_norm_eps, w[:n], w[n:])


@pytest.mark.parametrize("n,k,tiling", [
    (18944, 3584, T(warps=2, threads=576)),    # the 7B, the default tiling (one block an SM)
    (18944, 3584, T(warps=2, threads=256)),    # the rule's, 13c221c's best
    (4864, 896, T(warps=2, threads=256)),      # the 0.5B: 7 groups over 2 warps
    (13824, 5120, T(warps=2, threads=256)),    # the 14B before one_wave_tiles
    (13824, 5120, T(warps=2, threads=448)),    # the 14B's and 32B's default: 7 tiles a block
    (27648, 5120, T(warps=2, threads=448)),    # the 32B (247 blocks, two waves)
    (13824, 5120, T(warps=2, threads=448, l2ahead=1)),   # the 14B's default (l2ahead 1)
    (27648, 5120, T(warps=2, threads=448, l2ahead=1)),   # the 32B's default
    (11008, 2048, T(warps=2, threads=384)),    # the 3B's: 6 tiles a block
    (18944, 3584, T(warps=2, threads=128)),    # 13c221c's other candidates
    (18944, 3584, T(warps=4, threads=256)),
    (18944, 3584, T(warps=1, threads=128)),
    (48, 384, T(warps=2, threads=128)),        # a clamped tile in the last block
    (18944, 3584, T(warps=2, threads=576, l2ahead=2)),   # l2ahead: its own next groups to L2
    (18944, 3584, T(warps=2, threads=576, l2ahead=4)),
    (1008, 640, T(warps=3, threads=192)),     # 5 groups over 3 warps, 2 tiles a block
    (18944, 3584, T(warps=2, threads=576, l2ahead=1, i8=1)),   # h as three signed-byte digits
    (18944, 3584, T(warps=2, threads=576, i8=1)),
    (13824, 5120, T(warps=2, threads=448, l2ahead=1, i8=1)),   # the 14B's and 32B's
    (27648, 5120, T(warps=2, threads=448, i8=1)),
    (11008, 2048, T(warps=2, threads=384, i8=1)),              # the 3B's
    (4864, 896, T(warps=2, threads=256, i8=1)),
    (1008, 640, T(warps=3, threads=192, i8=1)),
], ids=lambda v: v.tag() if isinstance(v, T) else str(v))   # -k i8 picks the digits cases
def test_gate_up_against_the_reference(n, k, tiling):
    got, ref = run(n, k, tiling, seed=n + k + tiling.warps)
    assert np.isfinite(got).all(), f"{int((~np.isfinite(got)).sum())} rows not finite/written"
    err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    assert err < TOL, (tiling.tag(), err)
    if tiling.i8:   # only the fp16 store is left: rows equal fp16(ref) but for a rare boundary
        e16 = float(np.linalg.norm(got - ref.astype(np.float16)) / np.linalg.norm(ref))
        assert err < 6e-4 and e16 < 1e-4, (tiling.tag(), err, e16)


def test_gate_up_is_deterministic():
    a, _ = run(18944, 3584, T(warps=2, threads=256), seed=3)
    b, _ = run(18944, 3584, T(warps=2, threads=256), seed=3)
    assert np.array_equal(a, b)   # one writer per row, the warps' partials added in a fixed order


def test_gate_up_does_not_spill_on_the_device():
    # through make_gate_up_gemv, as gemvs() builds it by default
    g = make_gate_up_gemv(CFG, T(warps=2, threads=256))
    assert isinstance(g, GateUpMmaGemv)
    assert g.kernel.get_local_mem_per_thread() == 0, g.kernel.get_regs_per_thread()
    print(f"{g.name}: {g.kernel.get_regs_per_thread()} registers")
