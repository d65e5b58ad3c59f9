"""CPU tier for attn_o_proj (nq/kernels/attention/o_proj.py), the attention's merge and o_proj in
one kernel: its sm_90 PTX (the instructions it promises, ptxas's registers), its refusals, and
the kernel under the CUDA simulator against a float64 merge of the partials times the
dequantised weights, twice in a row (the counters put back, the second x bit for bit the
first's)."""
import textwrap

import pytest

from nq.kernels.attention import o_proj

from ptx_util import (assert_no_local_memory, assert_uses, compile_ptx_sm90, count, have_ptxas,
                      ptxas_report, run_under_simulator)


@pytest.mark.parametrize("n,k,d,hq,ms,tpw", [
    (3584, 3584, 128, 28, 33, 2),     # the 7B step's (33 splits a kv head, one wave)
    (5120, 5120, 128, 40, 33, 4),     # the 14B / 32B width
    (896, 896, 64, 14, 66, 1),        # the 0.5B: a K group is two heads
])
def test_o_proj_ptx(n, k, d, hq, ms, tpw):
    body = o_proj.o_proj_body(n, k, d, hq, ms, 2, tpw)
    ptx = compile_ptx_sm90(body, o_proj.O_SIG, launch_bounds=(256,), fastmath=True)
    assert_uses(ptx, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", "griddepcontrol.wait",
                "griddepcontrol.launch_dependents", "atom.add.acq_rel.gpu.global.u32",
                "ld.global.cg.v4.u32", "ld.global.nc.v4.u32",
                "ex2.approx")
    # a warp's tiles, one group each: 8 mma a tile, written out
    assert count(ptx, "mma.sync.aligned.m16n8k16") == 8 * tpw
    assert_no_local_memory(ptx)
    if not have_ptxas():
        pytest.skip("no nvJitLink or ptxas here: the PTX checks above stand")
    regs, spill = ptxas_report(ptx)
    assert spill == 0 and regs <= 128, (regs, spill)


@pytest.mark.parametrize("n,k,d,hq,ms,tpw", [
    (3584, 3584, 128, 28, 33, 2),     # the 7B step's
    (896, 896, 64, 14, 66, 1),        # the 0.5B's
])
def test_o_proj_i8_ptx(n, k, d, hq, ms, tpw):
    # attn.o_i8: o staged as digits (byte stores), 4 k32 mmas a tile, the acc form's red.add
    body = o_proj.o_proj_body(n, k, d, hq, ms, 2, tpw, True, True)
    ptx = compile_ptx_sm90(body, o_proj.O_SIG_ACC, launch_bounds=(256,), fastmath=True)
    assert_uses(ptx, "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32", "st.shared.u8",
                "cvt.rni.s32.f32", "red.relaxed.gpu.global.add.u64")
    assert count(ptx, "mma.sync.aligned.m16n8k32") == 4 * tpw
    assert count(ptx, "mma.sync.aligned.m16n8k16") == 0
    assert_no_local_memory(ptx)
    assert o_proj.o_proj_name(n, k, d, hq, ms, 2, tpw, True, True).endswith("_acc1_i81")
    if not have_ptxas():
        pytest.skip("no nvJitLink or ptxas here: the PTX checks above stand")
    regs, spill = ptxas_report(ptx)
    assert spill == 0 and regs <= 128, (regs, spill)


def test_o_proj_refusals():
    with pytest.raises(ValueError, match="num_heads \\* head_dim"):
        o_proj.check_o_proj(3584, 3584, 128, 27, 2)
    with pytest.raises(ValueError, match="head_dim 96"):
        o_proj.check_o_proj(3072, 3072, 96, 32, 2)
    with pytest.raises(ValueError, match="tpw=5"):
        o_proj.check_o_proj(3584, 3584, 128, 28, 5)
    assert o_proj.n_chunks(3584, 2) == 14 and o_proj.chunk_rows(2) == 256


SIM_SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    from numba import cuda
    sys.path.insert(0, "tests")
    import sim_warp
    sim_warp.patch_simulator(syncwarp=True)
    from types import SimpleNamespace
    from nq.kernels.attention.o_proj import make_o_proj_launcher
    from nq.kernels.int4.launch import ResidualMmaGemv
    from nq.kernels.int4.tiling import MmaTiling
    from nq.loader.quant import dequantize_packed
    from nq.paged import PAGE, STATE_LEN, STATE_POS

    rng = np.random.default_rng(0)
    # (name, N, head_dim, heads, max_splits, min_pps, tokens, tpw): two K groups of one head;
    # four heads of 64 (two a group); a plan shorter than the grid (rows past it read row 0 and
    # weigh 0); the last chunk partly past N (tiles clamped, rows not stored or folded)
    # each also with i8 (o as digits on the int8 tensor cores: name_i8)
    cases = [("d128", 64, 128, 2, 5, 1, 5 * PAGE, 1),
             ("d64", 64, 64, 4, 3, 1, 40, 2),
             ("short_plan", 32, 128, 2, 9, 2, 3 * PAGE, 1),
             ("ragged", 48, 128, 2, 4, 1, 4 * PAGE, 2)]
    for (name, n, d, hq, ms, minp, tokens, tpw), i8 in [(c, i) for i in (0, 1) for c in cases]:
        name += "_i8" if i8 else ""
        k = hq * d
        cfg = SimpleNamespace(hidden_size=n, num_heads=hq, head_dim=d)
        qw = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
        sc = rng.uniform(0.002, 0.02, size=(n, k // 128)).astype(np.float16)
        pq, ps = ResidualMmaGemv("o_proj", n, k, MmaTiling(warps=1, threads=32)).prepare(
            [(qw, sc)])
        acc = rng.standard_normal((ms, hq, d)).astype(np.float32) * 4
        ml = np.stack([rng.uniform(-3, 3, (ms, hq)), rng.uniform(0.5, 4, (ms, hq))],
                      -1).astype(np.float32)
        state = np.zeros(STATE_LEN, np.int32)
        state[STATE_POS] = tokens - 1
        n_pages = -(-tokens // PAGE)
        pps = max(minp, -(-n_pages // ms))
        ns = -(-n_pages // pps)
        acc[ns:] = np.nan     # past the plan: never weighed in (a NaN would show)
        m = ml[:ns, :, 0].astype(np.float64)
        wgt = np.exp2(m - m.max(0))
        o = (acc[:ns] * wgt[..., None]).sum(0) / (ml[:ns, :, 1] * wgt).sum(0)[:, None]
        o16 = o.reshape(-1).astype(np.float16).astype(np.float64)
        x = rng.standard_normal(n).astype(np.float32)
        ref = dequantize_packed(qw, sc).astype(np.float64) @ o16
        xd = cuda.to_device(x)
        launch = make_o_proj_launcher(cfg, cuda.to_device(state), cuda.to_device(acc),
                                      cuda.to_device(ml), xd, minp, tpw, i8=bool(i8))
        dq, ds = cuda.to_device(pq), cuda.to_device(ps)
        launch(dq, ds)
        got = xd.copy_to_host()
        print(name, float(np.linalg.norm((got - x) - ref) / np.linalg.norm(ref)), flush=True)
        xd.copy_to_device(x)
        launch(dq, ds)                      # the counters are back at 0: the same x again
        print(name + "_again", float(np.abs(xd.copy_to_host() - got).max()), flush=True)
''')


@pytest.mark.slow
def test_o_proj_under_the_simulator():
    """fp16 o times small integers is exact in fp32; the merge's exp2 and fp32 sums remain,
    and o's fp16 rounding, which the reference repeats.  With i8 the fp16 o is exact in its
    digits (22 bits of the group's absmax) and the sums exact in int32: the same bound."""
    errs, stdout = run_under_simulator(SIM_SCRIPT, timeout=900)
    names = [n + i for n in ("d128", "d64", "short_plan", "ragged") for i in ("", "_i8")]
    assert set(errs) == set(names) | {n + "_again" for n in names}, stdout
    for name in names:
        assert errs[name] < 2e-5, (name, errs[name])
        assert errs[name + "_again"] == 0.0, (name, errs[name + "_again"])


def test_split_trigger_ptx():
    """`trigger`: the split kernel launches its dependents (attn_o_proj) at its start -- one
    griddepcontrol.launch_dependents, none without it; its name says so."""
    from nq.kernels.attention import decode, launch
    args = (7, 128, 4, 4, 4, 2, 33, 2, True)
    on = compile_ptx_sm90(decode.split_body(*args, ppc=2, tma=True, trigger=True),
                          decode.SPLIT_SIG_TMA, fastmath=True)
    off = compile_ptx_sm90(decode.split_body(*args, ppc=2, tma=True), decode.SPLIT_SIG_TMA,
                           fastmath=True)
    assert count(on, "griddepcontrol.launch_dependents") == 1
    assert count(off, "griddepcontrol.launch_dependents") == 0
    assert launch.split_name(*args, ppc=2, tma=True, trigger=True).endswith("_tma1_trig1")


XACC_SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    from numba import cuda
    sys.path.insert(0, "tests")
    import sim_warp
    sim_warp.patch_simulator(syncwarp=True)
    from types import SimpleNamespace
    from nq.kernels.attention.o_proj import make_o_proj_launcher, xacc_workspace
    from nq.kernels.int4.launch import GateUpMmaGemv, ResidualMmaGemv
    from nq.kernels.int4.tiling import MmaTiling
    from nq.loader.quant import dequantize_packed
    from nq.paged import PAGE, STATE_LEN, STATE_POS

    rng = np.random.default_rng(1)

    def fixed(words):   # xacc's int64s as fp32 units of x, as the kernels convert them
        v = words.view(np.int64).astype(np.float32)
        return v * np.float32(2.0 ** -32)

    # attn_o_proj's acc form: the heads' shares as int64 in units of 2^-32, x untouched
    n, d, hq, ms, minp, tokens = 64, 128, 2, 5, 1, 5 * PAGE
    k = hq * d
    cfg = SimpleNamespace(hidden_size=n, num_heads=hq, head_dim=d)
    qw = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    sc = rng.uniform(0.002, 0.02, size=(n, k // 128)).astype(np.float16)
    pq, ps = ResidualMmaGemv("o_proj", n, k, MmaTiling(warps=1, threads=32)).prepare([(qw, sc)])
    acc = rng.standard_normal((ms, hq, d)).astype(np.float32) * 4
    ml = np.stack([rng.uniform(-3, 3, (ms, hq)), rng.uniform(0.5, 4, (ms, hq))],
                  -1).astype(np.float32)
    state = np.zeros(STATE_LEN, np.int32)
    state[STATE_POS] = tokens - 1
    m = ml[:, :, 0].astype(np.float64)
    wgt = np.exp2(m - m.max(0))
    o = (acc * wgt[..., None]).sum(0) / (ml[:, :, 1] * wgt).sum(0)[:, None]
    o16 = o.reshape(-1).astype(np.float16).astype(np.float64)
    ref = dequantize_packed(qw, sc).astype(np.float64) @ o16
    x = rng.standard_normal(n).astype(np.float32)
    xd, xa = cuda.to_device(x), xacc_workspace(n)
    launch = make_o_proj_launcher(cfg, cuda.to_device(state), cuda.to_device(acc),
                                  cuda.to_device(ml), xd, minp, 2, xa)
    launch(cuda.to_device(pq), cuda.to_device(ps))
    print("acc", float(np.linalg.norm(fixed(xa.copy_to_host()) - ref) / np.linalg.norm(ref)))
    print("acc_x", float(np.abs(xd.copy_to_host() - x).max()))

    # gate_up with xacc: bit for bit gate_up of x + xacc * 2^-32; down with xacc: bit for bit
    # down of that x, and xacc zeroed
    n, k = 32, 384
    words = (rng.integers(-2**40, 2**40, k) * 4).astype(np.int64).view(np.uint32)
    x = (rng.standard_normal(k) * 2).astype(np.float32)
    xe = x + fixed(words)
    nw = (1 + 0.2 * rng.standard_normal(k)).astype(np.float16)
    qw = rng.integers(0, 2**32, size=(2 * n, k // 8), dtype=np.uint32)
    sc = rng.uniform(0.002, 0.02, size=(2 * n, k // 128)).astype(np.float16)
    ecfg = SimpleNamespace(rms_norm_eps=1e-6)
    outs = []
    for t, xx, extra in [(MmaTiling(warps=2, threads=128), xe, {}),
                         (MmaTiling(warps=2, threads=128, xacc=1), x,
                          {"xacc": cuda.to_device(words)}),
                         (MmaTiling(warps=2, threads=128, i8=1), xe, {}),
                         (MmaTiling(warps=2, threads=128, xacc=1, i8=1), x,
                          {"xacc": cuda.to_device(words)})]:
        g = GateUpMmaGemv(ecfg, n, k, t)
        gq, gs = g.prepare([(qw[:n], sc[:n]), (qw[n:], sc[n:])])
        out = cuda.to_device(np.full(n, np.nan, np.float16))
        g(cuda.to_device(xx), cuda.to_device(nw), cuda.to_device(gq), cuda.to_device(gs), out,
          **extra)
        outs.append(out.copy_to_host())
    print("gate_up_xacc", float(np.abs(outs[0].astype(np.float64) - outs[1]).max()))
    print("gate_up_xacc_i8", float(np.abs(outs[2].astype(np.float64) - outs[3]).max()))
    k2, n2 = 384, 64
    a = (rng.standard_normal(k2) * 3).astype(np.float16)
    words2 = (rng.integers(-2**40, 2**40, n2) * 4).astype(np.int64).view(np.uint32)
    x2 = rng.standard_normal(n2).astype(np.float32)
    dq = rng.integers(0, 2**32, size=(n2, k2 // 8), dtype=np.uint32)
    dsc = rng.uniform(0.002, 0.02, size=(n2, k2 // 128)).astype(np.float16)
    res = []
    for t, xx in [(MmaTiling(warps=2, threads=128), x2 + fixed(words2)),
                  (MmaTiling(warps=2, threads=128, xacc=1), x2),
                  (MmaTiling(warps=2, threads=128, early=1, xacc=1), x2),
                  (MmaTiling(warps=2, threads=128, i8=1), x2 + fixed(words2)),
                  (MmaTiling(warps=2, threads=128, early=1, xacc=1, i8=1), x2)]:
        g = ResidualMmaGemv("down", n2, k2, t)
        q_, s_ = g.prepare([(dq, dsc)])
        xdev = cuda.to_device(xx)
        wa = cuda.to_device(words2)
        g(cuda.to_device(a), cuda.to_device(q_), cuda.to_device(s_), xdev,
          **({"xacc": wa} if t.xacc else {}))
        res.append(xdev.copy_to_host())
        if t.xacc:
            print("down_xacc_zeroed_" + str(t.early) + ("_i8" if t.i8 else ""),
                  float(np.abs(wa.copy_to_host()).max()))
    print("down_xacc", float(np.abs(res[0].astype(np.float64) - res[1]).max()))
    print("down_xacc_early", float(np.abs(res[0].astype(np.float64) - res[2]).max()))
    print("down_xacc_i8", float(np.abs(res[3].astype(np.float64) - res[4]).max()))
''')


@pytest.mark.slow
def test_xacc_forms_under_the_simulator():
    """attn_o_proj's acc form within 2e-5 of float64 in xacc (x untouched); gate_up and down
    with xacc bit for bit the kernels without it given x + xacc * 2^-32 (with i8 too); down
    zeroes xacc."""
    errs, stdout = run_under_simulator(XACC_SCRIPT, timeout=900)
    assert errs.get("acc", 1.0) < 2e-5 and errs.get("acc_x") == 0.0, stdout
    for name in ("gate_up_xacc", "down_xacc", "down_xacc_early", "down_xacc_zeroed_0",
                 "down_xacc_zeroed_1", "gate_up_xacc_i8", "down_xacc_i8",
                 "down_xacc_zeroed_1_i8"):
        assert errs.get(name) == 0.0, (name, stdout)
