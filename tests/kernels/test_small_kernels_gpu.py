"""rope_kv, embed, rmsnorm and argmax on the GPU against their NumPy references."""
import numpy as np
import pytest

from nq.config import PRESETS, tiny_config
from nq.kernels import embed, rmsnorm, rope_kv
from nq.kernels import sampling as argmax
from nq.paged import PAGE, STATE_LEN, STATE_POS, STATE_STEP, STATE_TOKEN, pool_shape
from nq.runtime.kv_cache import make_state

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("pos", [0, 17, 4095, 32767])
@pytest.mark.parametrize("cfg", [PRESETS["7b"], tiny_config()], ids=["7b", "tiny"])
def test_rope_kv(cfg, pos):
    from numba import cuda
    rng = np.random.default_rng(pos)
    n_pages = pos // PAGE + 4
    table = rng.permutation(n_pages).astype(np.int32)
    pool = np.zeros(pool_shape(cfg, n_pages)[1:], np.float16)
    qkv = rng.standard_normal(cfg.qkv_size).astype(np.float32)
    d_pool, d_q = cuda.to_device(pool), cuda.device_array(cfg.q_size, np.float32)
    inv = cuda.to_device(rope_kv.rope_inv_freq(cfg.head_dim, cfg.rope_theta))
    launch = rope_kv.rope_kv_launcher(cfg, cuda.to_device(qkv), make_state(pos=pos), inv,
                                      cuda.to_device(table), d_pool, d_q)
    launch()
    q_ref, k_ref, v_ref = rope_kv.rope_kv_reference(cfg, qkv, pos)
    # fp32 q: cosf/sinf and numpy's float32 cos/sin may differ by an ulp each.
    np.testing.assert_allclose(d_q.copy_to_host(), q_ref.reshape(-1), rtol=1e-5, atol=2e-6)
    got = d_pool.copy_to_host()
    page, slot = table[pos // PAGE], pos % PAGE
    np.testing.assert_allclose(got[page, :, 0, slot].astype(np.float32), k_ref.astype(np.float32),
                               rtol=1e-3, atol=1e-3)  # one fp16 ulp where q's rounding differs
    np.testing.assert_array_equal(got[page, :, 1, slot], v_ref)
    got[page, :, :, slot] = 0
    assert not got.any(), "rope_kv wrote outside its slot"


def test_embed():
    from numba import cuda
    cfg = PRESETS["7b"]
    emb = np.random.default_rng(0).standard_normal((1000, cfg.hidden_size)).astype(np.float16)
    x = cuda.device_array(cfg.hidden_size, np.float32)
    embed.embed_launcher(cuda.to_device(emb), make_state(token=777), x)()
    np.testing.assert_array_equal(x.copy_to_host(), embed.embed_reference(emb, 777))


@pytest.mark.parametrize("hidden,rows,res", [(3584, 1, False), (3584, 3, True), (896, 2, True)])
def test_rmsnorm(hidden, rows, res):
    from numba import cuda
    rng = np.random.default_rng(hidden)
    x = rng.standard_normal((rows, hidden)).astype(np.float32) * 3
    r = rng.standard_normal((rows, hidden)).astype(np.float32) if res else None
    w = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float16)
    dx, dh = cuda.to_device(x), cuda.device_array((rows, hidden), np.float16)
    rmsnorm.rmsnorm_launcher(dx, cuda.to_device(w), dh, 1e-6,
                             None if r is None else cuda.to_device(r))()
    x_ref, h_ref = rmsnorm.rmsnorm_reference(x, w, 1e-6, r)
    np.testing.assert_allclose(dx.copy_to_host(), x_ref, rtol=0, atol=0)
    # fp16 output: one ulp (2^-10 relative) for a different fp32 summation order.
    np.testing.assert_allclose(dh.copy_to_host().astype(np.float32), h_ref.astype(np.float32),
                               rtol=2e-3, atol=1e-3)


def test_argmax_ties_state_and_rearm():
    from numba import cuda
    vocab = PRESETS["7b"].vocab_size
    rng = np.random.default_rng(0)
    ws = argmax.argmax_workspace()
    ring = np.full(8, -1, np.int32)
    d_ring = cuda.to_device(ring)
    host_state = np.zeros(STATE_LEN, np.int32)
    host_state[STATE_POS], host_state[STATE_STEP] = 100, 6
    d_state = cuda.to_device(host_state)
    d_logits = cuda.device_array(vocab, np.float32)
    launch = argmax.argmax_launcher(d_logits, d_state, d_ring, ws)
    cases = []
    a = rng.standard_normal(vocab).astype(np.float32)
    a[[100000, 5000, 140000]] = 9.0  # tie across blocks: lowest index wins
    cases.append(a)
    b = rng.standard_normal(vocab).astype(np.float32)
    b[[300, 300 + argmax.NB * argmax.THREADS]] = 7.0  # tie inside one thread's stride
    cases.append(b)
    c = np.full(vocab, -np.inf, np.float32)
    c[vocab - 1] = -1e30  # the last index, everything else -inf
    cases.append(c)
    cases.append(np.zeros(vocab, np.float32))  # all equal: index 0
    for logits in cases:  # consecutive launches also check the ticket re-arms
        d_logits.copy_to_device(logits)
        launch()
        want = argmax.argmax_reference(logits, host_state, ring)
        got_state = d_state.copy_to_host()
        assert got_state[STATE_TOKEN] == want == np.argmax(logits)
        np.testing.assert_array_equal(got_state, host_state)
        np.testing.assert_array_equal(d_ring.copy_to_host(), ring)
