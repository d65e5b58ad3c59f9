"""The fused MLP kernel (nq/kernels/int4/gemv_mlp.py) without a GPU: its refusals, its sm_90
PTX at the 7B shape (the grid barrier's instructions, down's ring, no local memory, ptxas's
registers), and the kernel under the CUDA simulator -- phase 1 (gate_up, SwiGLU) and phase 2
(down through the ring) as two launches -- against the fp64 reference."""
import textwrap

import pytest

from nq.config import PRESETS
from nq.kernels.int4.gemv_mlp import (MlpTiling, build_mlp_kernel, check_mlp, mlp_grid,
                                      static_smem)

ptx_util = pytest.importorskip("ptx_util")
SEVEN_B = PRESETS["7b"]


def test_the_7b_grid_and_shared_memory():
    i, h, t = SEVEN_B.intermediate_size, SEVEN_B.hidden_size, MlpTiling()
    assert mlp_grid(i, h, t) == 132          # 1184 gate_up tiles, 9 a block; 224 down tiles, 2
    check_mlp(i, h, t, sms=132)
    assert static_smem(i, h, t) <= 48 * 1024  # gate_up's h, down's a, the partials
    with pytest.raises(ValueError, match="resident at once"):
        check_mlp(i, h, t, sms=114)           # an H100 PCIe: 132 blocks cannot all be resident
    with pytest.raises(ValueError, match="fewer slots"):
        check_mlp(i, h, MlpTiling(slots=12), sms=132)
    with pytest.raises(ValueError, match="down_tiles must divide"):
        check_mlp(i, h, MlpTiling(down_tiles=4), sms=132)
    with pytest.raises(ValueError, match="multiple of 64"):
        check_mlp(i, h, MlpTiling(threads=96), sms=132)


def test_the_7b_kernel_ptx_sm90():
    i, h, t = SEVEN_B.intermediate_size, SEVEN_B.hidden_size, MlpTiling()
    fn, sig = build_mlp_kernel(i, h, t, float(SEVEN_B.rms_norm_eps), mlp_grid(i, h, t))
    ptx = ptx_util.compile_ptx_sm90(fn, sig, launch_bounds=(t.threads,))
    ptx_util.assert_uses(ptx, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                         "atom.add.acq_rel.gpu.global.u32", "ld.acquire.gpu.global.u32",
                         "st.release.gpu.global.u32", "ld.global.cg.v4.u32",
                         "cp.async.bulk.shared::cluster.global", "mbarrier.try_wait.parity",
                         "griddepcontrol.wait")
    ptx_util.assert_no_local_memory(ptx)
    if not ptx_util.have_ptxas():
        pytest.skip("no nvJitLink or ptxas here: the PTX checks above stand")
    regs, spill = ptx_util.ptxas_report(ptx)
    assert spill == 0 and regs <= 112    # 576 threads a block, one block an SM


SIM_SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    from numba import cuda
    sys.path.insert(0, "tests")
    import sim_warp
    sim_warp.patch_simulator(syncwarp=True)
    from nq.config import ModelConfig
    from nq.kernels.int4.gemv_mlp import MlpTiling
    from nq.kernels.int4.launch import make_down_gemv, make_gate_up_gemv, make_mlp_gemv
    from nq.kernels.int4.tiling import MmaTiling
    from nq.loader.quant import dequantize_packed

    rng = np.random.default_rng(0)
    # (name, I, H, tiling): 2 gate_up tiles and 2 down tiles a block (2 warps each), down's 5
    # groups with 2 slots a warp (a refill, and an iteration past the end); 40 down tiles over
    # blocks of 3 (the last block's two spare tiles clamped, not written), 8 blocks' gate_up
    # tiles in a grid of 14 (six blocks with none), down's 3 groups with one slot a warp (each
    # slot refilled once, warp 1's second fill past the last group: only arrived on)
    for name, inter, hid, t in [("s2", 640, 256, MlpTiling(threads=128, slots=2)),
                                ("odd", 384, 640, MlpTiling(threads=192, down_tiles=3, slots=1,
                                                            l2ahead=0))]:
        cfg = ModelConfig(hidden_size=hid, intermediate_size=inter, num_layers=1,
                          num_heads=hid // 128, num_kv_heads=1, head_dim=128, vocab_size=64)
        gq = rng.integers(0, 2**32, size=(2 * inter, hid // 8), dtype=np.uint32)
        gs = rng.uniform(0.002, 0.02, size=(2 * inter, hid // 128)).astype(np.float16)
        dq = rng.integers(0, 2**32, size=(hid, inter // 8), dtype=np.uint32)
        ds = rng.uniform(0.002, 0.02, size=(hid, inter // 128)).astype(np.float16)
        x = rng.standard_normal(hid).astype(np.float32)
        nw = (1 + 0.1 * rng.standard_normal(hid)).astype(np.float16)
        gu = make_gate_up_gemv(cfg, MmaTiling(warps=2, threads=t.threads))   # rstd's order too
        dn = make_down_gemv(cfg, MmaTiling(warps=2, threads=128))
        pgq, pgs = gu.prepare([(gq[:inter], gs[:inter]), (gq[inter:], gs[inter:])])
        pdq, pds = dn.prepare([(dq, ds)])
        g = make_mlp_gemv(cfg, t)
        xd, a, bar = cuda.to_device(x), cuda.to_device(np.zeros(inter, np.float16)), \\
            cuda.to_device(np.zeros(2, np.uint32))
        args = (xd, cuda.to_device(nw), cuda.to_device(pgq), cuda.to_device(pgs),
                cuda.to_device(pdq), cuda.to_device(pds), a, bar)
        g(*args, phases=1)
        # phase 1 is gemv_mma's gate_up, bit for bit
        a_ref = cuda.to_device(np.zeros(inter, np.float16))
        gu(xd, args[1], args[2], args[3], a_ref)
        assert np.array_equal(a.copy_to_host(), a_ref.copy_to_host()), name
        g(*args, phases=2)
        got = xd.copy_to_host().astype(np.float64)
        x64 = x.astype(np.float64)
        h = x64 / np.sqrt(np.mean(x64 * x64) + cfg.rms_norm_eps) * nw.astype(np.float64)
        w = dequantize_packed(gq, gs).astype(np.float64)
        gt, up = w[:inter] @ h, w[inter:] @ h
        act = (gt / (1 + np.exp(-gt)) * up).astype(np.float16).astype(np.float64)
        want = dequantize_packed(dq, ds).astype(np.float64) @ act
        # down's sums against fp64 on the fp16 `a` the kernel wrote (phase 1 is checked above)
        want_a = dequantize_packed(dq, ds).astype(np.float64) @ a.copy_to_host().astype(np.float64)
        print(name, float(np.linalg.norm((got - x64) - want_a) / np.linalg.norm(want_a)), flush=True)
        print(name + "_swiglu", float(np.linalg.norm(want_a - want) / np.linalg.norm(want)), flush=True)
        assert bar.copy_to_host().tolist() == [0, 0], name   # the barrier only runs on the GPU
''')


@pytest.mark.slow
def test_fused_mlp_under_the_simulator():
    errs, stdout = ptx_util.run_under_simulator(SIM_SCRIPT, timeout=900)
    assert set(errs) == {"s2", "s2_swiglu", "odd", "odd_swiglu"}, stdout
    for name, e in errs.items():
        # down: fp16 a times small integers summed in fp32; SwiGLU's fp16 rounding of a
        assert e < (2e-3 if name.endswith("swiglu") else 1e-5), (name, e)
