"""GPU tests of the fused MLP kernel (nq/kernels/int4/gemv_mlp.py; H200: -m gpu): its SwiGLU
output bit for bit gemv_mma's gate_up (the same tiles, warps and order), x against x + Wd . a
in fp64 on the `a` it wrote (tolerance 1e-5 of the sums' norm: fp16 activations times small
integers are exact in fp32, only the fp32 sums remain), launch after launch and replay after
replay of a captured graph (the grid barrier's words carry over), deterministic, and the same
as its two phases launched one after the other."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from numba import cuda  # noqa: E402

from nq.config import PRESETS  # noqa: E402
from nq.kernels.int4.gemv_mlp import MlpTiling  # noqa: E402
from nq.kernels.int4.launch import make_gate_up_gemv, make_mlp_gemv  # noqa: E402
from nq.kernels.int4.layout import mma_layout  # noqa: E402
from nq.kernels.int4.tiling import MmaTiling  # noqa: E402
from nq.loader.quant import dequantize_packed  # noqa: E402
from nq.runtime.graphs import CapturedGraph  # noqa: E402

CFG = PRESETS["7b"]


def weights(seed, inter=CFG.intermediate_size, hid=CFG.hidden_size):
    rng = np.random.default_rng(seed)
    gq = rng.integers(0, 2**32, size=(2 * inter, hid // 8), dtype=np.uint32)
    gs = rng.uniform(0.002, 0.02, size=(2 * inter, hid // 128)).astype(np.float16)
    dq = rng.integers(0, 2**32, size=(hid, inter // 8), dtype=np.uint32)
    ds = rng.uniform(0.002, 0.02, size=(hid, inter // 128)).astype(np.float16)
    x = (rng.standard_normal(hid) * 2).astype(np.float32)
    x[rng.integers(0, hid)] = 900.0
    nw = (1 + 0.2 * rng.standard_normal(hid)).astype(np.float16)
    dev = [cuda.to_device(v) for v in (nw, mma_layout(gq), gs, mma_layout(dq), ds)]
    return (gq, gs, dq, ds, x), dev


@pytest.mark.parametrize("tiling", [MlpTiling(), MlpTiling(slots=4), MlpTiling(l2ahead=0),
                                    MlpTiling(slots=9)])
def test_fused_mlp_against_the_two_kernels_and_the_reference(tiling):
    (gq, gs, dq, ds, x), (nw, pgq, pgs, pdq, pds) = weights(seed=tiling.slots)
    g = make_mlp_gemv(CFG, tiling)
    gu = make_gate_up_gemv(CFG, MmaTiling(warps=2, threads=tiling.threads,
                                          l2ahead=tiling.l2ahead))
    inter = CFG.intermediate_size
    a_ref = cuda.to_device(np.full(inter, np.nan, np.float16))
    gu(cuda.to_device(x), nw, pgq, pgs, a_ref)
    bar = cuda.to_device(np.zeros(2, np.uint32))
    w_down = dequantize_packed(dq, ds).astype(np.float64)
    outs = []
    for rep in range(3):   # the barrier's generation word carries over from launch to launch
        xd, a = cuda.to_device(x), cuda.to_device(np.full(inter, np.nan, np.float16))
        g(xd, nw, pgq, pgs, pdq, pds, a, bar)
        cuda.synchronize()
        got_a = a.copy_to_host()
        assert np.array_equal(got_a, a_ref.copy_to_host()), rep
        want = w_down @ got_a.astype(np.float64)
        got = xd.copy_to_host().astype(np.float64) - x
        err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        assert err < 1e-5, (tiling.tag(), rep, err)
        outs.append(xd.copy_to_host())
    assert all(np.array_equal(outs[0], o) for o in outs[1:])   # deterministic
    assert bar.copy_to_host().tolist() == [0, 3]                # count back at 0, 3 generations
    # the two phases as two launches (the simulator's way) give the same bits
    xd, a = cuda.to_device(x), cuda.to_device(np.zeros(inter, np.float16))
    g(xd, nw, pgq, pgs, pdq, pds, a, bar, phases=1)
    g(xd, nw, pgq, pgs, pdq, pds, a, bar, phases=2)
    assert np.array_equal(xd.copy_to_host(), outs[0])


def test_fused_mlp_in_a_replayed_graph():
    (gq, gs, dq, ds, x), (nw, pgq, pgs, pdq, pds) = weights(seed=7)
    g = make_mlp_gemv(CFG)
    inter = CFG.intermediate_size
    xd, a = cuda.to_device(x), cuda.to_device(np.zeros(inter, np.float16))
    bars = cuda.to_device(np.zeros((4, 2), np.uint32))
    stream = cuda.stream()

    def run():   # four "layers", each its own barrier words, on one residual
        for i in range(4):
            g(xd, nw, pgq, pgs, pdq, pds, a, bars[i], stream)

    graph = CapturedGraph(stream, run, name="mlp4", programmatic=True)
    want = x.copy()
    xw, aw = cuda.to_device(x), cuda.to_device(np.zeros(inter, np.float16))
    bw = cuda.to_device(np.zeros(2, np.uint32))
    for _ in range(4):
        g(xw, nw, pgq, pgs, pdq, pds, aw, bw)
    cuda.synchronize()
    want = xw.copy_to_host()
    for rep in range(5):
        xd.copy_to_device(x)
        graph.replay()
        stream.synchronize()
        assert np.array_equal(xd.copy_to_host(), want), rep
    assert bars.copy_to_host()[:, 0].tolist() == [0, 0, 0, 0]


def test_fused_mlp_registers_on_the_device():
    g = make_mlp_gemv(CFG)
    k = g.kernel
    assert k.get_local_mem_per_thread() == 0 and k.get_regs_per_thread() <= 112
