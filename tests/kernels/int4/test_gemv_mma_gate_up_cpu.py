"""gate_up on the tensor cores (gemv_mma kind "gate_up", the default; NQ_MMA_GATE_UP=0 turns it off) without a
GPU: its tiling and refusals, the switch's wiring (gemvs, the upload's layout, the prefill's
layout), its sm_90 PTX, and the kernel under the CUDA simulator against an fp64 reference.
The CUDA-core gate_up (switch off) is proven unchanged by scripts/ptx_hashes.py, not here."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nq.config import PRESETS
from nq.kernels.int4 import gemv_mma, tiling
from nq.kernels.int4.tiling import MmaTiling, Tiling, default_tiling, mma_tiling

ptx_util = pytest.importorskip("ptx_util")
ROOT = Path(__file__).resolve().parents[3]
SEVEN_B = MmaTiling(warps=2, threads=256)   # 13c221c's "ks2 t256"
ONE_WAVE = MmaTiling(warps=2, threads=576)   # the rule at the 7B: 9 tiles a block, 132 blocks


def test_gate_up_tiling_follows_the_switch(monkeypatch):
    i, h = PRESETS["7b"].intermediate_size, PRESETS["7b"].hidden_size
    assert mma_tiling("gate_up", i, h) == ONE_WAVE           # what kind.mma=1 switches to
    assert mma_tiling("gate_up", 4864, 896) == SEVEN_B       # 0.5B (K < 2048): 4 tiles a block
    assert mma_tiling("gate_up", 11008, 2048) == MmaTiling(2, 384)   # 3B: 688 tiles, 6 a block
    assert mma_tiling("gate_up", 1024, 128 * 200) is None    # 50 KB of activations: not static
    assert mma_tiling("gate_up", 13824, 5120) == MmaTiling(2, 448)   # 14B: 7 tiles a block
    assert mma_tiling("gate_up", 64, 1024) == SEVEN_B   # 4 tiles, K < 2048: one block
    monkeypatch.setattr(tiling, "MMA_GATE_UP", False)
    off = default_tiling("gate_up", i, h)
    assert off == Tiling(ks=4, threads=192, span=128, min_blocks=3)   # today's, untouched
    assert off == default_tiling("gate_up", i, h, mma=False)
    monkeypatch.setattr(tiling, "MMA_GATE_UP", True)
    on = default_tiling("gate_up", i, h)   # the 7B's measured entry: one block an SM of 132
    assert on == MmaTiling(warps=2, threads=576, l2ahead=1, i8=1)   # i8: NQ_I8's default
    assert on.layout() == SEVEN_B.layout()
    assert default_tiling("gate_up", i, h, sms=114) == MmaTiling(2, 384, i8=1)   # 6 a block
    assert default_tiling("gate_up", i, h, mma=False) == off
    # the other kinds do not move with it
    assert default_tiling("qkv", 4608, h) == Tiling(ks=14, threads=384, span=128, min_blocks=1, i8=1)
    assert default_tiling("down", h, i) == MmaTiling(warps=16, threads=1024, early=1)


@pytest.mark.parametrize("value,want", [("1", "True"), ("0", "False"), (None, "True")])
def test_the_switch_is_read_from_the_environment(value, want):
    env = {k: v for k, v in os.environ.items() if k != "NQ_MMA_GATE_UP"}
    if value is not None:
        env["NQ_MMA_GATE_UP"] = value
    out = subprocess.run([sys.executable, "-c", "from nq.kernels.int4 import tiling; "
                          "print(tiling.MMA_GATE_UP)"], env=env, cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == want


def test_gate_up_refusals():
    with pytest.raises(ValueError, match="eps is RMSNorm's"):
        gemv_mma.build_kernel("gate_up", 64, 256, SEVEN_B)
    plain = SEVEN_B
    with pytest.raises(ValueError, match="eps is RMSNorm's"):
        gemv_mma.build_kernel("down", 64, 256, plain, 1e-6)
    with pytest.raises(ValueError, match="static"):          # K = 25,600: 50 KB staged
        gemv_mma.build_kernel("gate_up", 64, 128 * 200, plain, 1e-6)
    with pytest.raises(ValueError, match="multiple of 16"):
        gemv_mma.build_kernel("gate_up", 40, 256, SEVEN_B, 1e-6)
    # eps is a constant of the kernel: in its name, so two models never share a cached cubin
    assert gemv_mma.gemv_mma_name("gate_up", 18944, 3584, SEVEN_B, 1e-6) == \
        "gemv_mma_gate_up_n18944_k3584_warps2_threads256_min_blocks0_eps1em06"
    assert gemv_mma.gemv_mma_name("down", 3584, 18944, plain) == \
        "gemv_mma_down_n3584_k18944_warps2_threads256_min_blocks0"


@pytest.mark.parametrize("n,k,t", [
    (18944, 3584, SEVEN_B),                              # 7B (the rule's)
    (18944, 3584, MmaTiling(warps=2, threads=576, l2ahead=1)),   # 7B (the measured default)
    (4864, 896, SEVEN_B),                                # 0.5B
    (13824, 5120, SEVEN_B),                              # 14B
    (18944, 3584, MmaTiling(warps=4, threads=256)),
])
def test_gate_up_ptx_sm90(n, k, t):
    fn, sig = gemv_mma.build_kernel("gate_up", n, k, t, 1e-6)
    ptx = ptx_util.compile_ptx_sm90(fn, sig, launch_bounds=(t.threads,))
    ptx_util.assert_uses(ptx, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                         "ld.shared.v2.u32", "ld.global.nc.v4.u32", "ld.global.nc.v4.f32",
                         "lop3.b32", "griddepcontrol.wait", "griddepcontrol.launch_dependents",
                         "ex2.approx")
    ptx_util.assert_no_local_memory(ptx)
    # a gate and an up mma a chunk (one B fragment each pair), 8 chunks a group, two groups
    # an iteration; four lop3 a word
    mmas = ptx_util.count(ptx, "mma.sync.aligned.m16n8k16")
    assert mmas == 32 and ptx_util.count(ptx, "lop3.b32") == 4 * mmas
    assert ptx_util.count(ptx, "ld.shared.v2.u32") == 16      # B fragments: one a chunk
    if not ptx_util.have_ptxas():
        pytest.skip("no nvJitLink or ptxas here: the PTX checks above stand")
    regs, spill = ptx_util.ptxas_report(ptx)
    print(f"gemv_mma gate_up n{n} k{k} {t.tag()}: {regs} registers, {spill} bytes spilled")
    # 91 with this repository's toolchain, as 13c221c's kernel (whose PTX this one repeats,
    # instruction for instruction); 256 threads allow 255
    assert spill == 0 and regs <= 128, (regs, spill)


@pytest.mark.parametrize("n,k,t", [
    (18944, 3584, MmaTiling(warps=2, threads=576, l2ahead=1, i8=1)),   # 7B
    (13824, 5120, MmaTiling(warps=2, threads=448, l2ahead=1, i8=1)),   # 14B
    (4864, 896, MmaTiling(warps=2, threads=256, i8=1)),                # 0.5B
])
def test_gate_up_i8_ptx_sm90(n, k, t):
    fn, sig = gemv_mma.build_kernel("gate_up", n, k, t, 1e-6)
    ptx = ptx_util.compile_ptx_sm90(fn, sig, launch_bounds=(t.threads,))
    ptx_util.assert_uses(ptx, "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32",
                         "cvt.rni.s32.f32", "st.shared.u8", "ld.shared.v4.u32")
    ptx_util.assert_no_local_memory(ptx)
    # four k32 steps a group of each tile, gate and up, two groups an iteration; no fp16
    # dequant (each word: a shift and two ands); two 16-byte B loads a group
    assert ptx_util.count(ptx, "mma.sync.aligned.m16n8k32") == 16
    assert ptx_util.count(ptx, "mma.sync.aligned.m16n8k16") == 0
    assert ptx_util.count(ptx, "fma.rn.f16x2") == ptx_util.count(ptx, "add.rn.f16x2") == 0
    assert ptx_util.count(ptx, "ld.shared.v4.u32") == 4
    with pytest.raises(ValueError, match="use i8=0"):   # 3 bytes a value past 48 KB
        gemv_mma.build_kernel("gate_up", 64, 128 * 130, MmaTiling(2, 256, i8=1), 1e-6)
    regs = ptx_util.assert_one_block_an_sm(ptx, t.threads)
    print(f"gemv_mma gate_up i8 n{n} k{k} {t.tag()}: {regs} registers")


SIM_SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    from numba import cuda
    sys.path.insert(0, "tests")
    import sim_warp
    sim_warp.install()
    sim_warp.patch_simulator()
    from nq.config import tiny_config
    from nq.kernels.int4.launch import GateUpMmaGemv
    from nq.kernels.int4.tiling import MmaTiling
    from nq.loader.quant import dequantize_packed

    rng = np.random.default_rng(0)
    cfg = tiny_config()

    def ref64(x, nw, eps, wg, wu):
        x = x.astype(np.float64)
        h = x / np.sqrt(np.mean(x * x) + eps) * nw.astype(np.float64)
        g, u = wg @ h, wu @ h
        return g / (1.0 + np.exp(-g)) * u

    # (name, I, K, tiling): 2 tiles a block, 3 groups over 2 warps (warp 1's second half
    # iteration empty); 3 tiles over blocks of 2 (the last block's second tile clamped, not
    # written); 4 warps over 3 groups (one warp has none); one warp a tile, 5 groups (three
    # iterations, the last half empty, and 2 staging rounds of 2 warps)
    # each also with i8=1 (h staged as digits: name_i8)
    cases = [("t2_w2", 32, 384, MmaTiling(warps=2, threads=128)),
             ("tail", 48, 384, MmaTiling(warps=2, threads=128)),
             ("w4", 16, 384, MmaTiling(warps=4, threads=128)),
             ("w1", 32, 640, MmaTiling(warps=1, threads=64))]
    cases += [(name + "_i8", n, k, MmaTiling(t.warps, t.threads, i8=1))
              for name, n, k, t in cases]
    # l2ahead: every group after a warp's first, of its gate and its up tile, asked of L2 once
    cases += [("l2a2", 32, 640, MmaTiling(warps=1, threads=64, l2ahead=2)),
              ("l2a2_i8", 48, 640, MmaTiling(warps=2, threads=128, i8=1, l2ahead=3))]
    import nq.kernels.int4.gemv_mma_weights as gw
    asked = sim_warp.record_l2_prefetches(gw)   # to_l2 lives in the weight path
    for name, n, k, t in cases:
        qw = rng.integers(0, 2**32, size=(2 * n, k // 8), dtype=np.uint32)
        sc = rng.uniform(0.002, 0.02, size=(2 * n, k // 128)).astype(np.float16)
        x = (rng.standard_normal(k) * 2).astype(np.float32)
        x[7] = 900.0                       # a "massive activation" channel: f_g < 1 there
        nw = (1 + 0.2 * rng.standard_normal(k)).astype(np.float16)
        g = GateUpMmaGemv(cfg, n, k, t)
        pq, ps = g.prepare([(qw[:n], sc[:n]), (qw[n:], sc[n:])])
        out = cuda.to_device(np.full(n, np.nan, np.float16))
        asked.clear()
        g(cuda.to_device(x), cuda.to_device(nw), cuda.to_device(pq), cuda.to_device(ps), out)
        groups = k // 128
        want = {(tile, grp) for tile in range(2 * n // 16) for grp in range(t.warps, groups)}
        got_l2 = {divmod(i // 256, groups) for size, i, nb in asked if size == pq.size}
        assert all(nb == 1024 and i % 256 == 0 for size, i, nb in asked if size == pq.size)
        assert got_l2 == (want if t.l2ahead else set()), (name, sorted(got_l2 ^ want))
        got = out.copy_to_host().astype(np.float64)
        w = dequantize_packed(qw, sc).astype(np.float64)
        ref = ref64(x, nw, cfg.rms_norm_eps, w[:n], w[n:])
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref) if np.isfinite(got).all() else 1.0
        # and against the reference rounded to fp16, the output's own rounding left out
        r16 = ref.astype(np.float16).astype(np.float64)
        e16 = np.linalg.norm(got - r16) / np.linalg.norm(ref) if np.isfinite(got).all() else 1.0
        print(name, float(err), flush=True)
        print(name + "_f16", float(e16), flush=True)
''')


@pytest.mark.slow
def test_gate_up_under_the_simulator():
    """The kernel against silu(Wg.h) * (Wu.h), h = rmsnorm(x) * norm_w, all in fp64.

    Tolerance: the staged activations are fp16 roundings of x * norm_w * f_g (f_g a power of
    two: exact), each off by at most 2^-11 of itself; the products are exact, the sums fp32
    (2^-24 a step), rstd fp32.  Where one channel dominates (x[7] = 900) its rounding moves
    gate and up by the same relative amount, up to 2^-11 each, and silu(g) * u ~ g * u for
    large g adds the two; the fp16 store adds up to 2^-11 more: at most 3 * 2^-11 = 1.5e-3 of
    the output's norm (measured 2.6e-4..9.8e-4), so 2e-3 (the CUDA-core kernel, with fp16
    partial sums, needs 5e-3).

    i8=1 stages h as rni(v * 2^14) in three signed-byte digits (2^-23 of the group's absmax a
    value) and sums the products exactly in int32, so only the fp16 store is left: within
    2^-11 = 4.9e-4 of the fp64 output, and against that output rounded to fp16 the fp32 sums
    (~1e-6) can move a row across a rounding boundary now and then: 1e-4 (fp16 staging
    measured 2.3e-4..9.0e-4 there, so the bound tells the two apart)."""
    errs, stdout = ptx_util.run_under_simulator(SIM_SCRIPT, timeout=900)
    names = {"t2_w2", "tail", "w4", "w1", "l2a2"}
    forms = ("", "_f16", "_i8", "_i8_f16")
    assert set(errs) == {n + s for n in names for s in forms}, stdout
    for name in names:
        assert errs[name] < 2e-3, (name, errs[name])
        assert errs[name + "_i8"] < 6e-4, (name, errs[name + "_i8"])
        assert errs[name + "_i8_f16"] < 1e-4, (name, errs[name + "_i8_f16"])


SWITCH_SCRIPT = textwrap.dedent('''
    import os
    os.environ["NQ_MMA_GATE_UP"] = SWITCH
    import numpy as np
    from nq.kernels.int4.launch import GateUpGemv, GateUpMmaGemv
    from nq.kernels.int4.layout import mma_layout
    from nq.loader.format import NanoqwenFile
    from nq.runtime.prefill import layout_of
    from nq.runtime.weights import gemvs, upload, upload_mismatches

    nf = NanoqwenFile(PATH)
    g = gemvs(nf.config)["gate_up"]
    print("mma_launcher", int(isinstance(g, GateUpMmaGemv)))
    print("rows_launcher", int(isinstance(g, GateUpGemv)))
    print("mma_layout", int(g.tiling.layout() == ("mma", 16)))
    print("prefill_mma", int(layout_of(g) == "mma"))
    w = upload(nf)
    print("mismatches", len(upload_mismatches(nf, w)))
    both = np.concatenate([nf.array(f"layers.0.{p}.qweight") for p in ("gate_proj", "up_proj")])
    print("uploaded_mma", int(np.array_equal(w.layers[0].gu_w.copy_to_host(), mma_layout(both))))
''')


@pytest.mark.slow
@pytest.mark.parametrize("switch", ["1", "0"])
def test_the_switch_moves_gemvs_the_upload_and_the_prefill(tiny_nanoqwen, switch):
    """With NQ_MMA_GATE_UP=1 `gemvs` builds gate_up on gemv_mma, the upload writes gate_up's
    mma fragments (retile_mma, checked against the launcher's `prepare`) and the prefill GEMMs
    are told "mma"; with it off, the row layout, as before."""
    script = SWITCH_SCRIPT.replace("SWITCH", repr(switch)).replace("PATH", repr(str(tiny_nanoqwen)))
    vals, out = ptx_util.run_under_simulator(script, timeout=600)
    on = float(switch == "1")
    assert vals == {"mma_launcher": on, "rows_launcher": 1 - on, "mma_layout": on,
                    "prefill_mma": on, "mismatches": 0.0, "uploaded_mma": on}, out


def test_the_i8_switch_moves_the_defaults_not_the_layouts():
    """NQ_I8 (read at import): by default gate_up of the tensor-core GEMVs takes i8, and the
    CUDA-core qkv_rope its digits; "0" none.  The upload's layouts stay; a value it does not
    know is refused, "all" (retired) saying so."""
    script = ("from nq.kernels.int4 import tiling as T\n"
              "for kind, n, k in [('gate_up', 18944, 3584), ('down', 3584, 18944), "
              "('o_proj', 3584, 3584), ('qkv_rope', 4608, 3584), ('down', 5120, 27648)]:\n"
              "    t = T.default_tiling(kind, n, k, sms=132)\n"
              "    print(kind, n, t.i8, t.layout())\n"
              "print('o_i8', int(T.O_I8))\n")
    outs = {}
    for env in ({}, {"NQ_I8": "0"}, {"NQ_I8": "all"}, {"NQ_I8": "yes"}):
        e = {k: v for k, v in os.environ.items() if k != "NQ_I8"}
        e.update(env)
        res = subprocess.run([sys.executable, "-c", script], env=e, cwd=ROOT,
                             capture_output=True, text=True)
        outs[tuple(env.items())] = [line.split(maxsplit=3) for line in res.stdout.splitlines()]
        if env.get("NQ_I8") in ("yes", "all"):
            assert res.returncode != 0 and f"NQ_I8='{env['NQ_I8']}': use 1" in res.stderr
            assert "retired" in res.stderr, res.stderr
        else:
            assert res.returncode == 0, res.stderr
    default, off = outs[()], outs[(("NQ_I8", "0"),)]
    # gate_up's and (on the CUDA cores: gemv_digits.py) qkv_rope's
    assert [r[2] for r in default[:5]] == ["1", "0", "0", "1", "0"]
    assert [r[2] for r in off[:5]] == ["0", "0", "0", "0", "0"]
    assert default[5] == ["o_i8", "1"] and off[5] == ["o_i8", "0"]
    assert [r[3] for r in off[:5]] == [r[3] for r in default[:5]]   # the same layouts


def test_the_retired_qkv_switch_only_warns():
    """NQ_MMA_QKV=1 (the tensor-core qkv, retired after 29184bc) still imports, with one
    warning that the default step is already fp32-accurate, and moves no tiling."""
    script = ("from nq.kernels.int4 import tiling as T\n"
              "print(T.default_tiling('qkv_rope', 4608, 3584, sms=132).tag())\n")
    out = {}
    for value in ("1", None):
        e = {k: v for k, v in os.environ.items() if k != "NQ_MMA_QKV"}
        if value is not None:
            e["NQ_MMA_QKV"] = value
        out[value] = subprocess.run([sys.executable, "-c", script], env=e, cwd=ROOT,
                                    capture_output=True, text=True, check=True)
    assert out["1"].stdout == out[None].stdout
    said = out["1"].stderr
    assert out[None].stderr == "" and said.count("Warning: NQ_MMA_QKV=1 is retired") == 1, said
    assert "already fp32-accurate" in said, said
