"""CPU tests of the CUDA-core INT4 GEMVs and the lm_head: layout model, dequant arithmetic,
sm_90 PTX, kernel names, launcher refusals, the module structure, and the kernels themselves
under the CUDA simulator (tiny shapes)."""
import ast
import dataclasses
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest

from nq.config import PRESETS
from nq.kernels.int4 import gemv
from nq.kernels.int4 import launch, layout
from nq.kernels.int4.tiling import KINDS, MmaTiling, Tiling, default_tiling
from nq.loader.quant import pack_value_shuffle, unpack_value_shuffle
from nq.ptx import LUT_AND_XOR, add_rn_f16x2, fma_rn_f16x2, lop3_b32
from nq.ptx.half import f16_value


# ---- the tile layout ---------------------------------------------------------------------------

@pytest.mark.parametrize("k,ks", [(3584, 7), (3584, 4), (18944, 16), (18944, 30), (896, 3),
                                  (128, 1), (4864, 32)])
def test_chunk_permutation_is_a_permutation(k, ks):
    perm = layout.chunk_permutation(k, ks)
    assert sorted(perm.tolist()) == list(range(k // 32))


@pytest.mark.parametrize("k,ks", [(3584, 7), (18944, 30), (896, 3), (640, 4)])
def test_kernel_addressing_reads_the_right_chunks(k, ks):
    """The kernel's address arithmetic (load_row) on the tiled row finds file chunk 4g+i."""
    rng = np.random.default_rng(k + ks)
    qw = rng.integers(0, 2**32, size=(3, k // 8), dtype=np.uint32)
    tiled = layout.tile_rows(qw, ks)
    assert np.array_equal(layout.untile_rows(tiled, ks), qw)
    g_count = k // 128
    steps = -(-g_count // ks)
    for s in range(steps):
        gs = ks if s < steps - 1 else g_count - (steps - 1) * ks
        for j in range(gs):
            g = s * ks + j
            c = s * (ks * 16) + j * 4                     # load_row's word index of chunk i=0
            for i in range(4):
                w = c + i * gs * 4
                assert np.array_equal(tiled[:, w:w + 4], qw[:, (4 * g + i) * 4:(4 * g + i) * 4 + 4])


def test_prepare_concatenates_and_checks():
    rng = np.random.default_rng(0)
    parts = [(rng.integers(0, 2**32, size=(n, 32), dtype=np.uint32),
              rng.random((n, 2)).astype(np.float16)) for n in (16, 8, 8)]
    qw, sc = layout.prepare_weights(parts, ks=2)
    assert qw.shape == (32, 32) and sc.shape == (32, 2)
    assert np.array_equal(layout.untile_rows(qw, 2), np.concatenate([p[0] for p in parts]))
    with pytest.raises(ValueError, match="scales"):
        layout.prepare_weights([(parts[0][0], parts[0][1].astype(np.float32))], ks=2)


# ---- the dequant arithmetic, on the PTX twins ----------------------------------------------------

def test_magic_number_dequant_is_exact_for_every_nibble():
    """lop3 ^ 0x64086408 / 0x64806480, then -1032 / fma(1/16, -72): the kernel's dot8 steps."""
    q = np.array([[-8, -7, -1, 0, 1, 3, 6, 7], [7, -7, 5, -3, 0, -8, 2, -1]], np.int8)
    q = np.concatenate([q, np.random.default_rng(1).integers(-8, 8, (30, 8)).astype(np.int8)])
    for row, word in zip(q, pack_value_shuffle(q)[:, 0]):
        word = int(word)
        got = []
        for src in (word, word >> 8):
            lo = lop3_b32.twin(src, 0x000F000F, 0x64086408, LUT_AND_XOR)
            hi = lop3_b32.twin(src, 0x00F000F0, 0x64806480, LUT_AND_XOR)
            lo = int(add_rn_f16x2.twin(lo, 0xE408E408))
            hi = int(fma_rn_f16x2.twin(hi, 0x2C002C00, 0xD480D480))
            got += [f16_value(lo & 0xFFFF), f16_value(lo >> 16), f16_value(hi & 0xFFFF),
                    f16_value(hi >> 16)]
        assert got == row.astype(float).tolist()
    assert np.array_equal(unpack_value_shuffle(pack_value_shuffle(q)), q)


# ---- compiled code -------------------------------------------------------------------------------

ptx_util = pytest.importorskip("ptx_util")

SEVEN_B = {"qkv": (4608, 3584), "o_proj": (3584, 3584), "gate_up": (18944, 3584), "down": (3584, 18944),
           "qkv_rope": (4608, 3584), "lm_head": (152064, 3584), "lm_head_bound": (152064, 3584)}
HEADS_7B = (28, 4, 128)  # qkv_rope's (num_heads, num_kv_heads, head_dim)


@pytest.mark.parametrize("kind,tiling", [(k, None) for k in KINDS]
                         + [("down", Tiling(ks=16, threads=512, prefetch=0)),
                            ("qkv", Tiling(ks=7, rows=2, threads=128)),
                            ("o_proj", Tiling(ks=14, threads=256, span=128)),
                            ("qkv_rope", Tiling(ks=14, rows=2, threads=384, span=128, early=1))])
def test_gemv_ptx_sm90(kind, tiling):
    n, k = SEVEN_B[kind]
    # the CUDA-core kernel's fp16 form (qkv's default digits: test_gemv_digits_cpu.py)
    t = tiling or dataclasses.replace(default_tiling(kind, n, k, mma=False), i8=0)
    fn, sig = gemv.build_kernel(kind, n, k, t, 1e-6, HEADS_7B if kind == "qkv_rope" else None)
    # a min_blocks register cap is part of the tiling (gate_up's), so compile with it
    bounds = {"launch_bounds": (t.threads, t.min_blocks)} if t.min_blocks else {}
    ptx = ptx_util.compile_ptx_sm90(fn, sig, **bounds)
    ptx_util.assert_uses(ptx, "lop3.b32", "ld.global.nc.v4.u32", "fma.rn.f16x2", "ld.shared.v4.u32",
                         "shfl.sync.bfly.b32", "griddepcontrol.wait")
    if kind == "qkv_rope":
        # libdevice cosf/sinf keep 7 words in local memory for the Payne-Hanek reduction
        # (|angle| > 1e5 rad), as rope_kv's do (test_attn_cpu); any other local array is a bug
        assert re.findall(r"__local_depot\d+\[(\d+)\]", ptx) == ["28"]
        ptx_util.assert_uses(ptx, "st.global.u16", "st.global.f32")
    else:
        ptx_util.assert_no_local_memory(ptx)
    # the inner loop: per 16 words (128 weights) 64 lop3, 16*6 f16x2 fma (4 dot + 2 dequant)
    rows = 2 if kind in ("gate_up", "qkv_rope") or t.rows == 2 else 1
    assert ptx_util.count(ptx, "lop3.b32") % (64 * rows) == 0
    if not ptx_util.have_ptxas():
        pytest.skip("no nvJitLink or ptxas here: the PTX checks above stand")
    regs, spill = ptx_util.ptxas_report(ptx)   # a PTX ptxas rejects fails here
    if spill and t.min_blocks:
        # This machine's ptxas keeps to a register cap worse than the H200 driver's JIT: gate_up's
        # (192 threads, 3 blocks) cap spills 84 B here but compiles to 95 registers and no local
        # memory there (test_gemv_gpu.test_default_kernels_do_not_spill_on_the_device).  Here,
        # check that the uncapped kernel needs no local memory at all.
        regs, spill = ptx_util.ptxas_report(ptx_util.compile_ptx_sm90(fn, sig))
        assert spill == 0
    elif kind == "qkv_rope":
        # uncapped, this ptxas takes ~210 registers where the H200's JIT takes 124
        # (test_gemv_gpu.test_default_kernels_do_not_spill_on_the_device reads what runs)
        assert spill == 0
    else:
        assert spill == 0 and regs <= 128


def test_lm_head_ptx_sm90():
    from nq.kernels import lm_head as L
    fn, sig = L.build_kernel(152064, 3584, 1e-6, 256, 7)
    ptx = ptx_util.compile_ptx_sm90(fn, sig)
    ptx_util.assert_uses(ptx, "ld.global.nc.v4.u32", "ld.shared.v4.f32")
    ptx_util.assert_no_local_memory(ptx)
    assert ptx_util.count(ptx, "ld.global.nc.v4.u32") == 7


# ---- refusals ------------------------------------------------------------------------------------

def test_refuses_unsupported_shapes_and_tilings():
    with pytest.raises(ValueError, match="multiple of 128"):
        launch.QkvGemv(PRESETS["7b"], 64, 200, 64)
    with pytest.raises(ValueError, match="unsupported tiling"):
        gemv.build_kernel("qkv", 64, 256, Tiling(ks=33), 1e-6)
    with pytest.raises(ValueError, match="unsupported tiling"):   # prefetch=2 is retired
        gemv.build_kernel("qkv", 64, 256, Tiling(ks=2, prefetch=2), 1e-6)
    with pytest.raises(ValueError, match="static shared memory"):
        gemv.build_kernel("down", 64, 27648, Tiling(ks=16), 1e-6)   # the 32B's down_proj
    with pytest.raises(ValueError, match="early=1 loads step 1"):   # one step: nothing to load early
        gemv.build_kernel("qkv", 64, 256, Tiling(ks=2, early=1), 1e-6)
    with pytest.raises(ValueError, match="early=1 loads step 1"):
        gemv.build_kernel("qkv", 64, 512, Tiling(ks=2, prefetch=0, early=1), 1e-6)
    with pytest.raises(ValueError, match="unknown GEMV kind"):
        gemv.build_kernel("up", 64, 256, Tiling(ks=2), 1e-6)
    with pytest.raises(ValueError, match="not a CUDA-core Tiling"):
        gemv.build_kernel("down", 64, 256, MmaTiling(warps=2, threads=64), 1e-6)
    # the CUDA-core launcher refuses an MmaTiling (make_gate_up_gemv takes it to gemv_mma)
    with pytest.raises(ValueError, match="is a tensor-core tiling"):
        launch.GateUpGemv(PRESETS["7b"], 18944, 3584, 2 * 18944, MmaTiling(warps=2, threads=256))


def test_qkv_rope_refusals_and_tiling():
    t2 = Tiling(ks=2, rows=2)
    with pytest.raises(ValueError, match="head_dim=63 is odd"):
        gemv.build_kernel("qkv_rope", 4 * 63, 256, t2, 1e-6, (2, 1, 63))
    with pytest.raises(ValueError, match="rows=2"):
        gemv.build_kernel("qkv_rope", 256, 256, Tiling(ks=2), 1e-6, (2, 1, 64))
    with pytest.raises(ValueError, match="needs heads"):
        gemv.build_kernel("qkv_rope", 256, 256, t2, 1e-6)
    with pytest.raises(ValueError, match="not \\(num_heads"):
        gemv.build_kernel("qkv_rope", 320, 256, t2, 1e-6, (2, 1, 64))
    with pytest.raises(ValueError, match="for qkv_rope only"):
        gemv.build_kernel("qkv", 256, 256, t2, 1e-6, (2, 1, 64))
    # qkv_rope reads the weights qkv's prepare tiled: its default tiling must keep qkv's ks
    # (and threads and span, which bit-identity with qkv + rope_kv needs)
    for n, k in [(4608, 3584), (1152, 896), (512, 256), (2560, 2048)]:
        q, r = default_tiling("qkv", n, k), default_tiling("qkv_rope", n, k)
        assert r == dataclasses.replace(q, rows=2, min_blocks=r.min_blocks,
                                        early=r.early), (n, k)
        assert r.layout() == q.layout()
    # the 7B's two steps load both before the wait (docs/PERF.md 0.26); no other shape does
    assert default_tiling("qkv_rope", 4608, 3584).tag() == "ks14_r2_t384_pf_s128_mb1_e1_i8"
    assert not any(default_tiling("qkv_rope", n, k).early
                   for n, k in [(1152, 896), (512, 256), (2560, 2048), (7168, 5120)])


def test_kernel_names_spell_every_constant():
    """Two kernels that differ in any baked-in constant have different names (profiles and
    errors name them; the kernel cache will key on them)."""
    t = Tiling(ks=14, threads=256, span=128)
    name = gemv.gemv_name("qkv", 4608, 3584, t, 1e-6)
    assert name == ("gemv_int4_qkv_n4608_k3584_ks14_rows1_threads256_prefetch1_span128_"
                    "min_blocks0_eps1em06")
    variants = [gemv.gemv_name("qkv", 4608, 3584, dataclasses.replace(t, **{f.name: v}), 1e-6)
                for f, v in zip(dataclasses.fields(t), (7, 2, 128, 0, 32, 2))]
    variants += [gemv.gemv_name("o_proj", 4608, 3584, t, 1e-6), gemv.gemv_name("qkv", 4096, 3584, t, 1e-6),
                 gemv.gemv_name("qkv", 4608, 3456, t, 1e-6), gemv.gemv_name("qkv", 4608, 3584, t, 1e-5),
                 gemv.gemv_name("qkv_rope", 4608, 3584, t, 1e-6, (28, 4, 128)),
                 gemv.gemv_name("qkv_rope", 4608, 3584, t, 1e-6, (28, 2, 128))]
    assert len({name, *variants}) == len(variants) + 1
    from nq.kernels.int4.gemv_mma import gemv_mma_name
    m = MmaTiling(warps=16, threads=1024)
    assert gemv_mma_name("down", 3584, 18944, m) == \
        "gemv_mma_down_n3584_k18944_warps16_threads1024_min_blocks0"


def _module_imports(path: Path) -> set[str]:
    """Modules a file imports at module level (not inside functions)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_the_two_kernel_factories_do_not_import_each_other():
    """gemv_mma.py never imports gemv.py (nor gemv.py gemv_mma.py or the launchers): the
    make_* dispatch lives above both, in launch.py."""
    int4 = Path(gemv.__file__).parent
    mma, cuda_core = _module_imports(int4 / "gemv_mma.py"), _module_imports(int4 / "gemv.py")
    assert not {m for m in mma if m.startswith(("nq.kernels.int4.gemv", "nq.kernels.int4.launch"))
                and not m.startswith("nq.kernels.int4.gemv_mma")}, mma
    assert not {m for m in cuda_core if m.startswith(("nq.kernels.int4.gemv_mma",
                                                      "nq.kernels.int4.launch"))}, cuda_core
    for name in ("tiling.py", "reference.py", "layout.py", "dequant.py"):   # below the kernels
        assert not {m for m in _module_imports(int4 / name)
                    if m.startswith(("nq.kernels.int4.gemv", "nq.kernels.int4.launch"))}, name


# ---- the kernels under the CUDA simulator -------------------------------------------------------

SIM_PRELUDE = textwrap.dedent('''
    import sys
    import numpy as np
    from numba import cuda
    sys.path.insert(0, "tests")
    import sim_warp
    sim_warp.patch_simulator()   # shuffles: a rendezvous of the caller's warp (nq/ptx/_sim.py)
''')

SIM_SCRIPT = SIM_PRELUDE + textwrap.dedent('''
    from nq.config import PRESETS
    from nq.kernels import lm_head as L
    from nq.kernels.int4 import launch
    from nq.kernels.int4.reference import ref_down, ref_gate_up, ref_o_proj, ref_qkv
    from nq.kernels.int4.tiling import Tiling
    cfg, rng = PRESETS["7b"], np.random.default_rng(0)
    D = cuda.to_device

    rel = sim_warp.rel
    mk = lambda n, k: sim_warp.packed(rng, n, k)   # noqa: E731

    x = (rng.standard_normal(640) * 3).astype(np.float32); x[5] = 400.0
    nw = (1 + 0.1 * rng.standard_normal(640)).astype(np.float16)
    # qkv: K=640 (5 groups over ks=2: a short last step, 3 steps, each prefetched, steps 0 and
    # 1 before the wait: early), N=40 (not a multiple of the 16-row block), two rows a thread
    g = launch.QkvGemv(cfg, 40, 640, 40, Tiling(ks=2, rows=2, threads=64, early=1))
    qw, sc, wd = mk(40, 640); b = (0.1 * rng.standard_normal(40)).astype(np.float16)
    pq, ps = g.prepare([(qw, sc)]); out = D(np.full(40, np.nan, np.float32))
    g(D(x), D(nw), D(pq), D(ps), D(b), out)
    print("qkv", rel(out.copy_to_host(), ref_qkv(x, nw, cfg.rms_norm_eps, wd, b)))
    # gate_up: ks=3 (non-power-of-two lanes), no prefetch, fp16 output
    g = launch.GateUpGemv(cfg, 24, 640, 48, Tiling(ks=3, threads=64, prefetch=0))
    (q1, s1, w1), (q2, s2, w2) = mk(24, 640), mk(24, 640)
    pq, ps = g.prepare([(q1, s1), (q2, s2)]); out = D(np.full(24, np.nan, np.float16))
    g(D(x), D(nw), D(pq), D(ps), out)
    print("gate_up", rel(out.copy_to_host().astype(np.float32), ref_gate_up(x, nw, cfg.rms_norm_eps, w1, w2)))
    # down: fp16 input with a large value, residual add, span 128
    a = (rng.standard_normal(1152) * 2).astype(np.float16); a[7] = 3000.0
    g = launch.ResidualGemv("down", cfg, 16, 1152, 16, Tiling(ks=5, threads=64, span=128))
    qw, sc, wd = mk(16, 1152); xr = rng.standard_normal(16).astype(np.float32)
    pq, ps = g.prepare([(qw, sc)]); xd = D(xr.copy())
    g(D(a), D(pq), D(ps), xd)
    print("down", rel(xd.copy_to_host(), ref_down(a, wd, xr)))
    # o_proj: 5 groups over ks=3 lanes of 4 (one idle), two steps (the second short)
    g = launch.ResidualGemv("o_proj", cfg, 16, 640, 16, Tiling(ks=3, threads=64))
    qw2, sc2, wd2 = mk(16, 640); a2 = a[:640].copy()
    pq, ps = g.prepare([(qw2, sc2)]); xd = D(xr.copy())
    g(D(a2), D(pq), D(ps), xd)
    print("o_proj", rel(xd.copy_to_host(), ref_o_proj(a2, wd2, xr)))
    class C: vocab_size, hidden_size, rms_norm_eps = 37, 136, 1e-6
    head = L.LmHead(C, threads=64, unroll=2, grid=3)
    w = (0.05 * rng.standard_normal((37, 136))).astype(np.float16); lo = D(np.full(37, np.nan, np.float32))
    head(D(x[:136].copy()), D(nw[:136].copy()), D(w), lo)
    print("lm_head", rel(lo.copy_to_host(), L.ref_lm_head(x[:136], nw[:136], 1e-6, w)))
''')


@pytest.mark.slow
def test_kernels_under_the_simulator():
    errs, stdout = ptx_util.run_under_simulator(SIM_SCRIPT, timeout=900)
    assert set(errs) == {"qkv", "gate_up", "down", "o_proj", "lm_head"}, stdout
    tol = {"qkv": 2e-3, "gate_up": 3e-3, "down": 2e-3, "o_proj": 2e-3,
           "lm_head": 1e-6}  # see test_gemv_gpu.py
    for name, e in errs.items():
        assert e < tol[name], (name, e)


SIM_ROPE_SCRIPT = SIM_PRELUDE + textwrap.dedent('''
    import types
    from numba.cuda.simulator import kernel as simk
    from nq.kernels import rope_kv as R
    from nq.kernels.int4 import launch
    from nq.kernels.int4.reference import ref_qkv_rope
    from nq.kernels.int4.tiling import Tiling
    from nq.paged import PAGE, pool_shape
    from nq.runtime.kv_cache import make_state
    from nq.loader.quant import quantize_pack, dequantize_packed
    rng = np.random.default_rng(1)
    D = cuda.to_device

    class RunningFakeCuda:
        # rope_kv's kernel imports cuda inside its factory (a closure cell), which the
        # simulator does not swap for its fake module as it does globals: forward to the
        # running launch's fake module
        def __getattr__(self, name):
            return getattr(simk._kernel_context, name)

    def rope_kv_sim(cfg):
        fn = R.rope_kv_body(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        cells = tuple(types.CellType(RunningFakeCuda()) if n == "cuda" else c
                      for n, c in zip(fn.__code__.co_freevars, fn.__closure__))
        return cuda.jit(types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, None, cells))

    rel = sim_warp.rel

    class Cfg:  # what the kernels and references read of a ModelConfig; one q head (tiny)
        def __init__(self, d, k):
            self.head_dim, self.hidden_size, self.num_heads, self.num_kv_heads = d, k, 1, 1
            self.q_size = self.kv_size = d
            self.qkv_size, self.num_layers, self.rms_norm_eps, self.rope_theta = 3 * d, 1, 1e-6, 1e6

    # (head_dim, K, the tiling of both kinds, positions).  d64: ks=2 (lane pairs), 128-thread
    # blocks of 64 pairs (96 pairs: the second block part empty).  d128: K=256 over ks=1 is
    # two steps (the second prefetched), span 128.  Positions: the last slot of page 0, the
    # first of page 1, 0, and 1000 (page 62, through a permuted table).
    cases = [(64, 128, dict(threads=128, ks=2), (15, 16)),
             (128, 256, dict(threads=64, ks=1, span=128, early=1), (0, 1000)),
             # the 7B's grid shape (ks 14, 384 threads: 12 warps, 48 rows a block) and the
             # 14B's (ks 8, 512 threads: 128 rows a block), here 8 and 3 blocks
             (128, 1792, dict(threads=384, ks=14, span=128), (17,)),
             (128, 1024, dict(threads=512, ks=8), (33,)),
             # the activations as digits (Tiling.i8, gemv_digits.py: both kernels sum by dp4a)
             (64, 256, dict(threads=64, ks=2, i8=1), (16,))]
    for d, k, tk, positions in cases:
        tag = f"d{d}" + ("i8" if tk.get("i8") else "")
        if not any(f"{tag}_pos{p}" in PICK for p in positions):
            continue
        cfg = Cfg(d, k)
        n, hq, hkv = cfg.qkv_size, 1, 1
        x = (rng.standard_normal(k) * 3).astype(np.float32); x[5] = 400.0
        nw = (1 + 0.1 * rng.standard_normal(k)).astype(np.float16)
        parts = [quantize_pack(rng.standard_normal((m, k)).astype(np.float32) * 0.05)
                 for m in (cfg.q_size, cfg.kv_size, cfg.kv_size)]
        wd = np.concatenate([dequantize_packed(q, s) for q, s in parts])
        bias = (0.5 * rng.standard_normal(n)).astype(np.float16)
        fused = launch.make_qkv_rope_gemv(cfg, Tiling(rows=2, **tk))
        # the plain kernel without early: step 1's loads before the wait change no bit
        plain = launch.make_qkv_gemv(cfg, Tiling(rows=1, **dict(tk, early=0)))
        pq, ps = plain.prepare(parts)   # one upload serves both kinds
        args = [D(x), D(nw), D(pq), D(ps), D(bias)]
        qkv = D(np.full(n, np.nan, np.float32))
        plain(*args, qkv)
        inv = D(R.rope_inv_freq(d, cfg.rope_theta))
        n_pages = max(positions) // PAGE + 2
        table = rng.permutation(n_pages).astype(np.int32)
        rope = rope_kv_sim(cfg)
        for pos in positions:
            if f"{tag}_pos{pos}" not in PICK:
                continue
            state = make_state(pos=pos)
            # a finite sentinel everywhere (the slot is rewritten, nothing else may be)
            pools = [D(np.full(pool_shape(cfg, n_pages)[1:], 7.0, np.float16)) for _ in range(2)]
            qs = [D(np.full(cfg.q_size, np.nan, np.float32)) for _ in range(2)]
            fused(*args, state, inv, D(table), pools[0], qs[0])
            rope[hq + 2 * hkv, d // 2](qkv, state, inv, D(table), pools[1], qs[1])
            kv, kv2 = pools[0].copy_to_host(), pools[1].copy_to_host()
            q, q2 = qs[0].copy_to_host(), qs[1].copy_to_host()
            same = (np.array_equal(kv.view(np.uint16), kv2.view(np.uint16))
                    and np.array_equal(q.view(np.uint32), q2.view(np.uint32)))
            q_ref, k_ref, v_ref = ref_qkv_rope(cfg, x, nw, wd, bias, pos)
            page, slot = table[pos // PAGE], pos % PAGE
            got = np.concatenate([q, kv[page, :, 0, slot].ravel(), kv[page, :, 1, slot].ravel()])
            ref = np.concatenate([q_ref.ravel(), k_ref.ravel(), v_ref.ravel()])
            kv[page, :, :, slot] = 7.0
            print(f"{tag}_pos{pos}_err", rel(got.astype(np.float32), ref.astype(np.float32)))
            print(f"{tag}_pos{pos}_same", float(same))
            print(f"{tag}_pos{pos}_elsewhere", float((kv != 7.0).sum()))
''')


# ~35 s a position on 2 cores: CI's tier takes d64's first slot of page 1 and d128's position
# 1000 through the permuted table, and the digits' d64 case (qkv's default form); the long tier (`pytest -m long`) the other two and the
# 7B's and 14B's grid shapes (8 blocks of 384 threads, 3 of 512: ~4 min; passed 2026-12-03)
ROPE_PICK = ("d64_pos16", "d128_pos1000", "d64i8_pos16")
ROPE_PICK_LONG = ("d64_pos15", "d128_pos0", "d128_pos17", "d128_pos33")


@pytest.mark.slow
def test_qkv_rope_under_the_simulator():
    _qkv_rope_under_the_simulator(ROPE_PICK)


@pytest.mark.long
def test_qkv_rope_under_the_simulator_other_positions():
    _qkv_rope_under_the_simulator(ROPE_PICK_LONG)


def _qkv_rope_under_the_simulator(keys):
    """qkv_rope against ref_qkv_rope, and bit for bit against qkv + rope_kv's kernel (both run
    in the simulator: same fp32 operations in the same order, no contraction there)."""
    vals, stdout = ptx_util.run_under_simulator(f"PICK = {list(keys)!r}\n" + SIM_ROPE_SCRIPT,
                                                timeout=900)
    assert {name.rsplit("_", 1)[0] for name in vals} == set(keys), stdout
    for key in keys:
        assert vals[f"{key}_err"] < 2e-3, (key, stdout)         # as qkv's tolerance above
        assert vals[f"{key}_same"] == 1.0, (key, "differs from qkv + rope_kv", stdout)
        assert vals[f"{key}_elsewhere"] == 0.0, (key, "wrote outside its KV slot", stdout)
