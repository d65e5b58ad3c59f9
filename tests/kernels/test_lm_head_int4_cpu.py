"""The INT4 lm_head (nq/kernels/lm_head_int4.py: gemv.py's lm_head kind) under the CUDA
simulator, against its NumPy reference over the file layout's dequantised rows; its tiling,
name and refusals offline."""
import textwrap

import pytest

import ptx_util
from nq.config import PRESETS


def test_default_tiling_and_name():
    from nq.kernels.int4.gemv import gemv_name
    from nq.kernels.int4.tiling import core_staged_bytes
    from nq.kernels.lm_head_int4 import head_tiling
    cfg = PRESETS["7b"]
    t = head_tiling(cfg)
    assert t.i8 == 1 and t.rows == 1 and t.min_blocks >= 1   # exact sums where they fit
    assert core_staged_bytes(cfg.hidden_size, t) <= 48 * 1024
    assert gemv_name("lm_head", cfg.vocab_size, cfg.hidden_size, t, 1e-6).startswith(
        "gemv_int4_lm_head_n152064_k3584_")
    wide = head_tiling(PRESETS["32b"])     # 5120 wide: the digits still fit
    assert core_staged_bytes(PRESETS["32b"].hidden_size, wide) <= 48 * 1024


def test_the_default_kernel_compiles_for_sm90():
    from nq.kernels.int4.gemv import build_kernel
    from nq.kernels.lm_head_int4 import head_tiling
    cfg = PRESETS["7b"]
    body, sig = build_kernel("lm_head", cfg.vocab_size, cfg.hidden_size, head_tiling(cfg),
                             float(cfg.rms_norm_eps))
    ptx = ptx_util.compile_ptx_sm90(body, sig)
    assert "dp4a.s32.s32" in ptx and "griddepcontrol.wait" in ptx
    assert ptx.count("st.global.f32") >= 1 and "ld.global.nc.v4.u32" in ptx


SIM_SCRIPT = textwrap.dedent('''
    import dataclasses
    import sys
    import numpy as np
    from numba import cuda
    sys.path.insert(0, "tests")
    import sim_warp
    sim_warp.patch_simulator()
    from nq.kernels import lm_head_int4 as L
    from nq.kernels.int4.tiling import Tiling
    from nq.kernels.lm_head import make_lm_head
    rng = np.random.default_rng(0)
    D = cuda.to_device

    class C: vocab_size, hidden_size, rms_norm_eps = 70, 640, 1e-6   # 5 groups a row

    x = (rng.standard_normal(640) * 3).astype(np.float32); x[5] = 400.0
    nw = (1 + 0.1 * rng.standard_normal(640)).astype(np.float16)
    qw, sc, _ = sim_warp.packed(rng, 70, 640)
    sc[9] = 0                                   # a zero row
    ref = L.ref_lm_head_int4(x, nw, 1e-6, qw, sc)
    # 70 rows: the last row block part empty; grid 2 < the row blocks, so a block walks
    # several (the persistent loop, the next block's loads before this one's stores)
    for name, t, grid in (("digits", Tiling(ks=2, rows=1, threads=64, i8=1), 2),
                          ("digits_r2", Tiling(ks=3, rows=2, threads=32, i8=1, early=1), 2),
                          ("digits_one_pass", Tiling(ks=2, rows=1, threads=64, i8=1), 99),
                          ("fp16", Tiling(ks=2, rows=1, threads=64), 2)):
        head = L.LmHeadInt4(C, tiling=t, grid=grid)
        w = L.Int4Rows(*(D(a) for a in head.prepare(qw, sc)))
        out = D(np.full(70, np.nan, np.float32))
        head(D(x), D(nw), w, out)
        got = out.copy_to_host()
        assert np.isfinite(got).all() and got[9] == 0.0
        print(name, float(np.abs(got - ref).max() / np.abs(ref).max()))
    # the launcher the engine asks for picks this kernel for an Int4Rows weight
    head = make_lm_head(C, w, tiling=Tiling(ks=2, rows=1, threads=64, i8=1), grid=2)
    out = D(np.full(70, np.nan, np.float32))
    head(D(x), D(nw), w, out)
    print("dispatch", float(np.abs(out.copy_to_host() - ref).max() / np.abs(ref).max()))
    missed = 0
    for bad, what in ((L.Int4Rows(D(qw[:69].copy()), D(sc[:69].copy())), "qweight"),
                      (L.Int4Rows(w.qweight, D(sc.astype(np.float32))), "scales")):
        try:
            head(D(x), D(nw), bad, out)
            missed += 1
        except ValueError as e:
            missed += what not in str(e)
    print("refused", float(missed))
''')


@pytest.mark.slow
def test_kernel_under_the_simulator():
    errs, stdout = ptx_util.run_under_simulator(SIM_SCRIPT, timeout=900)
    assert set(errs) == {"digits", "digits_r2", "digits_one_pass", "fp16", "dispatch",
                         "refused"}, stdout
    # digits: each group's products summed exactly in int32, fp32 across groups (gemv_digits)
    for name in ("digits", "digits_r2", "digits_one_pass", "dispatch"):
        assert errs[name] < 5e-6, (name, errs[name])
    assert errs["fp16"] < 5e-3          # fp16 partial sums (gemv.py's module doc)
    assert errs["refused"] == 0.0
