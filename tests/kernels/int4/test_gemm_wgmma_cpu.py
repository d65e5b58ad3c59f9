"""The wgmma prefill GEMM (nq/kernels/int4/gemm_wgmma.py) without a GPU: its refusals, its
sm_90a PTX for the 7B shapes with ptxas accepting it (registers and spills printed; no
serialised wgmma pipeline), and the kernel under the CUDA simulator against the fp64
reference (data movement: the wgmma twins run synchronously)."""
import textwrap

import pytest

from nq.config import PRESETS
from nq.kernels.int4 import gemm_wgmma as W

ptx_util = pytest.importorskip("ptx_util")

CFG7 = PRESETS["7b"]
H, I, QKV = CFG7.hidden_size, CFG7.intermediate_size, CFG7.qkv_size
SHAPES_7B = [("qkv", QKV, H, ("rows", 14)), ("gate_up", I, H, ("rows", 4)),
             ("o_proj", H, H, "mma"), ("down", H, I, "mma")]


def test_refusals():
    with pytest.raises(ValueError, match="ta = 2"):
        W.build_gemm_wgmma("gate_up", 64, 256, "mma", W.WgTiles(1, 2, 128, 4))
    with pytest.raises(ValueError, match="shared memory"):
        W.build_gemm_wgmma("plain", 64, 256, "mma", W.WgTiles(2, 2, 256, 4))
    with pytest.raises(ValueError, match="multiple of 8"):
        W.build_gemm_wgmma("plain", 64, 256, "mma", W.WgTiles(1, 1, 100, 3))
    with pytest.raises(ValueError, match="stages"):
        W.build_gemm_wgmma("plain", 64, 256, "mma", W.WgTiles(1, 1, 128, 2))
    with pytest.raises(ValueError, match="layout"):
        W.build_gemm_wgmma("plain", 64, 256, "rows", W.WgTiles(1, 1, 128, 3))


@pytest.mark.slow
@pytest.mark.skipif(__import__("nq.ptx").ptx.SIMULATOR, reason="the simulator compiles nothing")
@pytest.mark.parametrize("kind,n,k,layout", SHAPES_7B, ids=[s[0] for s in SHAPES_7B])
def test_gemm_wgmma_ptx_sm90a(kind, n, k, layout, capsys):
    tiles = W.default_tiles(kind)
    fn, sig, name = W.build_gemm_wgmma(kind, n, k, layout, tiles)
    ptx = ptx_util.compile_ptx_sm90(fn, sig, cc=ptx_util.SM90A, launch_bounds=(tiles.threads,),
                                    **W.COMPILE_OPTIONS)
    assert ".target sm_90a" in ptx
    mma = f"wgmma.mma_async.sync.aligned.m64n{tiles.bt}k16.f32.f16.f16"
    ptx_util.assert_uses(ptx, mma, "wgmma.fence.sync.aligned", "wgmma.commit_group.sync.aligned",
                         "wgmma.wait_group.sync.aligned", "cp.async.cg.shared.global",
                         "fence.proxy.async.shared::cta", "mul.rn.f16x2")
    ptx_util.assert_no_local_memory(ptx)
    # one group's 8 k16 chunks unrolled, or its two halves (4 chunks) with the loop rolled
    n_mma = ptx_util.count(ptx, mma)
    assert n_mma in (4 * tiles.ta, 8 * tiles.ta), n_mma
    if not ptx_util.have_ptxas():
        pytest.skip("no ptxas or nvJitLink here: the PTX checks above stand")
    log = ptx_util.ptxas_log(ptx)
    regs, spill = ptx_util.ptxas_report(ptx)
    with capsys.disabled():
        print(f"\n{name}: {regs} registers, {spill} spill bytes, {tiles.smem_bytes()} B smem")
    assert "serialized" not in log, log          # ptxas could not prove the pipeline
    assert spill == 0 and regs <= 255, (regs, spill)
