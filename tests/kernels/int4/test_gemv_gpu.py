"""GPU tests of the INT4 GEMVs and the lm_head against their NumPy references (H200: -m gpu).

Inputs are random and fresh per case; outputs are poisoned with NaN first, so an unwritten
element fails.  Tolerance, relative to the reference's norm (||out - ref|| / ||ref||):
  * INT4 GEMVs 5e-3: activations are rounded to fp16 (2^-11 relative each) and each 32-weight
    fp16 partial sum adds a few roundings of 2^-11 of its magnitude; these errors are random
    in sign across the K/32 partials, measured ~3e-4..1.5e-3 in the simulator.  gate_up's
    fp16 output adds 2^-11.
  * lm_head 1e-5: fp32 h and fp32 sums over fp16 weights (exact products), only summation
    order differs from the reference.
Weights are random nibbles (all of -8..7, a superset of what the quantiser writes) with fp16
scales; the reference multiplies the same dequantised weights in fp32.

qkv_rope (qkv with rope_kv as its epilogue) must equal qkv followed by rope_kv bit for bit:
same weights, same threads/ks/span (its default tiling is qkv's with rows=2), so the same
fp32 sums, rstd and bias add, then rope_kv's rotation with the same fmas.
"""
from types import SimpleNamespace

import dataclasses

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from numba import cuda  # noqa: E402  (the marker deselects this module on CPU-only runs)

from nq.config import PRESETS, tiny_config  # noqa: E402
from nq.kernels.int4 import launch  # noqa: E402
from nq.kernels.int4.reference import ref_gate_up, ref_o_proj, ref_qkv, ref_qkv_rope  # noqa: E402
from nq.kernels.int4 import tiling as tiling_mod  # noqa: E402
from nq.kernels.int4.tiling import Tiling  # noqa: E402
from nq.kernels import lm_head as L  # noqa: E402
from nq.kernels import rope_kv as R  # noqa: E402
from nq.paged import PAGE, pool_shape
from nq.runtime.kv_cache import make_state  # noqa: E402
from nq.loader.quant import dequantize_packed  # noqa: E402

TOL_INT4 = 5e-3
TOL_HEAD = 1e-5


def rel(got, ref):
    assert np.isfinite(got).all(), f"{int((~np.isfinite(got)).sum())} non-finite outputs"
    return float(np.linalg.norm(got.astype(np.float64) - ref) / np.linalg.norm(ref))


def rand_int4(rng, n, k):
    qw = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    sc = rng.uniform(0.002, 0.02, size=(n, k // 128)).astype(np.float16)
    return qw, sc, dequantize_packed(qw, sc)


SHAPES = [  # (kind, n_out, k)
    ("qkv", 4608, 3584), ("o_proj", 3584, 3584), ("gate_up", 18944, 3584), ("down", 3584, 18944),
    ("qkv", 1152, 896), ("o_proj", 896, 896), ("gate_up", 4864, 896), ("down", 896, 4864),
    ("qkv", 1000, 128), ("down", 200, 4864), ("gate_up", 1000, 640), ("o_proj", 8, 128),
]
TILINGS = [None, Tiling(ks=3, rows=2, threads=64), Tiling(ks=8, span=128, prefetch=0),
           Tiling(ks=5, threads=256, min_blocks=2), Tiling(ks=2, threads=128)]


def run_case(kind, n, k, tiling, seed):
    rng = np.random.default_rng(seed)
    cfg = PRESETS["7b"]
    x = (rng.standard_normal(k) * 2).astype(np.float32)
    x[rng.integers(0, k)] = 900.0                      # a "massive activation" channel
    nw = (1 + 0.2 * rng.standard_normal(k)).astype(np.float16)
    if kind == "qkv":
        g = launch.QkvGemv(cfg, n, k, n, tiling)
        qw, sc, wd = rand_int4(rng, n, k)
        bias = (0.5 * rng.standard_normal(n)).astype(np.float16)
        pq, ps = g.prepare([(qw, sc)])
        out = cuda.to_device(np.full(n, np.nan, np.float32))
        g(cuda.to_device(x), cuda.to_device(nw), cuda.to_device(pq), cuda.to_device(ps),
          cuda.to_device(bias), out, 0)
        return out.copy_to_host(), ref_qkv(x, nw, cfg.rms_norm_eps, wd, bias)
    if kind == "gate_up":
        g = launch.GateUpGemv(cfg, n, k, 2 * n, tiling)
        q1, s1, w1 = rand_int4(rng, n, k)
        q2, s2, w2 = rand_int4(rng, n, k)
        pq, ps = g.prepare([(q1, s1), (q2, s2)])
        out = cuda.to_device(np.full(n, np.nan, np.float16))
        g(cuda.to_device(x), cuda.to_device(nw), cuda.to_device(pq), cuda.to_device(ps), out, 0)
        return out.copy_to_host().astype(np.float32), ref_gate_up(x, nw, cfg.rms_norm_eps, w1, w2)
    g = launch.ResidualGemv(kind, cfg, n, k, n, tiling)
    qw, sc, wd = rand_int4(rng, n, k)
    a = (rng.standard_normal(k) * 3).astype(np.float16)
    a[rng.integers(0, k)] = 3000.0
    xr = rng.standard_normal(n).astype(np.float32)
    pq, ps = g.prepare([(qw, sc)])
    xd = cuda.to_device(xr)
    g(cuda.to_device(a), cuda.to_device(pq), cuda.to_device(ps), xd, 0)
    return xd.copy_to_host(), ref_o_proj(a, wd, xr)


@pytest.mark.parametrize("kind", ["qkv", "o_proj", "gate_up", "down", "qkv_rope"])
def test_default_kernels_do_not_spill_on_the_device(kind):
    """The register caps (min_blocks) are chosen for the device's JIT, which the offline ptxas
    of the CPU tests does not reproduce: read the local memory of what actually runs."""
    cfg = PRESETS["7b"]
    make = {"qkv": launch.make_qkv_gemv, "o_proj": launch.make_o_proj_gemv,
            "gate_up": launch.make_gate_up_gemv, "down": launch.make_down_gemv,
            "qkv_rope": launch.make_qkv_rope_gemv}[kind]
    kern = make(cfg).kernel
    local = kern.get_local_mem_per_thread()
    print(kind, make(cfg).tiling.tag(), "registers", kern.get_regs_per_thread(), "local", local)
    # qkv_rope: libdevice sinf/cosf keep 28 B for the Payne-Hanek reduction (rope_kv's too)
    assert local <= (32 if kind == "qkv_rope" else 0), (kind, local, kern.get_regs_per_thread())


@pytest.mark.parametrize("kind,n,k", SHAPES)
def test_int4_gemv_default_tiling(kind, n, k):
    got, ref = run_case(kind, n, k, None, seed=n + k)
    assert rel(got, ref) < TOL_INT4


@pytest.mark.parametrize("tiling", TILINGS[1:], ids=lambda t: t.tag())
@pytest.mark.parametrize("kind,n,k", [("qkv", 1000, 896), ("gate_up", 600, 640),
                                      ("down", 3584, 18944), ("o_proj", 200, 4864)])
def test_int4_gemv_tilings(kind, n, k, tiling):
    got, ref = run_case(kind, n, k, tiling, seed=7)
    assert rel(got, ref) < TOL_INT4


TOL_I8 = 2e-5   # digits: exact int32 sums of 2^-22-of-absmax activations, fp32 group sums


@pytest.mark.parametrize("kind,n,k,tiling", [
    ("qkv", 4608, 3584, None),                                   # the 7B's default (i8)
    ("qkv", 1000, 896, Tiling(ks=3, rows=2, threads=64, i8=1)),
    ("o_proj", 3584, 3584, Tiling(ks=14, threads=256, i8=1)),
    ("gate_up", 600, 640, Tiling(ks=3, threads=64, prefetch=0, i8=1)),
    ("down", 896, 4864, Tiling(ks=8, threads=128, span=128, i8=1))],
    ids=lambda v: v.tag() if isinstance(v, Tiling) else str(v))
def test_int4_gemv_i8_is_fp32_accurate(kind, n, k, tiling):
    """Tiling.i8 (gemv_digits.py) within TOL_I8 of the fp32 reference, where the fp16 kernel is
    held to TOL_INT4; gate_up's output is fp16 (2^-11)."""
    if tiling is None:
        assert launch.gemv_tiling("qkv", PRESETS["7b"]).i8 == (tiling_mod.I8 != "0")
    got, ref = run_case(kind, n, k, tiling, seed=17)
    assert rel(got, ref) < (6e-4 if kind == "gate_up" else TOL_I8)


@pytest.mark.parametrize("kind,n,k,tiling", [
    ("down", 3584, 18944, Tiling(ks=16, threads=512)),
    ("o_proj", 3584, 3584, Tiling(ks=14, threads=256)),
    ("qkv", 1000, 896, Tiling(ks=3, rows=2, threads=64)),
    ("gate_up", 18944, 3584, Tiling(ks=4, threads=192, span=128, min_blocks=3))],
    ids=lambda v: v.tag() if isinstance(v, Tiling) else str(v))
def test_int4_gemv_prefetch_keeps_the_bits(kind, n, k, tiling):
    """`prefetch` only moves the next step's loads before this step's math: the same products
    in the same order, so the same bits with and without it."""
    got, ref = run_case(kind, n, k, tiling, seed=11)
    assert rel(got, ref) < TOL_INT4
    without, _ = run_case(kind, n, k, dataclasses.replace(tiling, prefetch=0), seed=11)
    assert np.array_equal(got, without)


@pytest.mark.parametrize("kind,n,k,tiling", [
    ("qkv", 4608, 3584, Tiling(ks=14, threads=384, span=128)),
    ("down", 3584, 18944, Tiling(ks=16, threads=512)),
    ("gate_up", 18944, 3584, Tiling(ks=4, threads=192, span=128))],
    ids=lambda v: v.tag() if isinstance(v, Tiling) else str(v))
def test_int4_gemv_early_keeps_the_bits(kind, n, k, tiling):
    """`early` only moves step 1's loads before griddepcontrol.wait: the same bits."""
    got, ref = run_case(kind, n, k, dataclasses.replace(tiling, early=1), seed=13)
    assert rel(got, ref) < TOL_INT4
    without, _ = run_case(kind, n, k, tiling, seed=13)
    assert np.array_equal(got, without)


def test_qkv_rope_early_keeps_the_bits():
    """The 7B's qkv_rope with step 1's loads before the wait (its default): q and the pool bit
    for bit the kernel's without it."""
    cfg = PRESETS["7b"]
    rng = np.random.default_rng(21)
    n, k = cfg.qkv_size, cfg.hidden_size
    t = launch.gemv_tiling("qkv_rope", cfg)
    base = launch.make_qkv_rope_gemv(cfg, dataclasses.replace(t, early=0))
    early = launch.make_qkv_rope_gemv(cfg, dataclasses.replace(t, early=1))
    parts = [rand_int4(rng, m, k) for m in (cfg.q_size, cfg.kv_size, cfg.kv_size)]
    pq, ps = base.prepare([p[:2] for p in parts])
    d = cuda.to_device
    x = (rng.standard_normal(k) * 2).astype(np.float32)
    nw = (1 + 0.2 * rng.standard_normal(k)).astype(np.float16)
    bias = (0.5 * rng.standard_normal(n)).astype(np.float16)
    args = [d(x), d(nw), d(pq), d(ps), d(bias)]
    state, inv = make_state(pos=700), d(R.rope_inv_freq(cfg.head_dim, cfg.rope_theta))
    table = d(rng.permutation(48).astype(np.int32))
    pool0 = rng.standard_normal(pool_shape(cfg, 48)[1:]).astype(np.float16)
    outs = []
    for g in (base, early):
        pool, q = d(pool0), d(np.full(cfg.q_size, np.nan, np.float32))
        g(*args, state, inv, table, pool, q, 0)
        outs.append((q.copy_to_host().view(np.uint32), pool.copy_to_host().view(np.uint16)))
    assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1])


def test_int4_gemv_deterministic():
    a, _ = run_case("down", 3584, 18944, None, seed=3)
    b, _ = run_case("down", 3584, 18944, None, seed=3)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("vocab,k,kw", [(152064, 3584, {}), (151936, 896, {}),
                                        (1000, 136, {"unroll": 3, "grid": 5})])
def test_lm_head(vocab, k, kw):
    rng = np.random.default_rng(vocab)
    cfg = SimpleNamespace(vocab_size=vocab, hidden_size=k, rms_norm_eps=1e-6)  # all LmHead reads
    head = L.make_lm_head(cfg, **kw)
    x = (rng.standard_normal(k) * 2).astype(np.float32)
    nw = (1 + 0.2 * rng.standard_normal(k)).astype(np.float16)
    w = (0.05 * rng.standard_normal((vocab, k), dtype=np.float32)).astype(np.float16)
    out = cuda.to_device(np.full(vocab, np.nan, np.float32))
    head(cuda.to_device(x), cuda.to_device(nw), cuda.to_device(w), out, 0)
    got = out.copy_to_host()
    assert rel(got, L.ref_lm_head(x, nw, cfg.rms_norm_eps, w)) < TOL_HEAD


@pytest.mark.parametrize("pos", [0, 15, 16, 1000])
@pytest.mark.parametrize("cfg", [PRESETS["7b"], PRESETS["14b"], tiny_config()],
                         ids=["7b", "14b", "tiny"])   # the 14B's qkv: 256 threads, 112 blocks
def test_qkv_rope_equals_qkv_then_rope_kv(cfg, pos):
    """The fused kernel's q_out and whole KV pool bit for bit against qkv + rope_kv (default
    tilings, one upload of qkv's prepared weights), and within TOL_INT4 of ref_qkv_rope."""
    rng = np.random.default_rng(pos + cfg.head_dim)
    n, k = cfg.qkv_size, cfg.hidden_size
    fused, plain = launch.make_qkv_rope_gemv(cfg), launch.make_qkv_gemv(cfg)
    assert fused.tiling.ks == plain.tiling.ks and fused.tiling.threads == plain.tiling.threads
    x = (rng.standard_normal(k) * 2).astype(np.float32)
    x[rng.integers(0, k)] = 900.0
    nw = (1 + 0.2 * rng.standard_normal(k)).astype(np.float16)
    parts = [rand_int4(rng, m, k) for m in (cfg.q_size, cfg.kv_size, cfg.kv_size)]
    wd = np.concatenate([p[2] for p in parts])
    bias = (0.5 * rng.standard_normal(n)).astype(np.float16)
    pq, ps = plain.prepare([p[:2] for p in parts])
    d = cuda.to_device
    args = [d(x), d(nw), d(pq), d(ps), d(bias)]
    state, inv = make_state(pos=pos), d(R.rope_inv_freq(cfg.head_dim, cfg.rope_theta))
    n_pages = pos // PAGE + 3
    table = rng.permutation(n_pages).astype(np.int32)
    d_table = d(table)
    pool0 = rng.standard_normal(pool_shape(cfg, n_pages)[1:]).astype(np.float16)
    pools = [d(pool0), d(pool0)]
    qs = [d(np.full(cfg.q_size, np.nan, np.float32)) for _ in range(2)]
    qkv = d(np.full(n, np.nan, np.float32))
    plain(*args, qkv, 0)
    R.rope_kv_launcher(cfg, qkv, state, inv, d_table, pools[1], qs[1])(0)
    fused(*args, state, inv, d_table, pools[0], qs[0], 0)
    kv, kv_ref = pools[0].copy_to_host(), pools[1].copy_to_host()
    q, q_ref = qs[0].copy_to_host(), qs[1].copy_to_host()
    assert np.array_equal(q.view(np.uint32), q_ref.view(np.uint32)), \
        f"q differs from qkv + rope_kv in {int((q != q_ref).sum())} of {q.size}"
    assert np.array_equal(kv.view(np.uint16), kv_ref.view(np.uint16)), \
        f"KV pool differs from qkv + rope_kv in {int((kv != kv_ref).sum())} elements"
    rq, rk, rv = ref_qkv_rope(cfg, x, nw, wd, bias, pos)
    page, slot = table[pos // PAGE], pos % PAGE
    assert rel(q, rq.reshape(-1)) < TOL_INT4
    assert rel(kv[page, :, 0, slot].astype(np.float32), rk.astype(np.float32)) < TOL_INT4
    assert rel(kv[page, :, 1, slot].astype(np.float32), rv.astype(np.float32)) < TOL_INT4
