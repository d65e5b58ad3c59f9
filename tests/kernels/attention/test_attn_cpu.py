"""CPU tier for the attention-path kernels: NumPy models of paging / split+combine, and every
kernel compiled offline for sm_90 with the instructions it promises and no local memory."""
import numpy as np
import pytest

from nq.config import PRESETS, tiny_config
from nq.kernels import embed, rmsnorm, rope_kv
from nq.kernels import sampling as argmax
from nq.kernels.attention import combine as attn_decode
from nq.paged import PAGE

from ptx_util import assert_no_local_memory, assert_uses, compile_ptx_sm90, ptxas_report


@pytest.mark.parametrize("length", [1, 15, 16, 17, 49, 1000, 9000, 40000])
@pytest.mark.parametrize("max_splits", [1, 66])
def test_split_plan_covers_context(length, max_splits):
    pps, n = attn_decode.split_plan(length, max_splits)
    n_pages = -(-length // PAGE)
    assert n <= max_splits and pps >= attn_decode.MIN_PPS
    assert (n - 1) * pps < n_pages <= n * pps  # every split has at least one page, none missed


@pytest.mark.parametrize("length", [1, 17, 100, 1000, 5000])
@pytest.mark.parametrize("gqa,d", [(7, 128), (2, 64)])
def test_split_combine_model_equals_softmax_attention(length, gqa, d):
    rng = np.random.default_rng(length)
    hkv = 2
    q = rng.standard_normal((hkv * gqa, d))
    k = rng.standard_normal((length, hkv, d)).astype(np.float16)
    v = rng.standard_normal((length, hkv, d)).astype(np.float16)
    ref = attn_decode.attention_reference(q, k, v)
    got = attn_decode.split_combine_model(q, k, v, max_splits=8)
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)


def test_reference_matches_nq_ref():
    from nq.ref import attention
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 8, 64)).astype(np.float32)
    k = rng.standard_normal((20, 2, 64)).astype(np.float32)
    v = rng.standard_normal((20, 2, 64)).astype(np.float32)
    want = attention(q, k, v, [19])[0]
    np.testing.assert_allclose(attn_decode.attention_reference(q[0], k, v), want, rtol=1e-4, atol=1e-5)


def test_transposed_butterfly_model_sums_each_token():
    x = np.random.default_rng(0).standard_normal((32, PAGE))
    got = attn_decode.transposed_butterfly(x)
    np.testing.assert_allclose(got, x.sum(axis=0)[np.arange(32) >> 1], rtol=1e-12)


def test_smem_fits_without_opt_in():
    for d in (64, 128):
        pps = attn_decode.default_pages_per_stage(d)
        assert pps >= 1 and attn_decode.smem_bytes(d, pps) + 64 <= attn_decode.SMEM_LIMIT


@pytest.mark.parametrize("gqa,d,hkv", [(7, 128, 4), (2, 64, 2), (8, 128, 1), (1, 64, 8)])
def test_attn_split_ptx(gqa, d, hkv):
    pps = attn_decode.default_pages_per_stage(d)
    ptx = compile_ptx_sm90(attn_decode._split_kernel(gqa, d, hkv, pps, 66, attn_decode.MIN_PPS),
                           attn_decode.SPLIT_SIG, fastmath=True)
    assert_uses(ptx, "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",
                "mbarrier.try_wait.parity", "mbarrier.arrive.expect_tx", "mbarrier.init",
                "shfl.sync.bfly", "shfl.sync.idx", "ex2.approx")
    assert_no_local_memory(ptx)
    try:
        regs, spills = ptxas_report(ptx)
    except RuntimeError:
        pytest.skip("no ptxas / nvJitLink here")
    assert spills == 0 and regs <= 128


def test_attn_combine_ptx():
    ptx = compile_ptx_sm90(attn_decode._combine_kernel(128, 66, 4), attn_decode.COMBINE_SIG,
                           fastmath=True)
    assert_no_local_memory(ptx)


def test_small_kernels_ptx():
    cfg = PRESETS["7b"]
    cases = [(embed._embed_kernel(cfg.hidden_size), embed.EMBED_SIG, True),
             (rmsnorm._rmsnorm_kernel(cfg.hidden_size, 1e-6, True), rmsnorm.RMSNORM_SIG, True),
             (rmsnorm._rmsnorm_kernel(cfg.hidden_size, 1e-6, False), rmsnorm.RMSNORM_SIG, True),
             (argmax._argmax_kernel(cfg.vocab_size), argmax.ARGMAX_SIG, True),
             # libdevice sinf/cosf keep a local array for Payne-Hanek reduction (|x| > 1e5 rad),
             # a path positions <= 32768 never take: only the no-spill check applies.
             (rope_kv._rope_kv_kernel(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
              rope_kv.ROPE_KV_SIG, False)]
    for fn, sig, no_local in cases:
        ptx = compile_ptx_sm90(fn, sig)
        if no_local:
            assert_no_local_memory(ptx)


def test_rope_reference_matches_ref():
    cfg = tiny_config()
    rng = np.random.default_rng(2)
    qkv = rng.standard_normal(cfg.qkv_size).astype(np.float32)
    q, k, v = rope_kv.rope_kv_reference(cfg, qkv, 0)  # position 0: the identity rotation
    np.testing.assert_array_equal(q.reshape(-1), qkv[: cfg.q_size])
    np.testing.assert_array_equal(v.reshape(-1), qkv[cfg.q_size + cfg.kv_size:].astype(np.float16))


def test_argmax_reference_ties_and_state():
    from nq.paged import STATE_LEN, STATE_POS, STATE_STEP, STATE_TOKEN
    state = np.zeros(STATE_LEN, np.int32)
    state[STATE_POS], state[STATE_STEP] = 10, 3
    ring = np.full(4, -1, np.int32)
    logits = np.zeros(100, np.float32)
    logits[[7, 42]] = 5.0
    assert argmax.argmax_reference(logits, state, ring) == 7
    assert state[STATE_TOKEN] == 7 and state[STATE_POS] == 11 and state[STATE_STEP] == 4
    assert ring[3] == 7
