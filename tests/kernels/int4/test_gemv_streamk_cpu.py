"""CPU tier for down as a stream-K GEMV into xacc (nq/kernels/int4/gemv_streamk.py): the split's
model (every unit once, a warp within two tiles), the refusals, the sm_90 PTX (its promises and
ptxas's registers at the 7B's, 14B's and 32B's shapes), and the kernel under the CUDA simulator
against float64 on grids whose warps cross tile boundaries, xacc's prior contents kept."""
import textwrap

import numpy as np
import pytest

from nq.kernels.int4 import gemv_streamk as sk
from nq.kernels.int4.tiling import MmaTiling

from ptx_util import (assert_no_local_memory, assert_uses, compile_ptx_sm90, count, have_ptxas,
                      ptxas_report, run_under_simulator)


@pytest.mark.parametrize("n,k,blocks,warps", [
    (3584, 18944, 132, 32), (5120, 13824, 132, 32), (5120, 27648, 264, 24), (48, 640, 2, 2),
    (896, 4864, 132, 32), (64, 384, 5, 3)])
def test_split_covers_every_unit_once(n, k, blocks, warps):
    u = sk.warp_units(n, k, blocks, warps).reshape(-1, 2)
    groups = k // 128
    assert u[0, 0] == 0 and u[-1, 1] == (n // 16) * groups
    assert (u[1:, 0] == u[:-1, 1]).all() and (u[:, 1] >= u[:, 0]).all()
    size = u[:, 1] - u[:, 0]
    assert size.max() - size.min() <= 1 + (blocks > 1)   # equal shares, to a unit or two
    touched = np.where(size > 0, (u[:, 1] - 1) // groups - u[:, 0] // groups + 1, 0)
    assert touched.max() <= 2


def test_refusals():
    with pytest.raises(ValueError, match="three tiles"):
        sk.check_streamk(64, 384, 32, 1)           # one warp, 12 units of 3-group tiles
    with pytest.raises(ValueError, match="multiple of 32"):
        sk.check_streamk(3584, 18944, 1000, 132)
    with pytest.raises(ValueError, match="multiple of 16"):
        sk.check_streamk(3580, 18944, 1024, 132)
    from nq.kernels.int4.gemv_mma import check_tiling
    with pytest.raises(ValueError, match="sk"):
        check_tiling("down", 3584, 18944, MmaTiling(warps=16, threads=1024, early=1, sk=1,
                                                    xacc=1))
    with pytest.raises(ValueError, match="sk"):
        check_tiling("o_proj", 3584, 3584, MmaTiling(warps=1, threads=1024, sk=1, xacc=1))
    t = sk.streamk_tiling(MmaTiling(warps=16, threads=1024, early=1, l2ahead=1, sk=1))
    check_tiling("down", 3584, 18944, t)
    assert t.tag() == "mma_w1_t1024_xacc_sk1"


@pytest.mark.parametrize("n,k,threads", [(3584, 18944, 1024), (5120, 13824, 1024),
                                         (5120, 27648, 1024)])
def test_streamk_ptx(n, k, threads):
    body, sig = sk.build_streamk(n, k, threads, 132)
    ptx = compile_ptx_sm90(body, sig, launch_bounds=(threads,))
    assert_uses(ptx, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", "griddepcontrol.wait",
                "griddepcontrol.launch_dependents", "red.relaxed.gpu.global.add.u64",
                "ld.global.nc.v4.u32")
    assert count(ptx, "red.relaxed.gpu.global.add.u64") == 1     # once a block and row
    assert "st.global" not in ptx                                # x is not written
    assert_no_local_memory(ptx)
    if have_ptxas():
        regs, spill = ptxas_report(ptx)
        assert regs <= 64 and spill == 0, (regs, spill)   # 1024 threads: one block an SM


SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    from numba import cuda
    sys.path.insert(0, "tests")
    import sim_warp
    sim_warp.patch_simulator(syncwarp=True)
    from nq.kernels.int4.gemv_streamk import reference_streamk, warp_units
    from nq.kernels.int4.launch import ResidualMmaGemv
    from nq.kernels.int4.tiling import MmaTiling
    from nq.loader.quant import dequantize_packed

    rng = np.random.default_rng(3)
    # (n, k, threads, sk, sms): warps whose units cross a tile boundary, warps with no unit,
    # two blocks an SM
    for n, k, threads, skn, sms in [(48, 640, 64, 1, 2), (64, 384, 96, 1, 5), (32, 1152, 64, 2, 1)]:
        units = warp_units(n, k, skn * sms, threads // 32).reshape(-1, 2)
        crossing = int(((units[:, 1] - 1) // (k // 128) != units[:, 0] // (k // 128)).sum())
        qw = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
        sc = rng.uniform(0.002, 0.02, size=(n, k // 128)).astype(np.float16)
        a = (rng.standard_normal(k) * 2).astype(np.float16)
        g = ResidualMmaGemv("down", n, k, MmaTiling(warps=1, threads=threads, xacc=1, sk=skn),
                            sms=sms)
        q_, s_ = g.prepare([(qw, sc)])
        prior = (rng.integers(-2**40, 2**40, n) * 4).astype(np.int64)
        xa = cuda.to_device(prior.view(np.uint32))
        x = np.full(n, np.nan, np.float32)
        xd = cuda.to_device(x)
        args = (cuda.to_device(a), cuda.to_device(q_), cuda.to_device(s_), xd)
        g(*args, xacc=xa)
        got = (xa.copy_to_host().view(np.int64) - prior).astype(np.float64) * 2.0 ** -32
        ref = reference_streamk(dequantize_packed(qw, sc), a.astype(np.float64))
        tag = f"{n}x{k}_t{threads}_b{skn * sms}"
        print("err_" + tag, float(np.abs(got - ref).max() / np.abs(ref).max()))
        print("crossing_" + tag, crossing)
        print("x_" + tag, float(np.isnan(xd.copy_to_host()).all()))
        g(*args, xacc=xa)     # again: the same sums added once more, bit for bit
        again = xa.copy_to_host().view(np.int64) - prior
        first = np.round(got * 2.0 ** 32).astype(np.int64)
        print("again_" + tag, float(np.abs(again - 2 * first).max()))
''')


@pytest.mark.slow
def test_streamk_under_the_simulator():
    """xacc gains W . a within 2e-6 of float64 (relative to its largest row), x untouched, a
    second launch adds the same integers; on grids where warps cross tile boundaries."""
    errs, stdout = run_under_simulator(SCRIPT, timeout=900)
    tags = [k[4:] for k in errs if k.startswith("err_")]
    assert len(tags) == 3, stdout
    assert sum(errs["crossing_" + t] for t in tags) > 0, stdout
    for t in tags:
        assert errs["err_" + t] < 2e-6, (t, stdout)
        assert errs["x_" + t] == 1.0, (t, stdout)
        assert errs["again_" + t] == 0.0, (t, stdout)


ROPE_SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    from numba import cuda
    sys.path.insert(0, "tests")
    import sim_warp
    sim_warp.patch_simulator(syncwarp=True)
    from nq.kernels import rope_kv as R
    from nq.kernels.int4 import launch
    from nq.kernels.int4.tiling import Tiling
    from nq.loader.quant import quantize_pack
    from nq.paged import PAGE, pool_shape
    from nq.runtime.kv_cache import make_state

    class Cfg:   # one q head of 64, K = 128 (test_gemv_cpu.py's d64 case)
        head_dim, hidden_size, num_heads, num_kv_heads = 64, 128, 1, 1
        q_size = kv_size = 64
        qkv_size, num_layers, rms_norm_eps, rope_theta = 192, 1, 1e-6, 1e6

    rng = np.random.default_rng(7)
    D = cuda.to_device
    cfg, k, pos = Cfg(), 128, 16
    words = (rng.integers(-2**40, 2**40, k) * 4).astype(np.int64).view(np.uint32)
    x = (rng.standard_normal(k) * 3).astype(np.float32)
    xe = x + words.view(np.int64).astype(np.float32) * np.float32(2.0 ** -32)
    nw = (1 + 0.1 * rng.standard_normal(k)).astype(np.float16)
    parts = [quantize_pack(rng.standard_normal((m, k)).astype(np.float32) * 0.05)
             for m in (64, 64, 64)]
    bias = (0.5 * rng.standard_normal(192)).astype(np.float16)
    inv = D(R.rope_inv_freq(64, cfg.rope_theta))
    table = D(np.arange(3, dtype=np.int32))
    outs = []
    for t, xx, extra in [(Tiling(rows=2, threads=128, ks=2), xe, {}),
                         (Tiling(rows=2, threads=128, ks=2, xacc=1), x, {"xacc": D(words)})]:
        g = launch.make_qkv_rope_gemv(cfg, t)
        pq, ps = g.prepare(parts)
        pool = D(np.full(pool_shape(cfg, 3)[1:], 7.0, np.float16))
        q = D(np.full(64, np.nan, np.float32))
        g(D(xx), D(nw), D(pq), D(ps), D(bias), make_state(pos=pos), inv, table, pool, q,
          **extra)
        outs.append((q.copy_to_host(), pool.copy_to_host()))
    print("rope_q", float(np.abs(outs[0][0] - outs[1][0]).max()))
    print("rope_kv", float(np.abs(outs[0][1].astype(np.float32) - outs[1][1]).max()))
    print("rope_finite", float(np.isfinite(outs[1][0]).all()))
''')


@pytest.mark.slow
def test_qkv_rope_with_xacc_under_the_simulator():
    """The CUDA-core qkv_rope with xacc (the step whose down is stream-K) bit for bit the
    kernel without it given x + xacc * 2^-32: q and the K/V slot."""
    errs, stdout = run_under_simulator(ROPE_SCRIPT, timeout=900)
    assert errs.get("rope_finite") == 1.0, stdout
    assert errs.get("rope_q") == 0.0 and errs.get("rope_kv") == 0.0, stdout


def test_qkv_rope_xacc_ptx_and_refusals():
    from nq.kernels.int4 import gemv
    from nq.kernels.int4.tiling import Tiling
    t = Tiling(ks=14, rows=2, threads=384, span=128, xacc=1)
    body, sig = gemv.build_kernel("qkv_rope", 4608, 3584, t, 1e-6, (28, 4, 128))
    ptx = compile_ptx_sm90(body, sig, launch_bounds=(384,))
    plain = compile_ptx_sm90(*gemv.build_kernel("qkv_rope", 4608, 3584, Tiling(
        ks=14, rows=2, threads=384, span=128), 1e-6, (28, 4, 128)), launch_bounds=(384,))
    # xacc's words: two 16-byte loads beside x's one, a group and lane
    assert count(ptx, "ld.global.nc.v4.u32") == count(plain, "ld.global.nc.v4.u32") + 2 * count(
        plain, "ld.global.nc.v4.f32")
    # (both kernels keep rope_setup's 28-byte local array, the default's as measured)
    if have_ptxas():
        (regs, spill), (regs0, _) = ptxas_report(ptx), ptxas_report(plain)
        assert spill == 0 and regs <= regs0 + 8, (regs, regs0)
    assert gemv.gemv_name("qkv_rope", 4608, 3584, t, 1e-6, (28, 4, 128)).endswith(
        "_xacc1_eps1em06_heads28_kv_heads4_head_dim128")
    assert "xacc" not in gemv.gemv_name("qkv_rope", 4608, 3584, Tiling(ks=14, rows=2), 1e-6,
                                        (28, 4, 128))
    with pytest.raises(ValueError, match="qkv_rope only"):
        gemv.build_kernel("gate_up", 256, 256, Tiling(ks=2, xacc=1), 1e-6)


def test_the_step_takes_stream_k_only_beside_the_cuda_core_qkv_rope():
    import dataclasses

    from nq.config import PRESETS
    from nq.kernels.int4.launch import gemv_tiling
    from nq.kernels.int4.tiling import mma_tiling
    from nq.runtime import step
    cfg = PRESETS["7b"]
    down = sk.streamk_tiling(dataclasses.replace(gemv_tiling("down", cfg), sk=1))
    rope_mma = mma_tiling("qkv_rope", cfg.qkv_size, cfg.hidden_size, cfg.head_dim)
    with pytest.raises(ValueError, match="CUDA-core qkv_rope"):
        step.stream_k(cfg, {"down": down}, rope_mma, True, True)
    with pytest.raises(ValueError, match="CUDA-core qkv_rope"):
        step.stream_k(cfg, {"down": down}, None, False, True)     # rope_kv's own kernel
    plain = dataclasses.replace(gemv_tiling("down", cfg), xacc=1)
    assert step.stream_k(cfg, {"down": plain}, None, True, False) == (None, None)
    tilings = {"down": dataclasses.replace(gemv_tiling("down", cfg), sk=1)}
    assert step.fused_o(cfg, 2, tilings) == 2
    assert tilings["down"].xacc and tilings["down"].sk == 1 and tilings["gate_up"].xacc
    # stream_k puts the stream-K form back before it refuses (or builds the fold, on a GPU)
    with pytest.raises(ValueError, match="CUDA-core qkv_rope"):
        step.stream_k(cfg, tilings, rope_mma, True, True)
    assert tilings["down"] == down
