"""The wgmma prefill GEMM (nq/kernels/int4/gemm_wgmma.py) without a GPU: its refusals, its
sm_90a PTX for the 7B shapes with ptxas accepting it (registers and spills printed; no
serialised wgmma pipeline), and the kernel under the CUDA simulator against the fp64
reference (data movement: the wgmma twins run synchronously)."""
import textwrap

import pytest

from nq.config import PRESETS
from nq.kernels.int4 import gemm_wgmma as W
from nq.kernels.int4 import wg_tiles as T

ptx_util = pytest.importorskip("ptx_util")

CFG7 = PRESETS["7b"]
H, I, QKV = CFG7.hidden_size, CFG7.intermediate_size, CFG7.qkv_size
SHAPES_7B = [("qkv", QKV, H, ("rows", 14)), ("gate_up", I, H, ("rows", 4)),
             ("o_proj", H, H, "mma"), ("down", H, I, "mma")]


def test_refusals():
    with pytest.raises(ValueError, match="ta = 2"):
        W.build_gemm_wgmma("gate_up", 64, 256, "mma", T.WgTiles(1, 1, 128, 4))
    with pytest.raises(ValueError, match="shared memory"):
        W.build_gemm_wgmma("plain", 64, 256, "mma", T.WgTiles(2, 2, 256, 4))
    with pytest.raises(ValueError, match="multiple of 8"):
        W.build_gemm_wgmma("plain", 64, 256, "mma", T.WgTiles(1, 1, 100, 3))
    with pytest.raises(ValueError, match="stages"):
        W.build_gemm_wgmma("plain", 64, 256, "mma", T.WgTiles(1, 1, 128, 2))
    with pytest.raises(ValueError, match="layout"):
        W.build_gemm_wgmma("plain", 64, 256, "rows", T.WgTiles(1, 1, 128, 3))


CANDIDATES = [T.WgTiles(1, 2, 64, 4), T.WgTiles(2, 1, 128, 4), T.WgTiles(2, 2, 64, 4),
              T.WgTiles(1, 1, 256, 3)]
CASES = ([(s, t) for s in SHAPES_7B for _, t in T.tiles_by_m(s[0])]
         + [(SHAPES_7B[i], t) for i in (1, 2) for t in CANDIDATES
            if SHAPES_7B[i][0] != "gate_up" or t.ta == 2 or t.wg % 2 == 0])


@pytest.mark.slow
@pytest.mark.skipif(__import__("nq.ptx").ptx.SIMULATOR, reason="the simulator compiles nothing")
@pytest.mark.parametrize("shape,tiles", CASES, ids=[f"{s[0]}-{t.tag()}" for s, t in CASES])
def test_gemm_wgmma_ptx_sm90a(shape, tiles, capsys):
    kind, n, k, layout = shape
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


SIM_SCRIPT = textwrap.dedent('''
    import numpy as np
    from numba import cuda
    from nq.kernels.int4 import gemm as M
    from nq.kernels.int4 import gemm_wgmma as W
    from nq.kernels.int4.layout import mma_layout, tile_rows
    from nq.kernels.int4.wg_tiles import WgTiles as T
    from nq.loader.quant import dequantize_packed

    rng = np.random.default_rng(0)

    def case(name, kind, n, k, layout, tiles, m, band_bytes=W.L2_BAND_BYTES):
        nw = 2 * n if kind == "gate_up" else n
        qw = rng.integers(0, 2**32, size=(nw, k // 8), dtype=np.uint32)
        sc = rng.uniform(0.002, 0.02, size=(nw, k // 128)).astype(np.float16)
        x = rng.standard_normal((m + 3, k)).astype(np.float16)
        x[0, 5] = 300.0
        up = mma_layout(qw) if layout == "mma" else tile_rows(qw, layout[1])
        W.L2_BAND_BYTES = band_bytes
        g = W.WgmmaGemm(kind, n, k, layout, tiles, min_m=0)
        out0 = rng.standard_normal((m + 2, n)).astype(np.float16 if kind == "gate_up" else np.float32)
        out = cuda.to_device(out0)
        bias = rng.standard_normal(n).astype(np.float16)
        args = [cuda.to_device(a) for a in (x, up, sc)] + ([cuda.to_device(bias)] if kind == "qkv" else [])
        g(*args, out, m)
        got = out.copy_to_host().astype(np.float64)
        ref = M.ref_gemm(kind, x[:m], dequantize_packed(qw, sc), bias, out0[:m])
        if kind in ("o_proj", "down"):
            got[:m] -= out0[:m]
            ref = ref - out0[:m]
        ok = np.isfinite(got).all() and np.array_equal(got[m:], out0[m:].astype(np.float64))
        err = np.linalg.norm(got[:m] - ref) / np.linalg.norm(ref)
        print(name, err if ok else float("inf"), flush=True)

    # mma layout: one warpgroup; a clamped spare tile (80 rows over a block of 64) and two
    # token blocks, the second partial; two warpgroups; row layout (ks 2 over 3 groups);
    # gate_up (ta 2); three token blocks in bands of 2 (the last band's second block empty)
    case("mma_plain_m16", "plain", 64, 256, "mma", T(1, 1, 16, 3), 16)
    case("mma_oproj_m20", "o_proj", 80, 256, "mma", T(1, 1, 16, 3), 20)
    case("mma_down_wg2_m9", "down", 128, 256, "mma", T(1, 2, 16, 4), 9)
    case("rows_qkv_m16", "qkv", 64, 384, ("rows", 2), T(1, 1, 16, 3), 16)
    case("rows_gateup_m9", "gate_up", 64, 256, ("rows", 1), T(2, 1, 16, 3), 9)
    case("rows_plain_bands", "plain", 64, 256, ("rows", 2), T(1, 1, 16, 3), 40,
         band_bytes=2 * 16 * 256 * 2)
''')


@pytest.mark.long  # ~230 s on a 2-core CPU: `python3 -m pytest -m long`; CI keeps the sm_90a
# compile checks above, and the H200 tier checks the kernel against fp64 (test_gemm_wgmma_gpu.py)
def test_gemm_wgmma_under_the_simulator():
    """Every kind and both layouts against the fp64 reference on tiny shapes, with the bound
    of tests/kernels/int4/test_gemm_cpu.py (scales folded into fp16 weights: ~3e-4 of a dot
    product's norm; gate_up's fp16 output 2^-11 more).  The wgmma twins are synchronous, so
    this checks the copies, swizzles, descriptors, fragments and epilogues, not the pipeline's
    waits (the GPU test does)."""
    errs, stdout = ptx_util.run_under_simulator(SIM_SCRIPT, timeout=1500)
    assert len(errs) == 6, stdout
    for name, e in errs.items():
        assert e < (1e-3 if "gateup" in name else 5e-4), (name, e)


def test_tiles_by_m():
    """DEFAULT_TILES' table: the first entry whose max_m holds M; an explicit tiling runs every M;
    the grid follows the tiles the M takes (gate_up: 64 features a block on WG_TALL, 128 on
    WG_WIDE)."""
    assert T.default_tiles("gate_up", 512) == T.WG_TALL
    assert T.default_tiles("gate_up", 1024) == T.WG_TALL
    assert T.default_tiles("gate_up", 1025) == T.WG_WIDE
    assert T.default_tiles("gate_up") == T.WG_WIDE
    assert T.default_tiles("o_proj", 8192) == T.WG_SHORT
    g = W.WgmmaGemm("gate_up", I, H, ("rows", 4))
    assert g.tiles_for(300) == T.WG_TALL and g.tiles_for(4096) == T.WG_WIDE
    (band, nb, bands), _ = g.grid(512)
    assert nb == I // 64 and band * bands >= 512 // T.WG_TALL.bt
    assert g.grid(4096)[0][1] == -(-I // 128)
    fixed = W.WgmmaGemm("gate_up", I, H, ("rows", 4), T.WG_WIDE)
    assert fixed.tiles_for(100) == fixed.tiles_for(8192) == T.WG_WIDE


def test_prepare_requests_only_the_tiles_an_m_can_reach(monkeypatch):
    """WgmmaGemm.prepare: the wgmma table's kernels and the mma.sync tiles of M <= min_m (SMALL
    and MEDIUM: LARGE is never picked when M > 64 goes to wgmma); Gemm.prepare alone: all."""
    from nq.kernels.int4 import gemm as M
    asked = []
    monkeypatch.setattr(M, "compiled", lambda kind, n, k, layout, t: asked.append(("mma", t)))
    monkeypatch.setattr(W, "compiled", lambda kind, n, k, layout, t: asked.append(("wg", t)))
    cached = set()          # names in the kernel cache: none at first
    monkeypatch.setattr(M, "in_cache", lambda body, sig, name, **o: name in cached)
    monkeypatch.setattr(W, "in_cache", lambda body, sig, name, **o: name in cached)
    H, I = 3584, 18944
    g = M.make_gemm("gate_up", I, H, "mma", backend="wgmma")
    assert g.prepare() == 4
    assert asked == [("mma", M.SMALL), ("mma", M.MEDIUM), ("wg", T.WG_TALL), ("wg", T.WG_WIDE)]
    asked.clear()
    assert M.make_gemm("down", H, I, "mma").prepare() == 3       # the mma.sync backend: all
    assert [t for _, t in asked] == [M.SMALL, M.MEDIUM, M.LARGE]
    # a start with them cached compiles none (each loads at its first use)
    asked.clear()
    cached.update(W.build_gemm_wgmma("gate_up", I, H, "mma", t)[2] for t in (T.WG_TALL, T.WG_WIDE))
    cached.update(M.build_gemm("gate_up", I, H, "mma", t)[2] for t in (M.SMALL, M.MEDIUM))
    assert g.prepare() == 0 and asked == []
