"""CPU tier of the int8 lm_head (nq/kernels/lm_head_int8.py): the int8 -> fp32 conversion
on every byte value, sm_90 PTX without local memory (and the registers the launch bounds
allow), kernel names and refusals, and the kernel itself under the CUDA simulator against
the NumPy reference."""
import textwrap

import numpy as np
import pytest

from nq.config import PRESETS
from nq.kernels import lm_head_int8 as L
from nq.loader.quant import dequantize_int8_rows, quantize_int8_rows
from nq.ptx import mov_b32_f32_from_u32, prmt_b32

import ptx_util


def test_int8_to_f32_is_exact_for_every_byte():
    """The kernel's conversion (int8_to_f32x4), step by step through the twins of the
    instructions it emits, for all 256 byte values in each of the four byte positions."""
    vals = np.arange(-128, 128, dtype=np.int8)
    for shift in range(4):
        words = np.roll(vals.reshape(-1, 4), shift, axis=1).copy().view(np.uint32).reshape(-1)
        for w, want in zip(words, np.roll(vals.reshape(-1, 4), shift, axis=1)):
            u = np.uint32(w) ^ L.FLIP
            got = [np.float32(mov_b32_f32_from_u32.twin(prmt_b32.twin(u, L.MAGIC, sel)) - L.BIAS)
                   for sel in (L.SEL0, L.SEL1, L.SEL2, L.SEL3)]
            assert got == [np.float32(v) for v in want]


def test_reference_is_the_dequantised_gemv():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((40, 256)).astype(np.float32)
    q, s = quantize_int8_rows(w)
    x = rng.standard_normal(256).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(256)).astype(np.float16)
    got = L.ref_lm_head_int8(x, nw, 1e-6, q, s)
    from nq.kernels.lm_head import ref_lm_head
    np.testing.assert_array_equal(got, ref_lm_head(x, nw, 1e-6, dequantize_int8_rows(q, s)))


@pytest.mark.parametrize("size", ["7b", "0.5b", "32b"])
def test_ptx_sm90_has_no_local_memory(size):
    """The default tiling, with the launch bounds it is compiled with (256 threads, 4 blocks an
    SM: at most 64 registers), for the 7B, 0.5B and 32B shapes."""
    cfg = PRESETS[size]
    fn, sig = L.build_kernel(cfg.vocab_size, cfg.hidden_size, cfg.rms_norm_eps)
    ptx = ptx_util.compile_ptx_sm90(fn, sig, launch_bounds=(256, 4))
    ptx_util.assert_uses(ptx, "ld.global.nc.v4.u32", "ld.shared.v4.f32", "prmt.b32",
                         "cp.async.bulk.prefetch.L2", "griddepcontrol.wait",
                         "griddepcontrol.launch_dependents")
    ptx_util.assert_no_local_memory(ptx)
    chunks = min(2, -(-cfg.hidden_size // 16 // 32))      # 16-byte loads a row in the body (unroll 2)
    assert ptx_util.count(ptx, "ld.global.nc.v4.u32") == 2 * chunks
    assert ptx_util.count(ptx, "prmt.b32") == 2 * 16 * chunks
    if ptx_util.have_ptxas():
        regs, spill = ptx_util.ptxas_report(ptx)
        assert regs <= 64 and spill == 0, (regs, spill)


def test_kernel_names_and_refusals():
    eps = float(PRESETS["7b"].rms_norm_eps)
    assert (ptx_util.compiled_name(L.lm_head_int8_kernel, 152064, 3584, eps, 256, 4, 2, 4)
            == "lm_head_int8_v152064_k3584_t256_u4_r2_eps1em06")
    with pytest.raises(ValueError, match="multiple of 16"):
        L.build_kernel(100, 1000, 1e-6)
    with pytest.raises(ValueError, match="rows 3"):
        L.build_kernel(100, 1024, 1e-6, rows=3)
    with pytest.raises(ValueError, match="unroll 9"):
        L.build_kernel(100, 1024, 1e-6, unroll=9)
    with pytest.raises(ValueError, match="shared memory"):
        L.build_kernel(100, 16384, 1e-6)


SIM_SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    from numba import cuda
    sys.path.insert(0, "tests")
    import sim_warp
    sim_warp.patch_simulator()
    from nq.kernels import lm_head_int8 as L
    from nq.kernels.lm_head import make_lm_head
    rng = np.random.default_rng(0)
    D = cuda.to_device

    class C: vocab_size, hidden_size, rms_norm_eps = 37, 640, 1e-6   # odd vocab: a lone last row

    x = (rng.standard_normal(640) * 3).astype(np.float32); x[5] = 400.0
    nw = (1 + 0.1 * rng.standard_normal(640)).astype(np.float16)
    q = rng.integers(-128, 128, size=(37, 640), dtype=np.int8)   # every byte value, -128 too
    q[3] = 0
    s = (0.02 * rng.random(37)).astype(np.float32); s[3] = 0.0
    ref = L.ref_lm_head_int8(x, nw, 1e-6, q, s)
    w = L.Int8Rows(D(q), D(s))
    # 640 = 40 chunks a row: lanes 0-7 have a second chunk; unroll 1 takes two passes, 2 one
    for name, tiling in (("pairs", dict(threads=64, unroll=1, rows=2, grid=3)),
                         ("rows", dict(threads=32, unroll=2, rows=1, grid=2))):
        head = L.LmHeadInt8(C, **tiling)
        out = D(np.full(37, np.nan, np.float32))
        head(D(x), D(nw), w, out)
        got = out.copy_to_host()
        assert np.isfinite(got).all() and got[3] == 0.0
        print(name, float(np.abs(got - ref).max() / np.abs(ref).max()))
    # the launcher the engine asks for picks this kernel for an Int8Rows weight
    head = make_lm_head(C, w, threads=64, grid=3)
    out = D(np.full(37, np.nan, np.float32))
    head(D(x), D(nw), w, out)
    print("dispatch", float(np.abs(out.copy_to_host() - ref).max() / np.abs(ref).max()))
    missed = 0
    for bad, what in ((L.Int8Rows(D(q), D(s.astype(np.float16))), "scales"),
                      (L.Int8Rows(D(q.astype(np.int16)), D(s)), "qweight"),
                      (L.Int8Rows(D(q[:36].copy()), D(s[:36].copy())), "qweight")):
        try:
            head(D(x), D(nw), bad, out)
            missed += 1
        except ValueError as e:
            missed += what not in str(e)
    print("refused", float(missed))
''')


@pytest.mark.slow
def test_kernel_under_the_simulator():
    errs, stdout = ptx_util.run_under_simulator(SIM_SCRIPT, timeout=600)
    assert set(errs) == {"pairs", "rows", "dispatch", "refused"}, stdout
    # fp32 products of exact integers and fp32 h, fp32 sums: summation order and the scale
    # applied to the sum (not to each weight) differ from the reference at fp32 rounding
    for name in ("pairs", "rows", "dispatch"):
        assert errs[name] < 1e-6, (name, errs[name])
    assert errs["refused"] == 0.0
