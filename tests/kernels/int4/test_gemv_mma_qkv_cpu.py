"""qkv and qkv_rope on the tensor cores (gemv_mma kinds "qkv", "qkv_rope"; opt-in NQ_MMA_QKV=1)
without a GPU: the rope-ordered layout (a RoPE pair in a tile's rows g, g + 8), the tiling and
the switch's wiring (gemvs, the upload, the prefill's layout), refusals, sm_90 PTX and ptxas at
the 7B shape, and the kernels under the CUDA simulator against fp64.  With the switch off the
default kernels are unchanged: scripts/ptx_hashes.py --compare, not here."""
import dataclasses
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from nq.config import PRESETS
from nq.kernels.int4 import gemv_mma, tiling
from nq.kernels.int4.layout import mma_layout, mma_unlayout, rope_row, rope_rows
from nq.kernels.int4.tiling import MmaTiling, Tiling, default_tiling, mma_tiling

ptx_util = pytest.importorskip("ptx_util")
ROOT = Path(__file__).resolve().parents[3]
CFG = PRESETS["7b"]
SEVEN_B = MmaTiling(warps=14, threads=448, rope=128, hilo=1)   # o_proj's rule at K = 3584, hilo
PLAIN = MmaTiling(warps=14, threads=448, rope=128)   # what "qkv.mma=1" gives without NQ_MMA_QKV
HEADS_7B = (28, 4, 128)


@pytest.mark.parametrize("d", [64, 128])
def test_rope_rows_put_a_pair_in_rows_g_and_g_plus_8(d):
    n = 3 * d
    perm = rope_rows(n, d)
    assert sorted(perm) == list(range(n))                       # a permutation
    assert np.array_equal(perm // d, np.arange(n) // d)         # heads keep their rows
    for tile in range(n // 16):
        for g in range(8):
            r0, r8 = perm[16 * tile + g], perm[16 * tile + g + 8]
            assert r8 == r0 + d // 2 and r0 % d < d // 2        # rows i, i + D/2: a RoPE pair
            assert rope_row(16 * tile + g, d) == r0             # the kernels' arithmetic
    rng = np.random.default_rng(d)
    q = rng.integers(0, 2**32, (n, 256 // 8), dtype=np.uint32)
    words = mma_layout(q, d)
    assert np.array_equal(words, mma_layout(q[perm]))           # the fragments of the rows
    assert np.array_equal(mma_unlayout(words, d), q)            # round trip
    with pytest.raises(ValueError, match="multiple of 16"):
        rope_rows(n, 24)


def test_qkv_tiling_follows_the_switch(monkeypatch):
    n, h = CFG.qkv_size, CFG.hidden_size
    monkeypatch.setattr(tiling, "MMA_QKV", False)
    assert mma_tiling("qkv", n, h, 128) == mma_tiling("qkv_rope", n, h, 128) == PLAIN
    monkeypatch.setattr(tiling, "MMA_QKV", True)                # the fp32-accurate step: hilo
    assert mma_tiling("qkv", n, h, 128) == mma_tiling("qkv_rope", n, h, 128) == SEVEN_B
    assert SEVEN_B.layout() == ("mma_rope", 128) and SEVEN_B.tag() == "mma_w14_t448_rope128_hilo"
    assert mma_tiling("qkv", n, h) is None                      # no head_dim, no layout
    assert mma_tiling("qkv", 1152, 896, 64) == MmaTiling(warps=3, threads=96, rope=64, hilo=1)  # 0.5B
    monkeypatch.setattr(tiling, "MMA_QKV", False)
    off = default_tiling("qkv", n, h, head_dim=128)
    assert off == Tiling(ks=14, threads=384, span=128, min_blocks=1, i8=1)   # measured, digits
    assert default_tiling("qkv_rope", n, h, head_dim=128) == dataclasses.replace(off, rows=2, early=1)
    monkeypatch.setattr(tiling, "MMA_QKV", True)
    assert default_tiling("qkv", n, h, head_dim=128) == SEVEN_B
    assert default_tiling("qkv_rope", n, h, head_dim=128) == SEVEN_B   # one layout, both
    assert default_tiling("qkv", n, h, head_dim=128, mma=False) == off
    assert default_tiling("qkv", n, h) == off                    # no head_dim: CUDA cores
    assert default_tiling("o_proj", h, h) == MmaTiling(warps=14, threads=448, l2ahead=2)   # rope 0


@pytest.mark.parametrize("value,want", [("1", "True"), ("0", "False"), (None, "False")])
def test_the_switch_is_read_from_the_environment(value, want):
    env = {k: v for k, v in os.environ.items() if k != "NQ_MMA_QKV"}
    if value is not None:
        env["NQ_MMA_QKV"] = value
    out = subprocess.run([sys.executable, "-c", "from nq.kernels.int4 import tiling; "
                          "print(tiling.MMA_QKV)"], env=env, cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == want


def test_qkv_refusals_and_names():
    b = gemv_mma.build_kernel
    with pytest.raises(ValueError, match="rope"):               # qkv needs the rope layout
        b("qkv", 256, 256, MmaTiling(warps=2, threads=64), 1e-6)
    with pytest.raises(ValueError, match="rope"):               # and o_proj must not have it
        b("o_proj", 256, 256, MmaTiling(warps=2, threads=64, rope=64))
    with pytest.raises(ValueError, match="eps is RMSNorm's"):
        b("qkv", 256, 256, MmaTiling(warps=2, threads=64, rope=64))
    with pytest.raises(ValueError, match="heads="):
        b("qkv_rope", 256, 256, MmaTiling(warps=2, threads=64, rope=64), 1e-6)
    with pytest.raises(ValueError, match="num_heads"):          # 4 heads of 64, not 2+2*1
        b("qkv_rope", 256, 256, MmaTiling(warps=2, threads=64, rope=64), 1e-6, (1, 1, 64))
    with pytest.raises(ValueError, match="dividing N"):
        b("qkv", 320, 256, MmaTiling(warps=2, threads=64, rope=128), 1e-6)
    with pytest.raises(ValueError, match="static"):             # K = 25,600: 50 KB staged
        b("qkv", 256, 128 * 200, MmaTiling(warps=2, threads=64, rope=64), 1e-6)
    assert gemv_mma.gemv_mma_name("qkv_rope", 4608, 3584, SEVEN_B, 1e-6, HEADS_7B) == \
        ("gemv_mma_qkv_rope_n4608_k3584_warps14_threads448_min_blocks0_rope128_hilo1_"
         "eps1em06_"
         "heads28_kv_heads4")
    # rope = 0 and hilo = 0 leave the names (and cached cubins) of the other kinds as they were
    assert gemv_mma.gemv_mma_name("down", 3584, 18944, MmaTiling(warps=16, threads=1024)) == \
        "gemv_mma_down_n3584_k18944_warps16_threads1024_min_blocks0"


@pytest.mark.parametrize("kind", ["qkv_rope", "qkv"])
def test_qkv_ptx_sm90(kind):
    heads = HEADS_7B if kind == "qkv_rope" else None
    fn, sig = gemv_mma.build_kernel(kind, CFG.qkv_size, CFG.hidden_size, SEVEN_B, 1e-6, heads)
    ptx = ptx_util.compile_ptx_sm90(fn, sig, launch_bounds=(SEVEN_B.threads,))
    ptx_util.assert_uses(ptx, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                         "ld.shared.v2.u32", "ld.global.nc.v4.u32", "ld.global.nc.v4.f32",
                         "griddepcontrol.wait", "griddepcontrol.launch_dependents")
    # 28 groups over 14 warps: one two-group iteration, 8 mmas a group, 4 lop3 a word
    mmas = ptx_util.count(ptx, "mma.sync.aligned.m16n8k16")
    assert mmas == 16 and ptx_util.count(ptx, "lop3.b32") == 4 * mmas
    if kind == "qkv_rope":
        # libdevice cosf/sinf keep 7 words for the Payne-Hanek reduction, as rope_kv's and the
        # CUDA-core qkv_rope's (test_gemv_cpu); any other local array is a bug
        assert re.findall(r"__local_depot\d+\[(\d+)\]", ptx) == ["28"]
        ptx_util.assert_uses(ptx, "st.global.u16", "st.global.f32")
    else:
        ptx_util.assert_no_local_memory(ptx)
    if not ptx_util.have_ptxas():
        pytest.skip("no nvJitLink or ptxas here: the PTX checks above stand")
    regs, spill = ptx_util.ptxas_report(ptx)
    print(f"gemv_mma {kind} 7B {SEVEN_B.tag()}: {regs} registers, {spill} bytes spilled")
    # 64 (qkv_rope) / 72 (qkv) with this repository's toolchain.  Two 448-thread blocks an SM
    # (the step's qkv_rope) need <= 72 (64K registers, allocated 8 a thread at a time): at 76
    # (RoPE's inputs held across the loop) its 288 blocks ran in three waves, +0.035 ms a step
    # on the H200 (docs/PERF.md)
    assert spill == 0 and regs <= (72 if kind == "qkv_rope" else 128), (regs, spill)


SIM_SCRIPT = textwrap.dedent('''
    import dataclasses
    import sys
    import numpy as np
    from numba import cuda
    sys.path.insert(0, "tests")
    import sim_warp
    sim_warp.install()
    sim_warp.patch_simulator()
    from nq.config import tiny_config
    from nq.kernels.int4.launch import make_qkv_gemv, make_qkv_rope_gemv
    from nq.kernels.int4.reference import ref_qkv_rope_mma
    from nq.kernels.int4.tiling import MmaTiling, mma_tiling
    from nq.kernels.rope_kv import rope_inv_freq
    from nq.loader.quant import dequantize_packed
    from nq.paged import PAGE, STATE_LEN, STATE_POS

    rng = np.random.default_rng(0)
    # tiny (D = 64, 2 groups: one warp a tile, its second group half empty); D = 128 as the
    # 7B's heads, 3 groups over 2 warps and 2 tiles a block (the last iteration half empty)
    cases = [("tiny", tiny_config(), None),
             ("d128", dataclasses.replace(tiny_config(head_dim=128, num_heads=1, num_kv_heads=1),
                                          hidden_size=384), MmaTiling(warps=2, threads=128, rope=128))]
    for (name, cfg, t), form in [(c, f) for f in ("", "_hilo", "_i8") for c in cases]:
        n, k, d = cfg.qkv_size, cfg.hidden_size, cfg.head_dim
        t = dataclasses.replace(t or mma_tiling("qkv_rope", n, k, d), hilo=int(form == "_hilo"),
                                i8=int(form == "_i8"))
        name += form
        if name not in CASES:
            continue
        qw = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
        sc = rng.uniform(0.002, 0.02, size=(n, k // 128)).astype(np.float16)
        bias = (0.1 * rng.standard_normal(n)).astype(np.float16)
        x = (rng.standard_normal(k) * 2).astype(np.float32)
        x[7] = 900.0                       # a "massive activation" channel
        nw = (1 + 0.2 * rng.standard_normal(k)).astype(np.float16)
        inv = rope_inv_freq(d, cfg.rope_theta)
        pos = 1239
        g = make_qkv_rope_gemv(cfg, t)
        pq, ps = g.prepare([(qw, sc)])
        q_out = cuda.to_device(np.full(cfg.num_heads * d, np.nan, np.float32))
        kv = cuda.to_device(np.full((4, cfg.num_kv_heads, 2, PAGE, d), np.nan, np.float16))
        state = np.zeros(STATE_LEN, np.int32)
        state[STATE_POS] = pos
        table = np.zeros(128, np.int32)
        table[pos // PAGE] = 2
        args = [cuda.to_device(a) for a in (x, nw, pq, ps, bias)]
        g(*args, cuda.to_device(state), cuda.to_device(inv), cuda.to_device(table), kv, q_out)
        w = dequantize_packed(qw, sc).astype(np.float64)
        y, rq, rk, rv = ref_qkv_rope_mma(cfg, x, nw, w, bias, inv, pos)
        kvh = kv.copy_to_host()
        got = {"q": q_out.copy_to_host().reshape(cfg.num_heads, d),
               "k": kvh[2, :, 0, pos % PAGE], "v": kvh[2, :, 1, pos % PAGE]}
        out = cuda.to_device(np.full(n, np.nan, np.float32))     # qkv: the same weights
        make_qkv_gemv(cfg, t)(*args, out)
        got["qkv"] = out.copy_to_host()
        for part, want in (("q", rq), ("k", rk), ("v", rv), ("qkv", y)):
            a = got[part].astype(np.float64)
            err = np.linalg.norm(a - want) / np.linalg.norm(want) if np.isfinite(a).all() else 1.0
            print(f"{name}_{part}", float(err), flush=True)
''')


# ~80 s a case on 2 cores: CI's tier takes the 7B's head_dim with hilo and with i8 and the tiny
# model without; the long tier (`pytest -m long`) the other three
SIM_CASES = ("d128_hilo", "d128_i8", "tiny")
SIM_CASES_LONG = ("d128", "tiny_hilo", "tiny_i8")


@pytest.mark.slow
def test_qkv_rope_under_the_simulator():
    _qkv_rope_under_the_simulator(SIM_CASES)


@pytest.mark.long
def test_qkv_rope_under_the_simulator_other_cases():
    _qkv_rope_under_the_simulator(SIM_CASES_LONG)


def _qkv_rope_under_the_simulator(cases):
    """q, the K/V slot and qkv's output against fp64.

    Tolerance: the staged activations are fp16 roundings of x * norm_w * f_g (2^-11 of each at
    most; where one channel dominates, as x[7] = 900 here, its rounding moves every row by up
    to 2^-11 of the output's norm), the products exact, the sums fp32 (2^-24 a step), rstd
    fp32, the fp32 angle pos * inv_freq (~2^-24 * 1239 rad: 7e-5 of the rotated values) -- so
    q and qkv within 2^-11 + 1e-4 ~ 6e-4; k and v, stored as fp16, 2^-11 more: 1.1e-3
    (measured 1.9e-4..2.8e-4).  The CUDA-core kernel, with fp16 partial sums, needs 5e-3.

    hilo=1 (h staged as fp16 hi + lo, 2^-22 of each value): q and qkv are then fp32 sums of
    exact products, ~1e-7 (measured 0.8e-7..1.1e-7; without hilo 1.9e-4), so 1e-5; k and v
    keep their fp16 store, 2^-11.

    i8=1 (h as rni(v * 2^14) in three signed bytes, |v| < 256 for the group's absmax in
    [128, 256): 2^-23 of the absmax a value, the dot products exact in int32): as hilo."""
    errs, stdout = ptx_util.run_under_simulator(f"CASES = {list(cases)!r}\n" + SIM_SCRIPT,
                                                timeout=900)
    assert len(errs) == 4 * len(cases), stdout
    for name, e in errs.items():
        fp16_store = name[-2:] in ("_k", "_v")
        if "_hilo" in name or "_i8" in name:
            assert e < (6e-4 if fp16_store else 1e-5), (name, e)
        else:
            assert e < (1.1e-3 if fp16_store else 6e-4), (name, e)


SWITCH_SCRIPT = textwrap.dedent('''
    import os
    os.environ["NQ_MMA_QKV"] = SWITCH
    import numpy as np
    from nq.kernels.int4.launch import QkvMmaGemv, QkvRopeMmaGemv, make_qkv_rope_gemv
    from nq.kernels.int4.layout import mma_layout
    from nq.loader.format import NanoqwenFile
    from nq.runtime.prefill import layout_of
    from nq.runtime.weights import gemvs, upload, upload_mismatches

    nf = NanoqwenFile(PATH)
    cfg = nf.config
    g = gemvs(cfg)["qkv"]
    print("mma_launcher", int(isinstance(g, QkvMmaGemv)))
    print("rope_launcher", int(isinstance(make_qkv_rope_gemv(cfg), QkvRopeMmaGemv)))
    print("prefill_rope", int(layout_of(g) == ("mma_rope", cfg.head_dim)))
    w = upload(nf)
    print("mismatches", len(upload_mismatches(nf, w)))
    qkv = np.concatenate([nf.array(f"layers.0.{p}.qweight") for p in ("q_proj", "k_proj", "v_proj")])
    print("uploaded_rope", int(np.array_equal(w.layers[0].qkv_w.copy_to_host(),
                                              mma_layout(qkv, cfg.head_dim))))
''')


@pytest.mark.slow
@pytest.mark.parametrize("switch", ["1"])   # off: the row layout, as the other upload tests
def test_the_switch_moves_gemvs_the_upload_and_the_prefill(tiny_nanoqwen, switch):
    """With NQ_MMA_QKV=1 `gemvs` builds qkv (and the step qkv_rope) on gemv_mma, the upload
    writes qkv's rope-ordered mma fragments (retile_mma's rope kernel, checked against the
    launcher's `prepare`) and the prefill GEMMs are told ("mma_rope", head_dim); with it off,
    the row layout, as before."""
    script = SWITCH_SCRIPT.replace("SWITCH", repr(switch)).replace("PATH", repr(str(tiny_nanoqwen)))
    vals, out = ptx_util.run_under_simulator(script, timeout=600)
    on = float(switch == "1")
    assert vals == {"mma_launcher": on, "rope_launcher": on, "prefill_rope": on,
                    "mismatches": 0.0, "uploaded_rope": on}, out
