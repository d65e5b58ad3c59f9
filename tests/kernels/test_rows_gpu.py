"""Prefill's row kernels (nq/kernels/rows.py) on the GPU at the 7B's sizes, m in {1, 7, 512}:
embed_rows exact, rmsnorm_rows to an fp16 ulp of the reference, and rope_kv_rows
bit for bit what decode's rope_kv kernel writes for the same positions, token by token."""
import numpy as np
import pytest

from nq.config import PRESETS
from nq.kernels import rope_kv, rows
from nq.paged import PAGE, STATE_LEN, STATE_POS, pool_shape
from nq.runtime.kv_cache import make_state

pytestmark = pytest.mark.gpu

CFG = PRESETS["7b"]
M_MAX = 512
MS = [1, 7, 512]


@pytest.fixture(scope="module")
def rng():
    return np.random.default_rng(0)


def test_embed_rows(rng):
    from numba import cuda
    emb = rng.standard_normal((3000, CFG.hidden_size)).astype(np.float16)
    ids = rng.integers(0, 3000, M_MAX).astype(np.int32)
    x = cuda.device_array((M_MAX, CFG.hidden_size), np.float32)
    launch = rows.embed_rows_launcher(cuda.to_device(emb), cuda.to_device(ids), x)
    for m in MS:
        x.copy_to_device(np.full(x.shape, np.nan, np.float32))
        launch(m)
        got = x.copy_to_host()
        np.testing.assert_array_equal(got[:m], rows.embed_rows_reference(emb, ids[:m]))
        assert np.isnan(got[m:]).all()


def test_rmsnorm_rows(rng):
    from numba import cuda
    x = (rng.standard_normal((M_MAX, CFG.hidden_size)) * 3).astype(np.float32)
    x[:, 7] = 300.0   # one massive activation a row, as Qwen's residual stream has
    w = (1 + 0.1 * rng.standard_normal(CFG.hidden_size)).astype(np.float16)
    h = cuda.device_array((M_MAX, CFG.hidden_size), np.float16)
    launch = rows.rmsnorm_rows_launcher(cuda.to_device(x), cuda.to_device(w), h, CFG.rms_norm_eps)
    for m in MS:
        h.copy_to_device(np.full(h.shape, np.nan, np.float16))
        launch(m)
        got = h.copy_to_host()
        want = rows.rmsnorm_rows_reference(x[:m], w, CFG.rms_norm_eps)
        # one fp16 ulp (2^-10 relative): the sums of squares are added in another order
        np.testing.assert_allclose(got[:m].astype(np.float32), want.astype(np.float32),
                                   rtol=2e-3, atol=1e-3)
        assert np.isnan(got[m:]).all()


@pytest.mark.parametrize("m,start", [(1, 0), (7, 4093), (512, 0), (512, 31000)])
def test_rope_kv_rows_is_rope_kv_bit_for_bit(rng, m, start):
    from numba import cuda
    n_pages = (start + m) // PAGE + 2
    table = cuda.to_device(rng.permutation(n_pages).astype(np.int32))
    inv = cuda.to_device(rope_kv.rope_inv_freq(CFG.head_dim, CFG.rope_theta))
    qkv = (rng.standard_normal((M_MAX, CFG.qkv_size)) * 4).astype(np.float32)
    shape = pool_shape(CFG, n_pages)[1:]
    pool = cuda.to_device(np.zeros(shape, np.float16))
    q = cuda.to_device(np.full((M_MAX, CFG.num_heads, CFG.head_dim), np.nan, np.float32))
    rows.rope_kv_rows_launcher(CFG, cuda.to_device(qkv), inv, table, pool, q)(m, start)
    got_q, got_pool = q.copy_to_host(), pool.copy_to_host()
    assert np.isnan(got_q[m:]).all()
    # decode's kernel, one token at a time, into its own pool
    dec_pool = cuda.to_device(np.zeros(shape, np.float16))
    dec_q = cuda.device_array(CFG.q_size, np.float32)
    d_qkv = cuda.device_array(CFG.qkv_size, np.float32)
    state, host_state = make_state(pos=0), np.zeros(STATE_LEN, np.int32)
    launch = rope_kv.rope_kv_launcher(CFG, d_qkv, state, inv, table, dec_pool, dec_q)
    want_q = np.empty((m, CFG.q_size), np.float32)
    for i in range(m):
        d_qkv.copy_to_device(qkv[i])
        host_state[STATE_POS] = start + i
        state.copy_to_device(host_state)
        launch()
        want_q[i] = dec_q.copy_to_host()
    np.testing.assert_array_equal(got_q[:m].reshape(m, -1).view(np.uint32), want_q.view(np.uint32))
    np.testing.assert_array_equal(got_pool.view(np.uint16), dec_pool.copy_to_host().view(np.uint16))
    # and both are rope_kv's reference (fp32 q to an ulp of cosf/sinf vs numpy's cos/sin)
    q_ref, k_ref, v_ref = rows.rope_kv_rows_reference(CFG, qkv[:m], start)
    np.testing.assert_allclose(got_q[:m], q_ref, rtol=1e-5, atol=2e-6)
