"""The tensor-core residual GEMV (nq/kernels/int4/gemv_mma.py) without a GPU: its weight layout
against the mma fragment coordinates, its refusals, its sm_90 PTX, and the kernel itself under
the CUDA simulator against the NumPy reference."""
import textwrap

import numpy as np
import pytest

from nq.kernels.int4 import gemv as G
from nq.kernels.int4 import gemv_mma as M
from nq.loader.quant import pack_value_shuffle
from nq.ptx.mma import a_coords

ptx_util = pytest.importorskip("ptx_util")

# nibble slot of a word -> (A register, half) of the lane's fragment (module doc of gemv_mma)
SLOTS = {0: (0, 0), 4: (0, 1), 1: (1, 0), 5: (1, 1), 2: (2, 0), 6: (2, 1), 3: (3, 0), 7: (3, 1)}


def test_layout_is_the_a_fragment_of_every_lane():
    rng = np.random.default_rng(0)
    n, k = 32, 256
    q = rng.integers(-8, 8, (n, k)).astype(np.int8)
    words = M.mma_layout(pack_value_shuffle(q)).reshape(-1)
    g = k // 128
    for tile in range(n // 16):
        for grp in range(g):
            for lane in range(32):
                for i in range(8):          # the k16 chunk in the group
                    w = int(words[((tile * g + grp) * 32 + lane) * 8 + i])
                    for slot, (reg, half) in SLOTS.items():
                        r, c = a_coords(lane, reg, half)
                        nib = (w >> (4 * slot)) & 0xF
                        assert nib - 16 * (nib > 7) == q[tile * 16 + r, grp * 128 + i * 16 + c]


def test_layout_round_trip_and_refusals():
    rng = np.random.default_rng(1)
    p = rng.integers(0, 2**32, (48, 384 // 8), dtype=np.uint32)
    assert np.array_equal(M.mma_unlayout(M.mma_layout(p)), p)
    with pytest.raises(ValueError, match="multiple of 16"):
        M.mma_layout(p[:40])
    t = G.Tiling(ks=2, threads=128, mma=True)
    assert t.rows_per_block() == 32 and t.layout() == (-1, 16) and t.tag().endswith("_mma")
    with pytest.raises(ValueError, match="multiple of 32\\*ks"):
        M.build_kernel("down", 64, 256, G.Tiling(ks=3, threads=128, mma=True))
    with pytest.raises(ValueError, match="multiple of 16"):
        M.build_kernel("down", 40, 256, t)
    with pytest.raises(ValueError, match="not one of"):
        M.build_kernel("qkv", 64, 256, t)
    with pytest.raises(ValueError, match="gemv_int4's"):
        M.build_kernel("down", 64, 256, G.Tiling(ks=2, threads=128, mma=True, block_major=True))
    with pytest.raises(ValueError, match="prefetch 1 or 2"):
        M.build_kernel("down", 64, 256, G.Tiling(ks=2, threads=128, prefetch=0, mma=True))
    with pytest.raises(ValueError, match="not an mma tiling"):
        M.check_tiling(64, 256, G.Tiling(ks=2, threads=128))
    with pytest.raises(ValueError, match="splits must be 1..2"):
        M.build_kernel("down", 64, 256, G.Tiling(ks=1, threads=64, splits=3, mma=True))
    with pytest.raises(ValueError, match="splits is for o_proj and down"):
        M.build_kernel("gate_up", 64, 256, G.Tiling(ks=1, threads=64, splits=2, mma=True))
    with pytest.raises(ValueError, match="unsupported tiling"):   # gemv_int4 has no split-K
        G.build_kernel("down", 64, 256, G.Tiling(ks=2, splits=2), 1e-6)


@pytest.mark.parametrize("kind,n,k,tiling", [
    ("down", 3584, 18944, G.Tiling(ks=8, threads=512, mma=True)),
    ("o_proj", 3584, 3584, G.Tiling(ks=4, threads=256, mma=True)),
    ("gate_up", 18944, 3584, G.Tiling(ks=4, threads=256, mma=True)),
    ("down", 3584, 18944, G.Tiling(ks=16, threads=512, prefetch=2, mma=True)),
    ("down", 3584, 18944, G.Tiling(ks=8, threads=256, splits=4, mma=True)),
])
def test_mma_gemv_ptx_sm90(kind, n, k, tiling):
    fn, sig = M.build_kernel(kind, n, k, tiling)
    ptx = ptx_util.compile_ptx_sm90(fn, sig, launch_bounds=(tiling.threads,))
    ptx_util.assert_uses(ptx, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                         "ld.shared.v2.u32", "ld.global.nc.v4.u32", "lop3.b32",
                         "griddepcontrol.wait")
    ptx_util.assert_no_local_memory(ptx)
    if kind == "gate_up":
        ptx_util.assert_uses(ptx, "shfl.sync.bfly.b32", "st.global.u16", "ld.global.nc.v4.f32")
    if tiling.splits > 1:   # the arrival count and the release/acquire fences
        ptx_util.assert_uses(ptx, "atom.global.add", "membar.gl")
    # one mma and four lop3 per word, eight words a group
    assert ptx_util.count(ptx, "mma.sync.aligned.m16n8k16") % 8 == 0
    assert ptx_util.count(ptx, "lop3.b32") == 4 * ptx_util.count(ptx, "mma.sync.aligned.m16n8k16")
    try:
        regs, spill = ptx_util.ptxas_report(ptx)
    except Exception as e:  # noqa: BLE001 -- no nvJitLink/ptxas here: the PTX checks stand
        pytest.skip(f"no ptxas: {e}")
    assert spill == 0 and regs <= 128


SIM_SCRIPT = textwrap.dedent('''
    import numpy as np
    from numba import cuda
    from numba.cuda.simulator import kernelapi
    from nq.config import PRESETS
    from nq.kernels.int4 import gemv as G
    from nq.kernels.int4 import gemv_mma as M
    from nq.loader.quant import dequantize_packed
    from nq.ptx import _sim

    kernelapi.FakeCUDAModule.shfl_xor_sync = \\
        lambda self, mask, value, lanemask: _sim.warp_exchange(value)[_sim.lane_id() ^ lanemask]
    cfg, rng = PRESETS["7b"], np.random.default_rng(0)

    # (name, N, K, tiling): 2 tiles a block, 3 groups over 2 warps (warp 1's second iteration
    # is its second half, empty); 3 tiles over blocks of 2 (the last block's second tile is
    # clamped and not written); 4 warps a tile over 3 groups (one warp has none); prefetch 2:
    # 5 groups over 2 warps (warp 1's third group is past the end), and 8 groups on one warp
    # (three 3-group iterations, the last one short)
    for name, n, k, t in [("t2_kw2", 32, 384, G.Tiling(ks=2, threads=128, mma=True)),
                          ("tail", 48, 384, G.Tiling(ks=2, threads=128, mma=True)),
                          ("kw4", 16, 384, G.Tiling(ks=4, threads=128, mma=True)),
                          ("pf2", 32, 640, G.Tiling(ks=2, threads=128, prefetch=2, mma=True)),
                          ("pf2_kw1", 32, 1024, G.Tiling(ks=1, threads=64, prefetch=2, mma=True)),
                          # split-K: 5 groups over 3 splits of 2 (the last short), 3 tiles over
                          # blocks of 2 (a clamped tile); 8 groups over 2 splits, prefetch 2
                          ("sk3", 48, 640, G.Tiling(ks=1, threads=64, splits=3, mma=True)),
                          ("sk2_pf2", 32, 1024, G.Tiling(ks=2, threads=64, splits=2, prefetch=2,
                                                         mma=True))]:
        qw = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
        sc = rng.uniform(0.002, 0.02, size=(n, k // 128)).astype(np.float16)
        a = (rng.standard_normal(k) * 3).astype(np.float16)
        a[7] = 3000.0
        x = rng.standard_normal(n).astype(np.float32)
        g = M.ResidualMmaGemv("down", cfg, n, k, t)
        pq, ps = g.prepare([(qw, sc)])
        xd = cuda.to_device(x)
        g(cuda.to_device(a), cuda.to_device(pq), cuda.to_device(ps), xd)
        got = xd.copy_to_host().astype(np.float64)
        if t.splits > 1:   # a second launch: the counters were left at zero, the same bits
            xd2 = cuda.to_device(x)
            g(cuda.to_device(a), cuda.to_device(pq), cuda.to_device(ps), xd2)
            assert np.array_equal(xd2.copy_to_host(), xd.copy_to_host()), name
            assert not g._split[1].copy_to_host().any(), name
        ref = M.ref_residual(a, dequantize_packed(qw, sc).astype(np.float64), x.astype(np.float64))
        delta = got - x            # the dot products alone, against the reference's
        print(name, float(np.linalg.norm(delta - (ref - x)) / np.linalg.norm(ref - x)), flush=True)

    # gate_up: 2 tiles a block over 3 tiles (a clamped spare tile), 3 groups over 2 warps, a
    # "massive activation" channel in x (the per-group power-of-two staging keeps fp16 finite);
    # then the same with two groups' loads in flight (prefetch 2)
    for name, pf in [("gate_up", 1), ("gate_up_pf2", 2)]:
        n, k = 48, 384
        g = M.GateUpMmaGemv(cfg, n, k, G.Tiling(ks=2, threads=128, prefetch=pf, mma=True))
        parts = [(rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32),
                  rng.uniform(0.002, 0.02, size=(n, k // 128)).astype(np.float16)) for _ in range(2)]
        x = (rng.standard_normal(k) * 3).astype(np.float32)
        x[5] = 4.0e4
        nw = (1 + 0.1 * rng.standard_normal(k)).astype(np.float16)
        pq, ps = g.prepare(parts)
        out = cuda.to_device(np.full(n, np.nan, np.float16))
        g(cuda.to_device(x), cuda.to_device(nw), cuda.to_device(pq), cuda.to_device(ps), out)
        got = out.copy_to_host().astype(np.float64)
        ref = G.ref_gate_up(x, nw, cfg.rms_norm_eps, *(dequantize_packed(q, s) for q, s in parts))
        ok = np.isfinite(got).all()
        print(name, float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) if ok else float("inf"),
              flush=True)
''')


@pytest.mark.slow
def test_mma_gemv_under_the_simulator():
    """The kernel (each mma a 32-thread rendezvous in the simulator) against the reference.
    fp16 activations times small integers are exact in fp32; only fp32 summation remains."""
    errs, stdout = ptx_util.run_under_simulator(SIM_SCRIPT, timeout=900)
    assert set(errs) == {"t2_kw2", "tail", "kw4", "pf2", "pf2_kw1", "sk3", "sk2_pf2", "gate_up",
                         "gate_up_pf2"}, stdout
    for name, e in errs.items():
        # gate_up: its fp16 output rounds each element by up to 2^-11 (as gemv_int4's)
        assert e < (1e-3 if name.startswith("gate_up") else 1e-5), (name, e)
