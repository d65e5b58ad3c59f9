"""CPU tier for causal prefill attention (nq/kernels/attention/prefill.py): the float64
reference against a direct softmax and nq.ref, the swizzled shared-memory layout, sm_90 PTX of
the 7B and 0.5B shapes compiled offline and checked by ptxas, and the kernel itself run under
the CUDA simulator on tiny shapes against the reference (tolerance: test_prefill_attn_gpu's)."""
import math
import textwrap

import numpy as np
import pytest

from nq.config import PRESETS
from nq.kernels.attention import prefill

from ptx_util import (assert_no_local_memory, assert_uses, compile_ptx_sm90, count, have_ptxas,
                      ptxas_report, run_under_simulator)


# ---- the reference -------------------------------------------------------------------------------

def _direct(q, k, v, start):
    """One query row at a time, the textbook way: softmax over the visible keys."""
    m, hq, d = q.shape
    g = hq // k.shape[1]
    o = np.zeros((m, hq, d))
    for i in range(m):
        for h in range(hq):
            kk = k[: start + i + 1, h // g].astype(np.float64)
            s = kk @ q[i, h].astype(np.float64) / math.sqrt(d)
            w = np.exp(s - s.max())
            o[i, h] = (w / w.sum()) @ v[: start + i + 1, h // g].astype(np.float64)
    return o


@pytest.mark.parametrize("m,start,hq,hkv", [(1, 0, 2, 1), (5, 13, 4, 2), (17, 3, 7, 1),
                                            (9, 40, 6, 6)])
def test_reference_is_a_causal_softmax(m, start, hq, hkv):
    rng = np.random.default_rng(m + start)
    d = 16
    q = rng.standard_normal((m, hq, d))
    k = rng.standard_normal((start + m + 5, hkv, d))   # keys past the chunk must be ignored
    v = rng.standard_normal((start + m + 5, hkv, d))
    got = prefill.prefill_attention_reference(q, k, v, start)
    np.testing.assert_allclose(got, _direct(q, k, v, start), rtol=1e-12, atol=1e-12)


def test_reference_agrees_with_nq_ref_attention():
    from nq.ref import attention
    rng = np.random.default_rng(0)
    q = rng.standard_normal((6, 4, 32)).astype(np.float32)
    k = rng.standard_normal((20, 2, 32)).astype(np.float32)
    v = rng.standard_normal((20, 2, 32)).astype(np.float32)
    want = attention(q, k[:17], v[:17], np.arange(11, 17))
    np.testing.assert_allclose(prefill.prefill_attention_reference(q, k, v, 11), want,
                               rtol=1e-5, atol=1e-5)


# ---- layout --------------------------------------------------------------------------------------

@pytest.mark.parametrize("d", [64, 128])
def test_swizzle_makes_ldmatrix_conflict_free(d):
    """An ldmatrix phase reads 8 consecutive rows (rows 8a..8a+7) at one chunk: they land in 8
    distinct 16-byte bank groups, and every chunk of a row is stored exactly once."""
    for c in range(d // 8):
        for r0 in range(0, prefill.BN, 8):
            groups = {(prefill.chunk_offset(r, c, d) // 16) % 8 for r in range(r0, r0 + 8)}
            assert len(groups) == 8
    for r in range(prefill.BN):
        offs = sorted(prefill.chunk_offset(r, c, d) for c in range(d // 8))
        assert offs == [r * 2 * d + 16 * c for c in range(d // 8)]


@pytest.mark.parametrize("d", [64, 128])
def test_swizzle_is_an_xor_of_the_k_step(d):
    """The kernel's address of chunk 2k + c of row r: (row base + 16 (c ^ r % 8)) ^ 32k, exact
    because a row base has zero bits 4-7 (rows of 128 or 256 B from a 256-aligned stage)."""
    for r in range(prefill.BN):
        for c in range(2):
            base = r * 2 * d + 16 * (c ^ (r % 8))
            for k in range(d // 16):
                assert base ^ (32 * k) == prefill.chunk_offset(r, 2 * k + c, d)


def test_tiling_and_shared_memory_of_the_7b():
    cfg = PRESETS["7b"]
    assert prefill.tokens_per_cta(cfg.gqa_ratio) == 18     # 126 of 128 rows used
    assert prefill.smem_bytes(cfg.head_dim) == 3 * 32768 + 256 <= 227 * 1024


# ---- compiled code -------------------------------------------------------------------------------

def _ptx(gqa, d, hkv, warps=prefill.WARPS, nstage=prefill.NSTAGE):
    return compile_ptx_sm90(prefill._prefill_kernel(gqa, d, hkv, warps, nstage), prefill.SIG,
                            fastmath=True)


@pytest.mark.parametrize("name", ["7b", "0.5b"])
def test_prefill_ptx(name):
    cfg = PRESETS[name]
    d = cfg.head_dim
    ptx = _ptx(cfg.gqa_ratio, d, cfg.num_kv_heads)
    assert_uses(ptx, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
                "cp.async.cg.shared.global", "cp.async.commit_group", "cp.async.wait_group",
                "ex2.approx", "shfl.sync.bfly")
    # A warp's tile, fully unrolled: S = D/16 k-steps x 8 key n-tiles, O += P V = 4 k-steps x
    # D/8 dim n-tiles; one ldmatrix feeds two mma.
    assert count(ptx, "mma.sync.aligned.m16n8k16") == 2 * (d // 16) * (prefill.BN // 8)
    assert count(ptx, "ldmatrix.sync.aligned.m8n8.x4") == (d // 16) * (prefill.BN // 8)
    assert_no_local_memory(ptx)
    if not have_ptxas():
        pytest.skip("no ptxas / nvJitLink here")
    regs, spills = ptxas_report(ptx)   # raises (fails) if ptxas rejects the PTX
    # 229 at d128, 165 at d64 (numba-cuda 0.30, CUDA 13.0): 256 threads at up to 255
    # registers is one CTA an SM, which the 96 KiB of stages ask for anyway.
    assert spills == 0 and regs <= 255


@pytest.mark.parametrize("warps,nstage", [(4, 2), (8, 4), (2, 3)])
def test_prefill_ptx_variants(warps, nstage):
    ptx = _ptx(7, 128, 4, warps, nstage) if warps >= 4 else _ptx(2, 64, 2, warps, nstage)
    assert_no_local_memory(ptx)
    assert count(ptx, f"cp.async.wait_group {nstage - 2}") == 1


# ---- the kernel under the CUDA simulator ---------------------------------------------------------

def test_fast_mma_model_is_the_mma_model_bit_for_bit():
    import sim_warp
    from nq.ptx.mma import mma_m16n8k16_f16_f32_warp
    rng = np.random.default_rng(0)
    for scale in (1e-3, 3.0, 200.0):
        for _ in range(20):
            a = (rng.standard_normal((32, 8)) * scale).astype(np.float16).view(np.uint32)
            b = (rng.standard_normal((32, 4)) * scale).astype(np.float16).view(np.uint32)
            c = (rng.standard_normal((32, 4)) * scale).astype(np.float32)
            want = mma_m16n8k16_f16_f32_warp(a, b, c)
            got = sim_warp.mma_m16n8k16_f16_f32_warp([tuple(r) for r in a], list(b), list(c))
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


SIM_SCRIPT = textwrap.dedent('''
    import sys

    import numpy as np
    from numba import cuda

    sys.path.insert(0, "tests")
    import sim_warp
    sim_warp.install()   # the mma model vectorised, bit for bit (test_fast_mma_model_...)

    sim_warp.patch_simulator()   # shuffles and the polling throttle

    from nq.config import tiny_config
    from nq.kernels.attention import prefill
    from nq.paged import PAGE, gather_kv, pool_shape

    seen = [0]

    def case(cfg, m, start, seed, m_max=None, warps=prefill.WARPS, nstage=prefill.NSTAGE):
        """Scattered pages, NaN in every slot the kernel must not read (past start + m and in
        unused pages) and in o; prints the error against the reference in tolerance units.
        Only the cases numbered in PICK (the order below) run."""
        seen[0] += 1
        if seen[0] - 1 not in PICK:
            return
        rng = np.random.default_rng(seed)
        kv_len = start + m
        need = -(-kv_len // PAGE)
        n_pages = need + 2
        pool = rng.standard_normal(pool_shape(cfg, n_pages)[1:]).astype(np.float16)
        table = np.zeros(need + 1, np.int32)
        table[:need] = rng.permutation(n_pages)[:need]
        table[need] = n_pages - 1           # a mapped page past the context: never read
        k, v = gather_kv(pool, table, kv_len)
        pool[table[need - 1], :, :, kv_len - (need - 1) * PAGE:] = np.nan
        pool[np.setdiff1d(np.arange(n_pages), table[:need])] = np.nan
        m_max = m_max or m
        q = (rng.standard_normal((m_max, cfg.num_heads, cfg.head_dim)) * 2).astype(np.float32)
        o = cuda.to_device(np.full((m_max, cfg.q_size), np.nan, np.float16))
        launch = prefill.prefill_attention_launcher(cfg, cuda.to_device(q), cuda.to_device(pool),
                                                    cuda.to_device(table), o, warps=warps,
                                                    nstage=nstage)
        launch(m, start)
        got = o.copy_to_host()
        ref = prefill.prefill_attention_reference(prefill.rounded_q(q[:m], cfg.head_dim), k, v,
                                                  start).reshape(m, -1)
        err = np.abs(got[:m].astype(np.float64) - ref) / tolerance(ref, v)
        ok = np.isfinite(got[:m]).all() and np.isnan(got[m:]).all()  # rows past m untouched
        name = (f"g{cfg.gqa_ratio}d{cfg.head_dim}_m{m}_s{start}_mmax{m_max}_w{warps}"
                f"_st{nstage}")
        print(name, float(err.max()) if ok else float("inf"), flush=True)

    __TOLERANCE__
    tiny = tiny_config()                                                  # G 2, d 64
    g7 = tiny_config(head_dim=64, num_heads=14, num_kv_heads=2)           # 0.5B's heads
    g8 = tiny_config(head_dim=128, num_heads=8, num_kv_heads=1)           # d 128
    for m in (1, 5, 16, 17):
        for start in (0, 13):
            case(tiny, m, start, seed=10 * m + start, m_max=m + 3)
    case(g7, 9, 13, seed=1, warps=2)          # 4 tokens a CTA (28 rows): 3 CTAs, padding rows
    case(g8, 3, 100, seed=3)                  # d128, 2 tiles (103 keys): the pipeline, a
    #                                           second online-softmax step, the tail page
    case(tiny, 5, 150, seed=4, nstage=2)      # 3 tiles through 2 stages
    case(tiny, 5, 200, seed=5, warps=4, nstage=4)   # 4 tiles, 4 stages, 4 warps

    if not REFUSALS:
        raise SystemExit(0)

    def refused(what, cfg, q, o, table=np.zeros(4, np.int32)):
        pool = np.zeros(pool_shape(cfg, 4)[1:], np.float16)
        try:
            prefill.prefill_attention_launcher(cfg, q, pool, table, o)
        except ValueError as e:
            print("refused_" + what, 0.0 if "prefill attention" in str(e) else float("inf"))
        else:
            print("refused_" + what, float("inf"))

    hq, d = tiny.num_heads, tiny.head_dim
    refused("q_fp16", tiny, np.zeros((8, hq, d), np.float16), np.zeros((8, hq * d), np.float16))
    refused("o_rows", tiny, np.zeros((8, hq, d), np.float32), np.zeros((9, hq * d), np.float16))
    refused("table_i64", tiny, np.zeros((8, hq, d), np.float32),
            np.zeros((8, hq * d), np.float16), np.zeros(4, np.int64))
''')


# ~14 s a case on 2 cores.  CI's tier: the tiny model's m 1 from 0 and m 17 from 13 (cases 0
# and 7 of the loop), the other shapes and rings (8..11) and the refusals; the long tier
# (`pytest -m long`) the loop's six others.
SIM_PICK = (0, 7, 8, 9, 10, 11)
SIM_PICK_LONG = (1, 2, 3, 4, 5, 6)


def _prefill_attention_under_the_simulator(pick, refusals):
    import inspect

    import test_prefill_attn_gpu
    source = inspect.getsource(test_prefill_attn_gpu.tolerance)  # the GPU test's, verbatim
    script = f"PICK = {pick!r}\nREFUSALS = {refusals}\n" + SIM_SCRIPT
    errs, stdout = run_under_simulator(script.replace("__TOLERANCE__", source), timeout=1200)
    assert len(errs) == len(pick) + 3 * refusals, stdout
    bad = {name: e for name, e in errs.items() if not e <= 1.0}
    assert not bad, bad


@pytest.mark.slow
def test_prefill_attention_under_the_simulator():
    _prefill_attention_under_the_simulator(SIM_PICK, True)


@pytest.mark.long
def test_prefill_attention_under_the_simulator_other_cases():
    _prefill_attention_under_the_simulator(SIM_PICK_LONG, False)
