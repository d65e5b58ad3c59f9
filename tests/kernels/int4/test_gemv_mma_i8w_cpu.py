"""i8=2 (`MmaTiling.i8 == 2`, gemv_mma_stage.put_digit_words) without a GPU: the staging lane
(c, t) takes the four values of one B word and stores each plane's word whole, where i8=1
stores a byte a value and plane from four lanes.  The bytes in shared memory are the same, so
every kernel must give i8=1's output bit for bit; the PTX must hold the word stores and none
of the byte stores."""
import textwrap

import pytest

from nq.kernels.int4 import gemv_mma
from nq.kernels.int4.tiling import MmaTiling

ptx_util = pytest.importorskip("ptx_util")


@pytest.mark.parametrize("kind,n,k,t", [
    ("gate_up", 18944, 3584, MmaTiling(warps=2, threads=576, l2ahead=1, xacc=1, i8=2)),   # 7B
    ("down", 3584, 18944, MmaTiling(warps=16, threads=1024, early=1, xacc=1, i8=2)),     # 7B
    ("o_proj", 3584, 3584, MmaTiling(warps=14, threads=448, i8=2)),
])
def test_i8_words_ptx_sm90(kind, n, k, t):
    fn, sig = gemv_mma.build_kernel(kind, n, k, t, 1e-6 if kind == "gate_up" else None)
    ptx = ptx_util.compile_ptx_sm90(fn, sig, launch_bounds=(t.threads,))
    ptx_util.assert_uses(ptx, "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32",
                         "cvt.rni.s32.f32", "prmt.b32", "st.shared.u32")
    ptx_util.assert_no_local_memory(ptx)
    assert ptx_util.count(ptx, "st.shared.u8") == 0            # no byte a digit
    assert ptx_util.count(ptx, "ld.global.nc.u32") >= 2        # a pair at 2t, one at 2t + 8
    # six prmt a lane's four values: two pairs' hi + mid, two pairs' lo, three words of them
    assert ptx_util.count(ptx, "prmt.b32") % 7 == 0
    with pytest.raises(ValueError, match="i8=3"):
        gemv_mma.build_kernel(kind, n, k, MmaTiling(t.warps, t.threads, i8=3),
                              1e-6 if kind == "gate_up" else None)
    ptx_util.assert_one_block_an_sm(ptx, t.threads)


SIM_SCRIPT = textwrap.dedent('''
    import sys
    from types import SimpleNamespace
    import numpy as np
    from numba import cuda
    sys.path.insert(0, "tests")
    import sim_warp
    sim_warp.patch_simulator(syncwarp=True)
    from nq.kernels.int4.launch import GateUpMmaGemv, ResidualMmaGemv
    from nq.kernels.int4.tiling import MmaTiling

    rng = np.random.default_rng(3)
    cfg = SimpleNamespace(rms_norm_eps=1e-6)

    def same(name, a, b):
        print(name, float(np.abs(a.astype(np.float64) - b).max()
                          if np.isfinite(a).all() and np.isfinite(b).all() else 1.0))

    # gate_up: 2 tiles a block, 3 groups over 2 warps; 3 tiles over blocks of 2 with l2ahead;
    # one warp a tile over 5 groups (2 staging rounds); with xacc (x + xacc * 2^-32 staged)
    for name, n, k, fields in [("gate_up", 32, 384, dict(warps=2, threads=128)),
                               ("gate_up_tail", 48, 640, dict(warps=2, threads=128, l2ahead=3)),
                               ("gate_up_w1", 32, 640, dict(warps=1, threads=64)),
                               ("gate_up_xacc", 32, 384, dict(warps=2, threads=128, xacc=1))]:
        qw = rng.integers(0, 2**32, size=(2 * n, k // 8), dtype=np.uint32)
        sc = rng.uniform(0.002, 0.02, size=(2 * n, k // 128)).astype(np.float16)
        x = (rng.standard_normal(k) * 2).astype(np.float32)
        x[7] = 900.0
        nw = (1 + 0.2 * rng.standard_normal(k)).astype(np.float16)
        words = (rng.integers(-2**40, 2**40, k) * 4).astype(np.int64).view(np.uint32)
        outs = []
        for form in (1, 2):
            t = MmaTiling(i8=form, **fields)
            g = GateUpMmaGemv(cfg, n, k, t)
            pq, ps = g.prepare([(qw[:n], sc[:n]), (qw[n:], sc[n:])])
            out = cuda.to_device(np.full(n, np.nan, np.float16))
            g(cuda.to_device(x), cuda.to_device(nw), cuda.to_device(pq), cuda.to_device(ps), out,
              **({"xacc": cuda.to_device(words)} if t.xacc else {}))
            outs.append(out.copy_to_host())
        same(name, *outs)

    # down and o_proj: 5 groups over 2 warps; early's slots; the digits in dynamic shared
    # memory with early's slots after them (3 bytes a value past 48 KB); down with xacc
    for name, kind, n, k, fields in [
            ("down", "down", 32, 640, dict(warps=2, threads=128)),
            ("down_early", "down", 48, 640, dict(warps=2, threads=128, early=2)),
            ("down_dyn_early", "down", 16, 16512, dict(warps=4, threads=128, early=1)),
            ("down_xacc", "down", 32, 384, dict(warps=2, threads=128, early=1, xacc=1)),
            ("o_proj", "o_proj", 32, 2048, dict(warps=8, threads=256))]:
        qw = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
        sc = rng.uniform(0.002, 0.02, size=(n, k // 128)).astype(np.float16)
        a = (rng.standard_normal(k) * 3).astype(np.float16)
        a[7] = 3000.0
        x = rng.standard_normal(n).astype(np.float32)
        words = (rng.integers(-2**40, 2**40, n) * 4).astype(np.int64).view(np.uint32)
        outs = []
        for form in (1, 2):
            t = MmaTiling(i8=form, **fields)
            g = ResidualMmaGemv(kind, n, k, t)
            pq, ps = g.prepare([(qw, sc)])
            xd = cuda.to_device(x)
            g(cuda.to_device(a), cuda.to_device(pq), cuda.to_device(ps), xd,
              **({"xacc": cuda.to_device(words)} if t.xacc else {}))
            outs.append(xd.copy_to_host())
        same(name, *outs)
''')


@pytest.mark.slow
def test_i8_words_equal_i8_bytes_under_the_simulator():
    """gate_up (with l2ahead, one warp a tile, xacc), down (early, the digits in dynamic shared
    memory, xacc) and o_proj with i8=2: bit for bit their i8=1 outputs (the same digits in the
    same bytes, the same sums).  test_gemv_mma_cpu's simulator test checks that a non-finite
    activation turns every row NaN with either form."""
    errs, stdout = ptx_util.run_under_simulator(SIM_SCRIPT, timeout=900)
    names = {"gate_up", "gate_up_tail", "gate_up_w1", "gate_up_xacc", "down", "down_early",
             "down_dyn_early", "down_xacc", "o_proj"}
    assert set(errs) == names, stdout
    for name in names:
        assert errs[name] == 0.0, (name, stdout)
