"""CPU tier for the small per-step kernels (embed, rmsnorm, argmax, rope_kv, lm_head): NumPy
references, each kernel compiled offline for sm_90 without local memory, and their names."""
import numpy as np

from nq.config import PRESETS, tiny_config
from nq.kernels import embed, feed, fill, lm_head, rmsnorm, rope_kv
from nq.kernels import sampling as argmax

from ptx_util import assert_no_local_memory, compile_ptx_sm90, compiled_name


def test_small_kernels_ptx():
    cfg = PRESETS["7b"]
    cases = [(embed.embed_body(cfg.hidden_size), embed.EMBED_SIG, True),
             (rmsnorm.rmsnorm_body(cfg.hidden_size, 1e-6, True), rmsnorm.RMSNORM_SIG, True),
             (rmsnorm.rmsnorm_body(cfg.hidden_size, 1e-6, False), rmsnorm.RMSNORM_SIG, True),
             (argmax.argmax_body(cfg.vocab_size), argmax.ARGMAX_SIG, True),
             # libdevice sinf/cosf keep a local array for Payne-Hanek reduction (|x| > 1e5 rad),
             # a path positions <= 32768 never take: only the no-spill check applies.
             (rope_kv.rope_kv_body(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
              rope_kv.ROPE_KV_SIG, False)]
    for fn, sig, no_local in cases:
        ptx = compile_ptx_sm90(fn, sig)
        if no_local:
            assert_no_local_memory(ptx)


def test_kernel_names_spell_every_constant():
    cfg = PRESETS["7b"]
    eps = float(cfg.rms_norm_eps)
    assert compiled_name(rope_kv.rope_kv_kernel, 28, 4, 128) == "rope_kv_hq28_hkv4_d128"
    assert compiled_name(rmsnorm.rmsnorm_kernel, 3584, eps, True) == "rmsnorm_h3584_eps1em06_res1"
    assert compiled_name(rmsnorm.rmsnorm_kernel, 3584, eps, False) == "rmsnorm_h3584_eps1em06_res0"
    assert (compiled_name(lm_head.lm_head_kernel, 152064, 3584, eps, 256, 7)
            == "lm_head_fp16_v152064_k3584_t256_u7_eps1em06")
    assert compiled_name(argmax.argmax_kernel, 152064) == "argmax_v152064"
    assert compiled_name(embed.embed_kernel, 3584) == "embed_h3584"
    assert compiled_name(feed.feed_kernel) == "feed"
    assert compiled_name(fill.fill_kernels) == ("fill_u32", "fill_f16")


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
