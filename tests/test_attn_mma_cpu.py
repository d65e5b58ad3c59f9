"""CPU tier for the tensor-core attention split kernel (nq/kernels/attn_mma.py): the fragment
mapping on the nq/ptx/mma.py warp models, the shared-memory layout, sm_90 PTX compiled offline,
and split + combine run end to end under the CUDA simulator against the float64 reference."""
import textwrap

import numpy as np
import pytest

from nq.config import PRESETS
from nq.kernels import attn_decode, attn_mma
from nq.kv_cache import PAGE

from ptx_util import (assert_no_local_memory, assert_uses, compile_ptx_sm90, count, ptxas_report,
                      run_under_simulator)


# ---- models and layout ---------------------------------------------------------------------------

def test_q_hi_lo_split_is_fp32_accurate():
    x = (np.random.default_rng(0).standard_normal(4096) * 3).astype(np.float32)
    hi, lo = attn_mma.split_q_hi_lo(x)
    err = np.abs(hi.astype(np.float64) + lo.astype(np.float64) - x)
    assert (err <= np.abs(x) * 2.0 ** -21 + 2.0 ** -25).all()  # 22 bits kept; lo's subnormal floor


@pytest.mark.parametrize("gqa,d", [(7, 128), (8, 64), (1, 64), (3, 128)])
def test_page_scores_model_is_q_dot_k(gqa, d):
    """The kernel's fragment mapping (q hi/lo rows, ldmatrix lane rows, c0 + c2) on the warp
    models gives q K^T to ~fp32 accuracy (a plain fp16 q would be off by ~1e-3 relative)."""
    rng = np.random.default_rng(gqa * d)
    q = (rng.standard_normal((gqa, d)) * 0.3).astype(np.float32)
    k = rng.standard_normal((PAGE, d)).astype(np.float16)
    want = q.astype(np.float64) @ k.astype(np.float64).T
    got = attn_mma.page_scores_model(q, k)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(q).sum(axis=1).max())


@pytest.mark.parametrize("d", [64, 128])
def test_padded_rows_make_ldmatrix_conflict_free(d):
    """8 consecutive token rows at one column (one ldmatrix phase) fall in 8 distinct 16-byte
    bank groups at rows_per_copy=1; 2**k rows per copy give a 2**k-way conflict."""
    for rpc, ways in ((1, 1), (2, 2), (4, 4), (32, 8)):
        for r0 in (0, 8, 16, 24):
            groups = [(attn_mma.row_offset(r, d, rpc) // 16) % 8 for r in range(r0, r0 + 8)]
            assert 8 // len(set(groups)) == ways
        assert all(attn_mma.row_offset(r, d, rpc) % 16 == 0 for r in range(2 * PAGE))


@pytest.mark.parametrize("d", [64, 128])
def test_merge_scratch_fits_a_page_slot(d):
    for rpc in (1, 32):
        assert (8 * d + 16) * 4 <= attn_mma.page_slot_bytes(d, rpc)


def test_defaults_for_the_7b():
    cfg = PRESETS["7b"]
    assert attn_mma.default_max_splits(cfg.num_kv_heads) == 66  # 264 CTAs: two per SM
    # 3 stages x 1 page x 8320 B (K and V, a 16-byte pad after every 4 rows): under 48 KiB
    assert attn_mma.smem_bytes(cfg.head_dim) == 3 * 8320 + attn_mma.ALIGN < 48 * 1024


# ---- compiled code -------------------------------------------------------------------------------

def _ptx(gqa, d, hkv, nc, nstage=attn_mma.NSTAGE, rpc=attn_mma.ROWS_PER_COPY, early=False):
    return compile_ptx_sm90(attn_mma._split_kernel(gqa, d, hkv, nc, nstage, rpc, 33,
                                                   attn_decode.MIN_PPS, early),
                            attn_decode.SPLIT_SIG, fastmath=True)


@pytest.mark.parametrize("nc", [1, 2, 4])
@pytest.mark.parametrize("gqa,d,hkv", [(7, 128, 4), (2, 64, 2), (8, 128, 1), (1, 64, 8)])
def test_attn_mma_split_ptx(gqa, d, hkv, nc):
    ptx = _ptx(gqa, d, hkv, nc)
    assert_uses(ptx, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",
                "mbarrier.try_wait.parity", "mbarrier.arrive.expect_tx", "fence.proxy.async",
                "griddepcontrol.wait", "ex2.approx")
    # Per page: D/16 k-steps x 2 token n-tiles (S), 1 (l = P.1), D/8 dim n-tiles (P V); all
    # unrolled, so each appears once in the PTX.
    assert count(ptx, "mma.sync.aligned.m16n8k16") == d // 16 * 2 + 1 + d // 8
    assert count(ptx, "ldmatrix.sync.aligned.m8n8.x4") == d // 8
    assert_no_local_memory(ptx)
    try:
        regs, spills = ptxas_report(ptx)
    except RuntimeError:
        pytest.skip("no ptxas / nvJitLink here")
    # 159 at d128 (numba-cuda 0.30): (NC+1) warps a CTA, so registers do not bound occupancy
    # below ~255; spills would put local memory in the page loop.
    assert spills == 0 and regs <= 192


@pytest.mark.parametrize("nstage,rpc", [(2, 32), (4, 2)])
def test_attn_mma_split_ptx_copy_variants(nstage, rpc):
    ptx = _ptx(7, 128, 4, 2, nstage, rpc)
    assert_no_local_memory(ptx)


def test_attn_mma_split_ptx_early():
    # early: one wait in the consumer branch, one before the last page's copies
    ptx = _ptx(7, 128, 4, 1, early=True)
    assert count(ptx, "griddepcontrol.wait") == 2
    assert count(_ptx(7, 128, 4, 1), "griddepcontrol.wait") == 1
    assert_no_local_memory(ptx)


# ---- the kernels under the CUDA simulator -------------------------------------------------------

SIM_SCRIPT = textwrap.dedent('''
    import time

    import numpy as np
    from numba import cuda
    from numba.cuda.simulator import kernel as simk, kernelapi
    from nq.ptx import _sim

    # The simulator has no shuffles or __syncwarp: rendezvous of the caller's warp.
    kernelapi.FakeCUDAModule.shfl_xor_sync = \\
        lambda self, mask, value, lanemask: _sim.warp_exchange(value)[_sim.lane_id() ^ lanemask]
    kernelapi.FakeCUDAModule.syncwarp = lambda self, mask=0xFFFFFFFF: _sim.warp_exchange(None)

    # The block manager polls its threads' is_alive() in a busy loop that holds the GIL against
    # every 32-thread rendezvous (each mma and ldmatrix): a short sleep every 64 polls makes the
    # run ~2.5x faster and changes nothing else.
    _polls = [0]
    _is_alive = simk.BlockThread.is_alive
    def _throttled_is_alive(self):
        _polls[0] += 1
        if _polls[0] % 64 == 0:
            time.sleep(2e-4)
        return _is_alive(self)
    simk.BlockThread.is_alive = _throttled_is_alive

    from nq.config import tiny_config
    from nq.kernels import attn_decode, attn_mma
    from nq.kv_cache import PAGE, gather_kv, make_state, pool_shape

    class LaunchCuda:
        """attn_decode's factories import `cuda` into a closure cell, which the simulator does
        not swap: forward it to the fake module of the running launch."""
        def __getattr__(self, name):
            return getattr(simk._kernel_context, name)

    def case(cfg, length, ms, nc, nst, rpc, seed, early=False):
        fn = attn_decode._combine_kernel(cfg.head_dim, ms, attn_decode.MIN_PPS)
        fn.__closure__[fn.__code__.co_freevars.index("cuda")].cell_contents = LaunchCuda()
        rng = np.random.default_rng(seed)
        need = -(-length // PAGE)
        n_pages = need + 2
        pool = rng.standard_normal(pool_shape(cfg, n_pages)[1:]).astype(np.float16)
        table = np.zeros(need + 2, np.int32)
        table[:need] = rng.permutation(n_pages)[:need]  # scattered pages
        k, v = gather_kv(pool, table, length)
        # Stale slots past the length and unused pages hold NaN: any read of them shows.
        pool[table[need - 1], :, :, length - (need - 1) * PAGE:] = np.nan
        pool[np.setdiff1d(np.arange(n_pages), table[:need])] = np.nan
        q = (rng.standard_normal(cfg.q_size) * 2).astype(np.float32)
        o = cuda.to_device(np.full(cfg.q_size, np.nan, np.float16))
        pa, pm = attn_mma.attn_mma_workspace(cfg, ms)
        pa.copy_to_device(np.full(pa.shape, np.nan, np.float32))  # unused splits stay NaN
        launch = attn_mma.attn_mma_launcher(
            cfg, cuda.to_device(q), make_state(pos=length - 1), cuda.to_device(table),
            cuda.to_device(pool), o, pa, pm, consumers=nc, nstage=nst, rows_per_copy=rpc,
            early=early)
        launch()
        got = o.copy_to_host().astype(np.float64).reshape(cfg.num_heads, cfg.head_dim)
        ref = attn_decode.attention_reference(q.reshape(cfg.num_heads, cfg.head_dim), k, v)
        err = np.abs(got - ref) / (1e-3 + 2e-3 * np.abs(ref))  # the GPU test's tolerance
        print(f"g{cfg.gqa_ratio}d{cfg.head_dim}_len{length}_s{ms}_c{nc}_st{nst}_r{rpc}_e{int(early)}",
              float(err.max()) if np.isfinite(got).all() else float("inf"), flush=True)

    g2 = tiny_config(head_dim=64, num_heads=2, num_kv_heads=1)
    g7 = tiny_config(head_dim=64, num_heads=14, num_kv_heads=2)
    g8 = tiny_config(head_dim=128, num_heads=8, num_kv_heads=1)
    case(g2, 40, 2, 2, 2, 1, 0)    # 2 splits (2 + 1 pages): an idle consumer in the merge, tail 8
    case(g2, 1, 3, 1, 3, 1, 1)     # one token, NC=1 (no merge)
    case(g2, 40, 1, 1, 2, 32, 2)   # one split of 3 pages over 2 stages: wraps; one copy a page
    case(g2, 49, 3, 4, 2, 2, 3)    # NC=4, 2 pages a split (2 idle consumers), tail of 1 token
    case(g7, 17, 1, 2, 2, 1, 4)    # odd G (rows 7-15 padding), kv head 1
    case(g8, 20, 1, 2, 3, 1, 5)    # G=8 fills the 8 rows, d128: one page per consumer, tail 4
    case(g2, 72, 2, 1, 2, 4, 6, early=True)  # the engine's 1:3:4 shape, early copies: 5 pages,
    #                                          3 + 2 a split, the last page's stage waits first
''')

SIM_CASES = 7


@pytest.mark.slow
def test_split_and_combine_under_the_simulator():
    """~20 s: the simulator runs each mma/ldmatrix as a 32-thread rendezvous in Python."""
    errs, stdout = run_under_simulator(SIM_SCRIPT, timeout=600)
    assert len(errs) == SIM_CASES, stdout
    bad = {name: e for name, e in errs.items() if not e <= 1.0}  # err / (atol + rtol |ref|)
    assert not bad, bad
