"""CPU tier for prefill's row kernels (nq/kernels/rows.py): sm_90 PTX compiled offline, and
the kernels under the CUDA simulator against their references -- rope_kv_rows bit for bit
against decode's rope_kv kernel run token by token."""
import textwrap

import pytest

from nq.config import PRESETS
from nq.kernels import rope_kv, rows

from ptx_util import assert_no_local_memory, compile_ptx_sm90, count, have_ptxas, ptxas_report


@pytest.mark.parametrize("factory,key", [(rows._embed_rows, (3584,)), (rows._embed_rows, (896,))])
def test_copy_kernels_ptx(factory, key):
    body, sig, _ = factory(*key)
    ptx = compile_ptx_sm90(body, sig)
    assert_no_local_memory(ptx)
    assert count(ptx, "griddepcontrol.wait") == 1


@pytest.mark.parametrize("name", ["7b", "0.5b"])
def test_rope_kv_rows_ptx_matches_rope_kv(name):
    """The same sin/cos code as rope_kv (its Payne-Hanek path for huge angles keeps a small
    local array in both: precise cosf/sinf, not fastmath) and the rotation as explicit fmas."""
    cfg = PRESETS[name]
    body, sig, _ = rows._rope_kv_rows(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    ptx = compile_ptx_sm90(body, sig)
    decode = compile_ptx_sm90(rope_kv.rope_kv_body(cfg.num_heads, cfg.num_kv_heads,
                                                      cfg.head_dim), rope_kv.ROPE_KV_SIG)
    assert ("ld.local" in ptx) == ("ld.local" in decode)
    assert count(ptx, "sin.approx") == count(ptx, "cos.approx") == 0
    if have_ptxas():
        assert ptxas_report(ptx)[1] == 0


SIM_SCRIPT = textwrap.dedent('''
    import sys

    import numpy as np
    from numba import cuda
    from numba.cuda.simulator import kernel as simk

    sys.path.insert(0, "tests")
    import sim_warp
    # The simulator has no shuffles (rmsnorm's warp sums): a rendezvous of the caller's warp.
    sim_warp.patch_simulator()

    from nq.config import tiny_config
    from nq.kernels import rmsnorm, rope_kv, rows
    from nq.paged import PAGE, pool_shape
    from nq.runtime.kv_cache import make_state

    class LaunchCuda:
        """A factory that imports `cuda` into a closure cell escapes the simulator's swap of
        module globals: forward it to the fake module of the running launch.  (rmsnorm now
        reads `cuda` as a module global, which the simulator swaps by itself.)"""
        def __getattr__(self, name):
            return getattr(simk._kernel_context, name)

    def forward_cuda(body):
        if "cuda" in body.__code__.co_freevars:
            body.__closure__[body.__code__.co_freevars.index("cuda")].cell_contents = LaunchCuda()

    forward_cuda(rmsnorm.rmsnorm_body(320, 1e-6, False))
    rng = np.random.default_rng(0)

    def report(name, ok):
        print(name, 0.0 if ok else float("inf"), flush=True)

    # embed_rows: H not a multiple of the block; rows past m untouched
    emb = rng.standard_normal((50, 300)).astype(np.float16)
    ids = rng.integers(0, 50, 6).astype(np.int32)
    x = cuda.to_device(np.full((6, 300), np.nan, np.float32))
    launch = rows.embed_rows_launcher(cuda.to_device(emb), cuda.to_device(ids), x)
    for m in (1, 4):
        launch(m)
        got = x.copy_to_host()
        report(f"embed_m{m}", np.array_equal(got[:m], rows.embed_rows_reference(emb, ids[:m]))
               and np.isnan(got[4:]).all())

    # rmsnorm_rows: one fp16 ulp (the reference sums the squares in another order)
    xs = (rng.standard_normal((5, 320)) * 3).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(320)).astype(np.float16)
    h = cuda.to_device(np.full((5, 320), np.nan, np.float16))
    rows.rmsnorm_rows_launcher(cuda.to_device(xs), cuda.to_device(w), h, 1e-6)(3)
    got = h.copy_to_host()
    want = rows.rmsnorm_rows_reference(xs[:3], w, 1e-6)
    report("rmsnorm_m3", np.allclose(got[:3].astype(np.float32), want.astype(np.float32),
                                     rtol=2e-3, atol=1e-3) and np.isnan(got[3:]).all())

    # rope_kv_rows against rope_kv (decode's kernel) token by token, bit for bit, and
    # against the reference to an fp32 / fp16 ulp (numpy's float32 cos is not cosf)
    cfg = tiny_config()
    inv = rope_kv.rope_inv_freq(cfg.head_dim, cfg.rope_theta)
    for m, start in ((1, 0), (5, 13), (3, 4094)):
        n_pages = (start + m) // PAGE + 3
        table = rng.permutation(n_pages).astype(np.int32)
        qkv = rng.standard_normal((m + 2, cfg.qkv_size)).astype(np.float32)
        pool = cuda.to_device(np.zeros(pool_shape(cfg, n_pages)[1:], np.float16))
        q = cuda.to_device(np.full((m + 2, cfg.num_heads, cfg.head_dim), np.nan, np.float32))
        d_table, d_inv = cuda.to_device(table), cuda.to_device(inv)
        rows.rope_kv_rows_launcher(cfg, cuda.to_device(qkv), d_inv, d_table, pool, q)(m, start)
        got_pool, got_q = pool.copy_to_host(), q.copy_to_host()
        dec_pool = cuda.to_device(np.zeros(pool_shape(cfg, n_pages)[1:], np.float16))
        dec_q = cuda.device_array(cfg.q_size, np.float32)
        same = np.isnan(got_q[m:]).all()
        forward_cuda(rope_kv.rope_kv_body(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))
        for i in range(m):
            rope_kv.rope_kv_launcher(cfg, cuda.to_device(qkv[i]), make_state(pos=start + i),
                                     d_inv, d_table, dec_pool, dec_q)()
            same &= np.array_equal(dec_q.copy_to_host().view(np.uint32),
                                   got_q[i].reshape(-1).view(np.uint32))
        same &= np.array_equal(dec_pool.copy_to_host().view(np.uint16), got_pool.view(np.uint16))
        report(f"rope_kv_rows_vs_rope_kv_m{m}_s{start}", same)
        q_ref, k_ref, v_ref = rows.rope_kv_rows_reference(cfg, qkv[:m], start)
        close = np.allclose(got_q[:m], q_ref, rtol=1e-5, atol=2e-6)
        for i in range(m):
            page, slot = table[(start + i) // PAGE], (start + i) % PAGE
            close &= np.allclose(got_pool[page, :, 0, slot].astype(np.float32),
                                 k_ref[i].astype(np.float32), rtol=1e-3, atol=1e-3)
            close &= np.array_equal(got_pool[page, :, 1, slot], v_ref[i])
            got_pool[page, :, :, slot] = 0
        report(f"rope_kv_rows_vs_reference_m{m}_s{start}", close and not got_pool.any())

    def refused(what, build):
        try:
            build()
        except ValueError as e:
            report("refused_" + what, "rows" in str(e) or "rope_kv_rows" in str(e))
        else:
            report("refused_" + what, False)

    pool = cuda.to_device(np.zeros(pool_shape(cfg, 4)[1:], np.float16))
    d_inv, d_table = cuda.to_device(inv), cuda.to_device(np.arange(4, dtype=np.int32))
    qkv8 = cuda.to_device(np.zeros((8, cfg.qkv_size), np.float32))
    q8 = cuda.to_device(np.zeros((8, cfg.num_heads, cfg.head_dim), np.float32))
    refused("q_out_rows", lambda: rows.rope_kv_rows_launcher(
        cfg, qkv8, d_inv, d_table, pool, cuda.to_device(np.zeros((9, 4, 64), np.float32))))
    launch = rows.rope_kv_rows_launcher(cfg, qkv8, d_inv, d_table, pool, q8)
    refused("m_over", lambda: launch(9, 0))
    refused("past_table", lambda: launch(8, 4 * PAGE - 7))
    refused("ids_i64", lambda: rows.embed_rows_launcher(
        cuda.to_device(emb), cuda.to_device(ids.astype(np.int64)), x))
''')


@pytest.mark.slow
def test_row_kernels_under_the_simulator():
    from ptx_util import run_under_simulator
    errs, stdout = run_under_simulator(SIM_SCRIPT, timeout=600)
    assert len(errs) == 13, stdout
    bad = {name: e for name, e in errs.items() if e != 0.0}
    assert not bad, bad
