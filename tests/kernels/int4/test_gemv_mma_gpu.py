"""GPU tests of the tensor-core GEMVs (nq/kernels/int4/gemv_mma.py; H200: -m gpu).

Tolerance 1e-4 of the reference's norm: the products of fp16 activations and small integers are
exact in fp32 and each group's sum is fp32 inside the mma, scaled in fp32, so only fp32
summation order differs from the reference (gemv.py's fp16 partials need 5e-3).  Outputs are
the residual x + W.a; x is random, so an unwritten row fails.
"""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from numba import cuda  # noqa: E402  (the marker deselects this module on CPU-only runs)

from nq.config import PRESETS  # noqa: E402
from nq.kernels.int4.launch import ResidualMmaGemv, make_down_gemv  # noqa: E402
from nq.kernels.int4.reference import ref_down  # noqa: E402
from nq.kernels.int4.tiling import MmaTiling as T  # noqa: E402
from nq.loader.quant import dequantize_packed  # noqa: E402

TOL = 1e-4


def run(kind, n, k, tiling, seed):
    rng = np.random.default_rng(seed)
    qw = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    sc = rng.uniform(0.002, 0.02, size=(n, k // 128)).astype(np.float16)
    a = (rng.standard_normal(k) * 3).astype(np.float16)
    a[rng.integers(0, k)] = 3000.0                     # a "massive activation" channel
    x = rng.standard_normal(n).astype(np.float32)
    g = ResidualMmaGemv(kind, n, k, tiling)
    pq, ps = g.prepare([(qw, sc)])
    xd = cuda.to_device(x)
    g(cuda.to_device(a), cuda.to_device(pq), cuda.to_device(ps), xd, 0)
    got = xd.copy_to_host().astype(np.float64)
    ref = ref_down(a, dequantize_packed(qw, sc).astype(np.float64), x.astype(np.float64))
    return got, ref, x


@pytest.mark.parametrize("kind,n,k,tiling", [
    ("down", 3584, 18944, T(warps=16, threads=1024, early=1)),   # the 7B's default
    ("down", 3584, 18944, T(warps=16, threads=1024)),   # 2 tiles a block, no early copy
    ("down", 3584, 18944, T(warps=8, threads=512)),     # 2 tiles a block, 112 blocks
    ("down", 3584, 18944, T(warps=16, threads=512)),    # 1 tile a block, 224 blocks
    ("down", 3584, 18944, T(warps=4, threads=256)),
    ("o_proj", 3584, 3584, T(warps=14, threads=448)),   # the 7B's default: 2 groups a warp
    ("o_proj", 3584, 3584, T(warps=4, threads=256)),    # 28 groups over 4 warps
    ("o_proj", 3584, 3584, T(warps=8, threads=512)),    # 28 over 8: short last pair
    ("down", 896, 4864, T(warps=4, threads=384)),       # 0.5B: 56 tiles over blocks of 3
    ("down", 5120, 13824, T(warps=12, threads=384)),    # 14B: 108 groups over 12 warps
    ("down", 5120, 27648, T(warps=12, threads=384)),    # 32B: 55 KB staged, dynamic shared memory
    ("down", 5120, 13824, T(warps=10, threads=960)),    # the rule at 14B: 3 tiles a block, one wave
    ("down", 5120, 27648, T(warps=10, threads=960)),    # 32B's, activations in dynamic memory
    ("down", 5120, 13824, T(warps=8, threads=768)),     # 14B's measured entry (sms 132)
    ("down", 5120, 27648, T(warps=8, threads=768)),     # 32B's: 27 groups a warp
    ("down", 5120, 13824, T(warps=8, threads=768, early=1)),     # early at the 14B's grid
    ("down", 5120, 27648, T(warps=8, threads=768, early=1)),     # and the 32B's (dynamic smem)
    ("o_proj", 5120, 5120, T(warps=10, threads=320, l2ahead=2)),  # the 14B's o_proj, l2ahead
    ("o_proj", 48, 384, T(warps=2, threads=128)),       # a clamped tile in the last block
    ("down", 3584, 18944, T(warps=8, threads=256, min_blocks=4)),
    ("down", 3584, 18944, T(warps=16, threads=1024, early=3)),  # early: one-shot, then registers
    ("down", 3584, 18944, T(warps=16, threads=1024, early=1, i8=1)),   # a as digits (dynamic smem)
    ("down", 3584, 18944, T(warps=16, threads=1024, i8=1)),
    ("down", 3584, 18944, T(warps=16, threads=512, i8=1)),
    ("o_proj", 3584, 3584, T(warps=14, threads=448, i8=1)),
    ("down", 5120, 13824, T(warps=8, threads=768, early=1, i8=1)),   # the 14B's grid
    ("down", 5120, 27648, T(warps=8, threads=768, early=1, i8=1)),   # the 32B's: 81 KB of digits
    ("down", 896, 4864, T(warps=4, threads=384, i8=1)),
    ("down", 3584, 18944, T(warps=16, threads=1024, early=5)),
    ("down", 3584, 18944, T(warps=16, threads=512, early=4)),
    ("o_proj", 3584, 3584, T(warps=14, threads=448, early=2)),
    ("o_proj", 3584, 3584, T(warps=14, threads=448, early=1)),
    ("down", 5120, 27648, T(warps=12, threads=384, early=3)),    # the 32B: activations dynamic too
    ("o_proj", 48, 384, T(warps=2, threads=128, early=1)),
    ("down", 3584, 18944, T(warps=16, threads=1024, early=1, l2ahead=2)),   # l2ahead
    ("down", 3584, 18944, T(warps=16, threads=1024, early=1, l2ahead=4)),
    ("o_proj", 3584, 3584, T(warps=14, threads=448, l2ahead=2)),
])
def test_mma_gemv_against_the_reference(kind, n, k, tiling):
    got, ref, x = run(kind, n, k, tiling, seed=n + k + tiling.warps)
    assert np.isfinite(got).all()
    err = np.linalg.norm((got - x) - (ref - x)) / np.linalg.norm(ref - x)
    assert err < TOL, (tiling.tag(), err)


@pytest.mark.parametrize("tiling", [T(warps=16, threads=1024), T(warps=8, threads=512),
                                    T(warps=16, threads=1024, early=1),
                                    T(warps=16, threads=1024, early=1, i8=1)], ids=lambda t: t.tag())
def test_mma_gemv_is_deterministic(tiling):
    a, _, _ = run("down", 3584, 18944, tiling, seed=3)
    b, _, _ = run("down", 3584, 18944, tiling, seed=3)
    assert np.array_equal(a, b)   # one writer per row, the warps' partials added in a fixed order


def test_mma_gemv_does_not_spill_on_the_device():
    # through make_down_gemv, as the engine and scripts/step_variants.py build it
    kern = make_down_gemv(PRESETS["7b"], T(warps=8, threads=512)).kernel
    assert kern.get_local_mem_per_thread() == 0, kern.get_regs_per_thread()
