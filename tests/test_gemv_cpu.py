"""CPU tests of the INT4 GEMVs and the lm_head: layout model, dequant arithmetic, sm_90 PTX,
launcher refusals, and the kernels themselves under the CUDA simulator (tiny shapes)."""
import textwrap

import numpy as np
import pytest

from nq.config import PRESETS
from nq.kernels import gemv_int4 as G
from nq.loader.quant import pack_value_shuffle, unpack_value_shuffle
from nq.ptx import LUT_AND_XOR, add_rn_f16x2, fma_rn_f16x2, lop3_b32
from nq.ptx.half import f16_value


# ---- the tile layout ---------------------------------------------------------------------------

@pytest.mark.parametrize("k,ks", [(3584, 7), (3584, 4), (18944, 16), (18944, 30), (896, 3),
                                  (128, 1), (4864, 32)])
def test_chunk_permutation_is_a_permutation(k, ks):
    perm = G.chunk_permutation(k, ks)
    assert sorted(perm.tolist()) == list(range(k // 32))


@pytest.mark.parametrize("k,ks", [(3584, 7), (18944, 30), (896, 3), (640, 4)])
def test_kernel_addressing_reads_the_right_chunks(k, ks):
    """The kernel's address arithmetic (load_row) on the tiled row finds file chunk 4g+i."""
    rng = np.random.default_rng(k + ks)
    qw = rng.integers(0, 2**32, size=(3, k // 8), dtype=np.uint32)
    tiled = G.tile_rows(qw, ks)
    assert np.array_equal(G.untile_rows(tiled, ks), qw)
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
    qw, sc = G.prepare_weights(parts, ks=2)
    assert qw.shape == (32, 32) and sc.shape == (32, 2)
    assert np.array_equal(G.untile_rows(qw, 2), np.concatenate([p[0] for p in parts]))
    with pytest.raises(ValueError, match="scales"):
        G.prepare_weights([(parts[0][0], parts[0][1].astype(np.float32))], ks=2)


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

SEVEN_B = {"qkv": (4608, 3584), "o_proj": (3584, 3584), "gate_up": (18944, 3584), "down": (3584, 18944)}


@pytest.mark.parametrize("kind,tiling", [(k, None) for k in G.KINDS]
                         + [("down", G.Tiling(ks=16, threads=512, prefetch=2))])
def test_gemv_ptx_sm90(kind, tiling):
    n, k = SEVEN_B[kind]
    t = tiling or G.default_tiling(kind, n, k)
    fn, sig = G.build_kernel(kind, n, k, t, 1e-6)
    ptx = ptx_util.compile_ptx_sm90(fn, sig)
    ptx_util.assert_uses(ptx, "lop3.b32", "ld.global.nc.v4.u32", "fma.rn.f16x2", "ld.shared.v4.u32",
                         "shfl.sync.bfly.b32")
    ptx_util.assert_no_local_memory(ptx)
    # the inner loop: per 16 words (128 weights) 64 lop3, 16*6 f16x2 fma (4 dot + 2 dequant)
    rows = 2 if kind == "gate_up" else 1
    assert ptx_util.count(ptx, "lop3.b32") % (64 * rows) == 0
    try:
        regs, spill = ptx_util.ptxas_report(ptx)
    except Exception as e:  # noqa: BLE001 -- no nvJitLink/ptxas here: the PTX checks stand
        pytest.skip(f"no ptxas: {e}")
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
        G.QkvGemv(PRESETS["7b"], 64, 200, 64)
    with pytest.raises(ValueError, match="unsupported tiling"):
        G.build_kernel("qkv", 64, 256, G.Tiling(ks=33), 1e-6)
    with pytest.raises(ValueError, match="static shared memory"):
        G.build_kernel("down", 64, 27648, G.Tiling(ks=16), 1e-6)   # the 32B's down_proj
    with pytest.raises(ValueError, match="unknown GEMV kind"):
        G.build_kernel("up", 64, 256, G.Tiling(ks=2), 1e-6)


# ---- the kernels under the CUDA simulator -------------------------------------------------------

SIM_SCRIPT = textwrap.dedent('''
    import threading, numpy as np
    from numba import cuda
    from numba.cuda.simulator import kernelapi
    _lock = threading.Lock()

    def shfl_xor_sync(self, mask, value, lanemask):
        # the simulator has no shuffles: a per-warp barrier exchange (full-mask calls only)
        t = threading.current_thread()
        with _lock:
            warps = t._manager.__dict__.setdefault("_nq_warps", {})
            bar, box = warps.setdefault(t.thread_id // 32, (threading.Barrier(32), {}))
        lane = t.thread_id % 32
        box[lane] = value
        bar.wait()
        v = box[lane ^ lanemask]
        bar.wait()
        return v
    kernelapi.FakeCUDAModule.shfl_xor_sync = shfl_xor_sync

    from nq.config import PRESETS
    from nq.kernels import gemv_int4 as G, lm_head as L
    from nq.loader.quant import quantize_pack, dequantize_packed
    cfg, rng = PRESETS["7b"], np.random.default_rng(0)
    D = cuda.to_device

    def rel(a, b):
        assert np.isfinite(a).all()
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    def mk(n, k):
        qw, sc = quantize_pack(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
        return qw, sc, dequantize_packed(qw, sc)

    x = (rng.standard_normal(640) * 3).astype(np.float32); x[5] = 400.0
    nw = (1 + 0.1 * rng.standard_normal(640)).astype(np.float16)
    # qkv: K=640 (5 groups over ks=2: a short last step, 3 steps: two in flight), N=40 (not a
    # multiple of the 16-row block)
    g = G.QkvGemv(cfg, 40, 640, 40, G.Tiling(ks=2, rows=2, threads=64, l2_steps=1, prefetch=2))
    qw, sc, wd = mk(40, 640); b = (0.1 * rng.standard_normal(40)).astype(np.float16)
    pq, ps = g.prepare([(qw, sc)]); out = D(np.full(40, np.nan, np.float32))
    g(D(x), D(nw), D(pq), D(ps), D(b), out)
    print("qkv", rel(out.copy_to_host(), G.ref_qkv(x, nw, cfg.rms_norm_eps, wd, b)))
    # gate_up: ks=3 (non-power-of-two lanes), fp16 output
    g = G.GateUpGemv(cfg, 24, 640, 48, G.Tiling(ks=3, threads=64, prefetch=False, l2_steps=9))
    (q1, s1, w1), (q2, s2, w2) = mk(24, 640), mk(24, 640)
    pq, ps = g.prepare([(q1, s1), (q2, s2)]); out = D(np.full(24, np.nan, np.float16))
    g(D(x), D(nw), D(pq), D(ps), out)
    print("gate_up", rel(out.copy_to_host().astype(np.float32), G.ref_gate_up(x, nw, cfg.rms_norm_eps, w1, w2)))
    # down: fp16 input with a large value, residual add, span 128
    a = (rng.standard_normal(1152) * 2).astype(np.float16); a[7] = 3000.0
    g = G.ResidualGemv("down", cfg, 16, 1152, 16, G.Tiling(ks=5, threads=64, span=128))
    qw, sc, wd = mk(16, 1152); xr = rng.standard_normal(16).astype(np.float32)
    pq, ps = g.prepare([(qw, sc)]); xd = D(xr.copy())
    g(D(a), D(pq), D(ps), xd)
    print("down", rel(xd.copy_to_host(), G.ref_down(a, wd, xr)))
    class C: vocab_size, hidden_size, rms_norm_eps = 37, 136, 1e-6
    head = L.LmHead(C, threads=64, unroll=2, grid=3)
    w = (0.05 * rng.standard_normal((37, 136))).astype(np.float16); lo = D(np.full(37, np.nan, np.float32))
    head(D(x[:136].copy()), D(nw[:136].copy()), D(w), lo)
    print("lm_head", rel(lo.copy_to_host(), L.ref_lm_head(x[:136], nw[:136], 1e-6, w)))
''')


@pytest.mark.slow
def test_kernels_under_the_simulator():
    errs, stdout = ptx_util.run_under_simulator(SIM_SCRIPT, timeout=900)
    assert set(errs) == {"qkv", "gate_up", "down", "lm_head"}, stdout
    tol = {"qkv": 2e-3, "gate_up": 3e-3, "down": 2e-3, "lm_head": 1e-6}  # see test_gemv_gpu.py
    for name, e in errs.items():
        assert e < tol[name], (name, e)
