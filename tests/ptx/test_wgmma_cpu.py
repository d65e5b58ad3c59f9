"""nq/ptx/wgmma.py without a GPU: the descriptor encoding, the shared-memory layout model, the
twins under the simulator (data movement only: the twins run each wgmma at once), and the
wrappers compiled for sm_90a with ptxas accepting them."""
import textwrap

import numpy as np
import pytest

import nq.ptx as P
from nq.ptx import wgmma as G

ptx_util = pytest.importorskip("ptx_util")


def test_descriptor_fields_round_trip():
    for lbo, sbo, sw, addr in [(16, 1024, G.SWIZZLE_128B, 0x1_0400), (128, 512, G.SWIZZLE_NONE, 0x30),
                               (4096, 256, G.SWIZZLE_64B, 0x3FFF0), (0, 0, G.SWIZZLE_32B, 0)]:
        d = G.desc_hi(lbo, sbo, sw) | G.desc_lo(addr)
        assert G.desc_fields(d) == (addr & 0x3FFF0, lbo, sbo, sw)
        assert d >> 62 == sw and (d >> 49) & 7 == 0
    with pytest.raises(ValueError, match="multiple of 16"):
        G.desc_hi(8, 1024, G.SWIZZLE_128B)
    with pytest.raises(ValueError, match="swizzle"):
        G.desc_hi(16, 1024, 4)
    with pytest.raises(ValueError, match="multiple of 8"):
        G.wgmma_rs(12)


def test_layout_model_is_a_bijection_and_128b_is_the_gemm_swizzle():
    """Swizzle none: a 64 x 16 operand with LBO 128, SBO 256 fills 2 KB exactly.  128B: row r's
    16-byte chunk c (k 8c..8c+7 of its 128-byte row) lands at chunk c ^ (r % 8), the placement
    the GEMM's cp.async plan writes; the k16 step j starts 32 j bytes into the row."""
    r, k = np.meshgrid(np.arange(64), np.arange(16), indexing="ij")
    a = G.smem_offset(r, k, 128, 256, G.SWIZZLE_NONE)
    assert sorted(a.reshape(-1).tolist()) == list(range(0, 2048, 2))
    for j in range(4):
        a = G.smem_offset(r, k, 16, 1024, G.SWIZZLE_128B, start=32 * j)
        kk = 16 * j + k
        want = (r // 8) * 1024 + (r % 8) * 128 + 16 * ((kk // 8) ^ (r % 8)) + (kk % 8) * 2
        assert np.array_equal(a, want)


@pytest.mark.slow
def test_twins_under_the_simulator():
    """The probe (tests/wgmma_probe.py) under the simulator: host layout, kernel descriptors and
    twins agree with NumPy for both forms and both swizzles (N = 16: the twin is slow)."""
    script = textwrap.dedent("""
        import sys; sys.path.insert(0, "tests")
        import numpy as np
        import wgmma_probe as W
        for form in ("rs", "ss"):
            for sw in (0, 1):
                got, want = W.run(16, form, sw, seed=sw)
                print(f"{form}{sw}", float(np.abs(got - want).max()))
        """)
    values, out = ptx_util.run_under_simulator(script, timeout=300)
    assert values == {"rs0": 0.0, "rs1": 0.0, "ss0": 0.0, "ss1": 0.0}, out


@pytest.mark.skipif(P.SIMULATOR, reason="the simulator compiles nothing")
@pytest.mark.parametrize("form", ["rs", "ss"])
def test_compiles_for_sm90a_and_ptxas_accepts(form, capsys):
    import wgmma_probe as W
    body, sig = W.build_kernel(128, form, G.SWIZZLE_128B)
    ptx = ptx_util.compile_ptx_sm90(body, sig, cc=ptx_util.SM90A)
    assert ".target sm_90a" in ptx
    ptx_util.assert_uses(ptx, "wgmma.fence.sync.aligned", "wgmma.commit_group.sync.aligned",
                         "wgmma.wait_group.sync.aligned",
                         "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16")
    assert ptx_util.count(ptx, "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16") == 2
    ptx_util.assert_no_local_memory(ptx)
    if not ptx_util.have_ptxas():
        pytest.skip("no ptxas / nvJitLink here")
    log = ptx_util.ptxas_log(ptx)
    regs, spills = ptx_util.ptxas_report(ptx)
    with capsys.disabled():
        print(f"\nwgmma probe {form} m64n128k16: {regs} registers, {spills} spill bytes")
    assert spills == 0
    assert "serialized" not in log, log
