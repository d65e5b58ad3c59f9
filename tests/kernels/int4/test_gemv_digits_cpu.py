"""The CUDA-core GEMV with its activations as digits (Tiling.i8, gemv_digits.py), without a
GPU: its PTX for sm_90 at the 7B's shapes, and every kind under the CUDA simulator against
fp64 (the kernel sums exactly in int32 what it staged at 2^-22 of a group's absmax, so it is
held to 2e-5 of the output's norm where the fp16 kernel is held to 2e-3)."""
from __future__ import annotations

import dataclasses
import re
import textwrap

import pytest

import ptx_util
from nq.kernels.int4 import gemv
from nq.kernels.int4.tiling import Tiling, check_tiling, default_tiling

SEVEN_B = {"qkv": (4608, 3584), "qkv_rope": (4608, 3584), "o_proj": (3584, 3584),
           "gate_up": (18944, 3584), "down": (3584, 18944)}
HEADS_7B = (28, 4, 128)


@pytest.mark.parametrize("kind", ["qkv_rope", "qkv", "o_proj"])
def test_i8_ptx_sm90(kind):
    """The 7B's default CUDA-core tiling with i8: dp4a where the fp16 kernel has its fmas (6 a
    weight word and row slot), the staging's prmt, no fp16 math in the loop, no local memory
    but qkv_rope's cosf/sinf words, and ptxas keeps it in registers."""
    n, k = SEVEN_B[kind]
    t = dataclasses.replace(default_tiling(kind, n, k, mma=False), i8=1)
    fn, sig = gemv.build_kernel(kind, n, k, t, 1e-6, HEADS_7B if kind == "qkv_rope" else None)
    bounds = {"launch_bounds": (t.threads, t.min_blocks)} if t.min_blocks else {}
    ptx = ptx_util.compile_ptx_sm90(fn, sig, **bounds)
    ptx_util.assert_uses(ptx, "dp4a.s32.s32", "prmt.b32", "ld.shared.v4.u32", "griddepcontrol.wait")
    assert "fma.rn.f16x2" not in ptx
    slots = 2 if kind == "qkv_rope" else t.rows
    assert ptx_util.count(ptx, "dp4a.s32.s32") % (16 * 6 * slots) == 0
    if kind == "qkv_rope":
        assert re.findall(r"__local_depot\d+\[(\d+)\]", ptx) == ["28"]
    else:
        ptx_util.assert_no_local_memory(ptx)
    if not ptx_util.have_ptxas():
        pytest.skip("no nvJitLink or ptxas here: the PTX checks above stand")
    regs, spill = ptx_util.ptxas_report(ptx)
    if spill and t.min_blocks:
        # this machine's ptxas needs more registers than the device's JIT (the 7B's qkv_rope:
        # 168 and 32 bytes of spill under its one-block cap here; test_gemv_gpu's
        # test_default_kernels_do_not_spill_on_the_device reads what runs): uncapped, none
        regs, spill = ptx_util.ptxas_report(ptx_util.compile_ptx_sm90(fn, sig))
    assert spill == 0


def test_i8_names_and_refusals():
    t = Tiling(ks=14, rows=2, threads=384, span=128, early=1)
    name0 = gemv.gemv_name("qkv_rope", 4608, 3584, t, 1e-6, HEADS_7B)
    name1 = gemv.gemv_name("qkv_rope", 4608, 3584, dataclasses.replace(t, i8=1), 1e-6, HEADS_7B)
    assert "i8" not in name0 and "i8" in name1       # i8=0 keeps the names before it
    assert dataclasses.replace(t, i8=1).tag().endswith("_i8")
    with pytest.raises(ValueError, match="i8 is 0"):
        check_tiling("qkv", 4608, 3584, Tiling(ks=14, i8=2))
    # the digits take 1.5x the fp16 staging: the 7B's down (K = 18944) fits 48 KB as fp16,
    # 37 KB, not as digits, 56 KB
    check_tiling("down", 128, 18944, Tiling(ks=1, threads=64))
    with pytest.raises(ValueError, match="static shared memory"):
        check_tiling("down", 128, 18944, Tiling(ks=1, threads=64, i8=1))


def test_the_default_takes_digits_where_they_fit():
    """NQ_I8=1 (the default) gives the CUDA-core qkv and qkv_rope their digits with a one-block
    register bound, unless the digits (1.5x the fp16 staging) pass static shared memory: then
    the fp16 form, which still fits, and never a tiling check_tiling refuses."""
    from nq.kernels.int4 import tiling
    if tiling.I8 == "0":
        pytest.skip("NQ_I8=0 in this environment: no digits by default")
    t = default_tiling("qkv_rope", 4608, 3584, mma=False)
    assert t.i8 == 1 and t.min_blocks == 1
    wide = default_tiling("qkv", 1024, 20480, mma=False)     # fp16 41.6 KB, digits 62.1 KB
    assert wide.i8 == 0
    check_tiling("qkv", 1024, 20480, wide)
    assert default_tiling("o_proj", 896, 896, mma=False).i8 == 0   # qkv's alone


SIM_SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    from numba import cuda
    sys.path.insert(0, "tests")
    import sim_warp
    sim_warp.patch_simulator()
    from nq.config import PRESETS
    from nq.kernels.int4 import launch
    from nq.kernels.int4.tiling import Tiling
    cfg, rng = PRESETS["7b"], np.random.default_rng(2)
    D = cuda.to_device
    EPS = cfg.rms_norm_eps

    rel = sim_warp.rel
    mk = lambda n, k: sim_warp.packed(rng, n, k, np.float64)   # noqa: E731

    def h64(x, nw):
        x = x.astype(np.float64)
        return x / np.sqrt(np.mean(x * x) + EPS) * nw.astype(np.float64)

    x = (rng.standard_normal(640) * 3).astype(np.float32); x[5] = 400.0; x[77] = -1e-5
    nw = (1 + 0.1 * rng.standard_normal(640)).astype(np.float16)
    # qkv: 5 groups over ks=2 (a short last step, 3 steps, early), N=40, two rows a thread
    g = launch.QkvGemv(cfg, 40, 640, 40, Tiling(ks=2, rows=2, threads=64, early=1, i8=1))
    qw, sc, wd = mk(40, 640); b = (0.1 * rng.standard_normal(40)).astype(np.float16)
    pq, ps = g.prepare([(qw, sc)]); out = D(np.full(40, np.nan, np.float32))
    g(D(x), D(nw), D(pq), D(ps), D(b), out)
    print("qkv", rel(out.copy_to_host(), wd @ h64(x, nw) + b.astype(np.float64)))
    # a non-finite input reaches every row (cvt.rni would make a NaN 0): NaN, then inf
    for bad in (np.nan, np.inf):
        xb = x.copy(); xb[300] = bad; out = D(np.zeros(40, np.float32))
        g(D(xb), D(nw), D(pq), D(ps), D(b), out)
        print(f"qkv_{bad}_finite_rows", float(np.isfinite(out.copy_to_host()).sum()))
    # gate_up: ks=3 (non-power-of-two lanes), no prefetch, fp16 output
    g = launch.GateUpGemv(cfg, 24, 640, 48, Tiling(ks=3, threads=64, prefetch=0, i8=1))
    (q1, s1, w1), (q2, s2, w2) = mk(24, 640), mk(24, 640)
    pq, ps = g.prepare([(q1, s1), (q2, s2)]); out = D(np.full(24, np.nan, np.float16))
    g(D(x), D(nw), D(pq), D(ps), out)
    gt, up = w1 @ h64(x, nw), w2 @ h64(x, nw)
    print("gate_up", rel(out.copy_to_host().astype(np.float64), gt / (1 + np.exp(-gt)) * up))
    # down: fp16 input with a large value, residual add, span 128 (ignored by i8)
    a = (rng.standard_normal(1152) * 2).astype(np.float16); a[7] = 3000.0
    g = launch.ResidualGemv("down", cfg, 16, 1152, 16, Tiling(ks=5, threads=64, span=128, i8=1))
    qw, sc, wd = mk(16, 1152); xr = rng.standard_normal(16).astype(np.float32)
    pq, ps = g.prepare([(qw, sc)]); xd = D(xr.copy())
    g(D(a), D(pq), D(ps), xd)
    dot = wd @ a.astype(np.float64)
    print("down", rel(xd.copy_to_host() - xr, dot))
    # o_proj: 5 groups over ks=3 lanes of 4 (one idle), two steps (the second short)
    g = launch.ResidualGemv("o_proj", cfg, 16, 640, 16, Tiling(ks=3, threads=64, i8=1))
    qw2, sc2, wd2 = mk(16, 640); a2 = a[:640].copy()
    pq, ps = g.prepare([(qw2, sc2)]); xd = D(xr.copy())
    g(D(a2), D(pq), D(ps), xd)
    print("o_proj", rel(xd.copy_to_host() - xr, wd2 @ a2.astype(np.float64)))
''')


@pytest.mark.slow
def test_i8_kernels_under_the_simulator():
    errs, stdout = ptx_util.run_under_simulator(SIM_SCRIPT, timeout=900)
    for name in ("qkv", "gate_up", "down", "o_proj"):
        # fp32 rounding of the group sums and of the outputs; gate_up's fp16 output: 2^-11
        tol = 6e-4 if name == "gate_up" else 2e-5
        assert errs[name] < tol, (name, errs[name], stdout)
    assert errs["qkv_nan_finite_rows"] == 0.0, stdout
    assert errs["qkv_inf_finite_rows"] == 0.0, stdout
