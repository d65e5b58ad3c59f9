"""The NumPy reference's building blocks against hand computations, and its KV cache.

The oracle for the whole model is tests/test_ref_vs_transformers.py; these tests pin each
block separately so a kernel test failing against one of them points at the kernel.
"""
import numpy as np
import pytest

from nq.config import tiny_config
from nq.ref import (KVCache, RefModel, apply_rope, attention, linear, random_weights,
                    rms_norm, rope_cos_sin, silu, swiglu)


def test_rms_norm_by_hand():
    x = np.array([[3.0, -4.0, 0.0, 0.0]], np.float32)  # mean square 25/4
    w = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    eps = 1e-6
    want = x / np.sqrt(25.0 / 4.0 + eps) * w
    np.testing.assert_allclose(rms_norm(x, w, eps), want, rtol=1e-6)
    assert rms_norm(x, w, eps).dtype == np.float32


def test_rope_tables_by_hand():
    # head_dim 4, theta 100: inverse frequencies 1 and 100^-0.5 = 0.1
    cos, sin = rope_cos_sin([0, 2], 4, 100.0)
    np.testing.assert_allclose(cos, [[1, 1], [np.cos(2.0), np.cos(0.2)]], rtol=1e-6)
    np.testing.assert_allclose(sin, [[0, 0], [np.sin(2.0), np.sin(0.2)]], atol=1e-7)


def test_rope_rotate_half_pairs_i_with_i_plus_half():
    # One nonzero coordinate at i=0 rotates into i=D/2 (not i=1): the HF convention.
    x = np.zeros((1, 1, 8), np.float32)
    x[0, 0, 0] = 1.0
    y = apply_rope(x, [1], 10000.0)[0, 0]
    assert y[0] == pytest.approx(np.cos(1.0), rel=1e-6)
    assert y[4] == pytest.approx(np.sin(1.0), rel=1e-6)
    assert np.count_nonzero(y) == 2


def test_rope_identity_at_zero_and_norm_preserving():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 64)).astype(np.float32)
    np.testing.assert_array_equal(apply_rope(x[:1], [0], 1e6), x[:1])
    y = apply_rope(x, [0, 1, 7, 100, 4000], 1e6)
    d = 32  # each (i, i+32) pair is rotated, so each pair's length is kept
    np.testing.assert_allclose(np.hypot(y[..., :d], y[..., d:]),
                               np.hypot(x[..., :d], x[..., d:]), rtol=1e-5)


def test_rope_scores_depend_on_relative_position_only():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 1, 128)).astype(np.float32)
    k = rng.standard_normal((1, 1, 128)).astype(np.float32)

    def score(m, n):
        return float(np.sum(apply_rope(q, [m], 1e6) * apply_rope(k, [n], 1e6)))

    assert score(10, 3) == pytest.approx(score(107, 100), rel=1e-4)
    assert score(10, 3) != pytest.approx(score(10, 4), rel=1e-4)


def test_attention_single_key_returns_its_value():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 6, 64)).astype(np.float32)
    k = rng.standard_normal((1, 2, 64)).astype(np.float32)
    v = rng.standard_normal((1, 2, 64)).astype(np.float32)
    out = attention(q, k, v, [0])
    # GQA 3:1: query heads 0-2 read kv head 0, heads 3-5 read kv head 1
    np.testing.assert_allclose(out[0, :3], np.broadcast_to(v[0, 0], (3, 64)), rtol=1e-6)
    np.testing.assert_allclose(out[0, 3:], np.broadcast_to(v[0, 1], (3, 64)), rtol=1e-6)


def _naive_attention(q, k, v, positions):
    t, hq, d = q.shape
    g = hq // k.shape[1]
    out = np.zeros_like(q, dtype=np.float64)
    for i in range(t):
        for h in range(hq):
            n = positions[i] + 1
            s = k[:n, h // g].astype(np.float64) @ q[i, h] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v[:n, h // g]
    return out


def test_attention_matches_naive_loop_and_is_causal():
    rng = np.random.default_rng(3)
    t, s = 4, 9  # four queries at the last positions of nine keys (a chunked prefill)
    q = rng.standard_normal((t, 8, 64)).astype(np.float32)
    k = rng.standard_normal((s, 2, 64)).astype(np.float32)
    v = rng.standard_normal((s, 2, 64)).astype(np.float32)
    pos = np.arange(s - t, s)
    out = attention(q, k, v, pos)
    np.testing.assert_allclose(out, _naive_attention(q, k, v, pos), rtol=1e-5, atol=1e-6)
    # changing the last key/value must leave every query before it unchanged
    k2, v2 = k.copy(), v.copy()
    k2[-1] += 5.0
    v2[-1] -= 5.0
    out2 = attention(q, k2, v2, pos)
    np.testing.assert_array_equal(out2[:-1], out[:-1])
    assert not np.allclose(out2[-1], out[-1])


def test_attention_rejects_positions_beyond_keys():
    q = np.zeros((1, 2, 64), np.float32)
    kv = np.zeros((3, 1, 64), np.float32)
    with pytest.raises(ValueError, match="only 3 keys"):
        attention(q, kv, kv, [3])


def test_silu_swiglu_linear_by_hand():
    x = np.array([0.0, 1.0, -1.0, 30.0], np.float32)
    np.testing.assert_allclose(silu(x), [0.0, 1 / (1 + np.exp(-1)), -1 / (1 + np.e), 30.0],
                               rtol=1e-6)
    np.testing.assert_allclose(swiglu(x, np.full(4, 2.0, np.float32)), 2 * silu(x), rtol=1e-6)
    w = np.array([[1.0, 2.0], [3.0, 4.0], [0.0, -1.0]], np.float32)  # (N=3, K=2)
    np.testing.assert_allclose(linear([[1.0, 1.0]], w, [0.5, 0.0, 0.0]), [[3.5, 7.0, -1.0]])


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config(head_dim=64, num_heads=4, num_kv_heads=2)
    return RefModel(cfg, random_weights(cfg, seed=0))


def test_decode_with_cache_equals_full_prefill(model):
    ids = np.random.default_rng(4).integers(0, model.cfg.vocab_size, 12)
    full = model.forward(ids, model.new_cache())
    cache = KVCache(model.cfg, capacity=2)  # small capacity: exercises the cache growing
    steps = [model.forward(ids[:5], cache)]  # prefill 5, then one token at a time
    steps += [model.forward(ids[i:i + 1], cache) for i in range(5, 12)]
    got = np.concatenate(steps)
    assert cache.length == 12
    # fp32 with different matmul shapes (T=12 vs T=1): only summation order differs
    err = np.abs(got - full).max() / np.abs(full).max()
    assert err < 1e-5, err


def test_reset_replays_the_same_logits(model):
    ids = np.array([1, 2, 3, 4])
    model.reset()
    a = model.forward(ids)
    b = model.forward(ids)  # continues at positions 4..7, so differs
    model.reset()
    c = model.forward(ids)
    np.testing.assert_array_equal(a, c)
    assert not np.allclose(a, b)
    assert a.shape == (4, model.cfg.vocab_size) and a.dtype == np.float32


def test_cache_overflow_and_bad_ids_are_refused(model):
    cache = model.new_cache(max_len=4)
    model.forward([1, 2, 3], cache)
    with pytest.raises(ValueError, match="KV cache full"):
        model.forward([1, 2], cache)
    with pytest.raises(ValueError, match="out of range"):
        model.forward([model.cfg.vocab_size], model.new_cache())


def test_tied_model_uses_embeddings_and_bad_weights_are_named():
    cfg = tiny_config(tie=True, num_layers=1)
    w = random_weights(cfg, seed=5)
    assert "lm_head" not in w
    tied = RefModel(cfg, w).forward([7, 8])
    untied_cfg = cfg.replace(tie_word_embeddings=False)
    untied = RefModel(untied_cfg, {**w, "lm_head": w["embed_tokens"].copy()}).forward([7, 8])
    np.testing.assert_array_equal(tied, untied)
    w.pop("layers.0.up_proj.weight")
    with pytest.raises(KeyError, match="layers.0.up_proj.weight"):
        RefModel(cfg, w)
    w = random_weights(cfg, seed=5)
    w["norm"] = w["norm"][:-1]
    with pytest.raises(ValueError, match="norm has shape"):
        RefModel(cfg, w)


def test_numpy_backend_chunked_prefill_and_decode(model):
    from nq.ref import NumpyBackend
    ids = np.random.default_rng(6).integers(0, model.cfg.vocab_size, 9)
    full = model.forward(np.append(ids, 3), model.new_cache())
    b = NumpyBackend(model, chunk=4)  # 9 prompt tokens: chunks of 4, 4, 1
    b.reset()
    last = b.prefill(ids)
    nxt = b.decode(3)
    assert last.shape == nxt.shape == (model.cfg.vocab_size,)
    np.testing.assert_allclose(last, full[8], rtol=0, atol=1e-5 * np.abs(full).max())
    np.testing.assert_allclose(nxt, full[9], rtol=0, atol=1e-5 * np.abs(full).max())
    b.reset()
    np.testing.assert_array_equal(b.prefill(ids), last)


def test_numpy_backend_from_a_packed_file_runs_the_packed_weights(tmp_path):
    from nq.loader.format import NanoqwenFile
    from nq.loader.hf import pack
    from nq.loader.synth import make_hf_snapshot, random_hf_weights
    from nq.loader.weights import fake_quantize, hf_to_host
    from nq.ref import NumpyBackend

    cfg = tiny_config(num_layers=1, tie=True)
    snap = make_hf_snapshot(tmp_path / "snap", cfg, seed=3, dtype="float32")
    ids = np.array([5, 9, 2, 7])
    # the fp16 head (fake_quantize's); the default INT4 head rescored: test_lm_head_int4.py
    with NanoqwenFile(pack(str(snap), tmp_path / "m.nanoqwen", progress=False,
                           lm_head="fp16")) as nf:
        backend = NumpyBackend.from_file(nf, max_len=16)
        got = backend.prefill(ids)
    # the same fp32 checkpoint, rounded as the pack rounds it, without going through a file
    want = RefModel(cfg, fake_quantize(hf_to_host(cfg, random_hf_weights(cfg, 3)))).forward(ids)
    # same weights and formulas; only BLAS blocking differs (one row of lm_head vs four)
    assert np.abs(got - want[-1]).max() < 1e-5 * np.abs(want).max()
    assert backend.model.cache.max_len == 16
