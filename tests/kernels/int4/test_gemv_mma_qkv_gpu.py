"""GPU tests of qkv and qkv_rope on the tensor cores (gemv_mma kinds "qkv", "qkv_rope", opt-in
NQ_MMA_QKV=1; H200: -m gpu), against fp64 (reference.ref_qkv_rope_mma).

Tolerances (test_gemv_mma_qkv_cpu.py derives them): q and qkv 6e-4 of the reference's norm (the
fp16 staged activations, 2^-11 where one channel dominates; fp32 sums), k and v 1.1e-3 (their
fp16 store adds 2^-11); with hilo (h staged as fp16 hi + lo, the default) q and qkv 1e-5, k
and v 6e-4 (the store alone).  The outputs start as NaN, so an unwritten element fails.
"""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from numba import cuda  # noqa: E402  (the marker deselects this module on CPU-only runs)

from nq.config import PRESETS  # noqa: E402
from nq.kernels.int4.launch import (QkvMmaGemv, QkvRopeMmaGemv, make_qkv_gemv,  # noqa: E402
                                    make_qkv_rope_gemv)
from nq.kernels.int4.reference import ref_qkv_rope_mma  # noqa: E402
from nq.kernels.int4.tiling import MmaTiling as T, mma_tiling  # noqa: E402
from nq.kernels.rope_kv import rope_inv_freq  # noqa: E402
from nq.loader.quant import dequantize_packed  # noqa: E402
from nq.paged import PAGE, STATE_LEN, STATE_POS  # noqa: E402


def run(cfg, tiling, seed, pos=4097):
    rng = np.random.default_rng(seed)
    n, k, d = cfg.qkv_size, cfg.hidden_size, cfg.head_dim
    qw = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    sc = rng.uniform(0.002, 0.02, size=(n, k // 128)).astype(np.float16)
    bias = (0.1 * rng.standard_normal(n)).astype(np.float16)
    x = (rng.standard_normal(k) * 2).astype(np.float32)
    x[rng.integers(0, k)] = 900.0                      # a "massive activation" channel
    nw = (1 + 0.2 * rng.standard_normal(k)).astype(np.float16)
    inv = rope_inv_freq(d, cfg.rope_theta)
    g = make_qkv_rope_gemv(cfg, tiling)
    assert isinstance(g, QkvRopeMmaGemv)
    pq, ps = g.prepare([(qw, sc)])
    q_out = cuda.to_device(np.full(cfg.num_heads * d, np.nan, np.float32))
    kv = cuda.to_device(np.full((4, cfg.num_kv_heads, 2, PAGE, d), np.nan, np.float16))
    state = np.zeros(STATE_LEN, np.int32)
    state[STATE_POS] = pos
    table = np.zeros(1024, np.int32)
    table[pos // PAGE] = 3
    args = [cuda.to_device(a) for a in (x, nw, pq, ps, bias)]
    g(*args, cuda.to_device(state), cuda.to_device(inv), cuda.to_device(table), kv, q_out, 0)
    out = cuda.to_device(np.full(n, np.nan, np.float32))
    make_qkv_gemv(cfg, tiling)(*args, out, 0)
    kvh = kv.copy_to_host()
    got = {"q": q_out.copy_to_host().reshape(cfg.num_heads, d), "k": kvh[3, :, 0, pos % PAGE],
           "v": kvh[3, :, 1, pos % PAGE], "qkv": out.copy_to_host()}
    y, rq, rk, rv = ref_qkv_rope_mma(cfg, x, nw, dequantize_packed(qw, sc).astype(np.float64),
                                     bias, inv, pos)
    return got, {"q": rq, "k": rk, "v": rv, "qkv": y}


@pytest.mark.parametrize("model,tiling", [
    ("7b", None),                                  # 14 warps, one tile a block (hilo=0 unless NQ_MMA_QKV=1)
    ("7b", T(warps=14, threads=448, rope=128, hilo=1)),   # NQ_MMA_QKV=1: h as hi + lo
    ("0.5b", None),                                # D = 64, 7 groups over 3 warps
    ("14b", None),                                 # 40 groups over 10 warps
    ("7b", T(warps=7, threads=448, rope=128)),     # two tiles a block
    ("7b", T(warps=4, threads=256, rope=128)),     # 7 groups a warp, a half-empty last iteration
    ("7b", T(warps=7, threads=448, rope=128, hilo=1)),
    ("7b", T(warps=4, threads=512, rope=128, hilo=1)),
    ("14b", T(warps=10, threads=320, rope=128, hilo=1)),   # 4 staged groups a warp
    ("7b", T(warps=14, threads=448, rope=128, i8=1)),      # h as three signed-byte digits
    ("7b", T(warps=7, threads=448, rope=128, i8=1)),
    ("0.5b", T(warps=3, threads=96, rope=64, i8=1)),
    ("14b", T(warps=10, threads=320, rope=128, i8=1)),
])
def test_qkv_rope_against_the_reference(model, tiling):
    cfg = PRESETS[model]
    t = tiling or mma_tiling("qkv_rope", cfg.qkv_size, cfg.hidden_size, cfg.head_dim)
    got, want = run(cfg, t, seed=cfg.hidden_size + t.warps)
    for part in ("q", "k", "v", "qkv"):
        a = got[part].astype(np.float64)
        assert np.isfinite(a).all(), (part, int((~np.isfinite(a)).sum()))
        err = float(np.linalg.norm(a - want[part]) / np.linalg.norm(want[part]))
        if t.hilo or t.i8:   # h as hi + lo or digits: q and qkv are fp32-accurate sums
            assert err < (6e-4 if part in ("k", "v") else 1e-5), (model, t.tag(), part, err)
        else:
            assert err < (1.1e-3 if part in ("k", "v") else 6e-4), (model, t.tag(), part, err)


def test_qkv_rope_is_deterministic():
    cfg = PRESETS["7b"]
    t = mma_tiling("qkv_rope", cfg.qkv_size, cfg.hidden_size, cfg.head_dim)
    a, _ = run(cfg, t, seed=3)
    b, _ = run(cfg, t, seed=3)
    for part in a:   # one writer per element, the warps' partials added in a fixed order
        assert np.array_equal(a[part], b[part]), part


def test_qkv_kernels_do_not_spill_on_the_device():
    cfg = PRESETS["7b"]
    t = mma_tiling("qkv_rope", cfg.qkv_size, cfg.hidden_size, cfg.head_dim)
    for g in (make_qkv_rope_gemv(cfg, t), make_qkv_gemv(cfg, t)):
        assert isinstance(g, (QkvRopeMmaGemv, QkvMmaGemv))
        local = g.kernel.get_local_mem_per_thread()
        # qkv_rope: libdevice sinf/cosf keep 28 B for the Payne-Hanek reduction (rope_kv's too)
        assert local <= (32 if g.kind == "qkv_rope" else 0), (g.name, local)
        print(f"{g.name}: {g.kernel.get_regs_per_thread()} registers, {local} B local")
