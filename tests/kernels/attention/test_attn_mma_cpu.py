"""CPU tier for the tensor-core attention split kernel (nq/kernels/attention/decode.py): the fragment
mapping on the nq/ptx/mma.py warp models, the shared-memory layout, sm_90 PTX compiled offline,
and split + combine (two kernels, and the combine fused into the split kernel) run end to end
under the CUDA simulator against the float64 reference."""
import textwrap

import numpy as np
import pytest

from nq.config import PRESETS
from nq.kernels.attention import combine as attn_decode
from nq.kernels.attention import decode as attn_mma
from nq.paged import PAGE

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
    # the fused combine's scratch (weights, 1/den, flag) fits the page slots: same smem
    assert attn_mma.ALIGN + 4 * attn_mma.combine_scratch_words(cfg.gqa_ratio, 66) \
        <= attn_mma.smem_bytes(cfg.head_dim)


# ---- compiled code -------------------------------------------------------------------------------

def _ptx(gqa, d, hkv, nc, nstage=attn_mma.NSTAGE, rpc=attn_mma.ROWS_PER_COPY, early=False,
         fused=(), max_splits=33):
    """fused: () for the two-kernel split kernel, else (warps, combine_rows) of the fused one."""
    key = (gqa, d, hkv, nc, nstage, rpc, max_splits, attn_decode.MIN_PPS, early)
    if not fused:
        return compile_ptx_sm90(attn_mma._split_kernel(*key), attn_decode.SPLIT_SIG, fastmath=True)
    return compile_ptx_sm90(attn_mma._split_kernel(*key, True, *fused), attn_mma.FUSED_SIG,
                            fastmath=True)


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
    _check_page_work_and_registers(ptx, d)


def _check_page_work_and_registers(ptx, d):
    """The split kernel's tensor-core work a page, no local memory, and ptxas's registers."""
    # Per page: D/16 k-steps x 2 token n-tiles (S), 1 (l = P.1), D/8 dim n-tiles (P V); all
    # unrolled, so each appears once in the PTX.
    assert count(ptx, "mma.sync.aligned.m16n8k16") == d // 16 * 2 + 1 + d // 8
    assert count(ptx, "ldmatrix.sync.aligned.m8n8.x4") == d // 8
    assert_no_local_memory(ptx)
    try:
        regs, spills = ptxas_report(ptx)
    except RuntimeError:
        pytest.skip("no ptxas / nvJitLink here")
    # 159 at d128 (numba-cuda 0.30; 144 with nvJitLink 13.5, 143 fused): (NC+1) warps a CTA,
    # so registers do not bound occupancy below ~255; spills would put local memory in the
    # page loop.
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


@pytest.mark.parametrize("gqa,d,hkv,nc,fused", [
    (7, 128, 4, 1, (2, 16)),     # the 7B's defaults (66 splits, 2 warps)
    (7, 128, 4, 1, (4, 16)),     # + 2 merge-only warps
    (7, 128, 4, 2, (3, 8)),      # 2 consumers: warp 1 hands (m, l, acc) to warp 0, then merges
    (8, 128, 1, 4, (5, 4)),      # G = 8, 4 consumers
    (1, 64, 8, 1, (8, 16)),      # G = 1 with 8 warps: 7 warps merge no head
    (3, 64, 2, 1, (2, 16))])     # d64, G not a multiple of the warps
def test_attn_mma_fused_ptx(gqa, d, hkv, nc, fused):
    ms = 66 if gqa == 7 else 33
    ptx = _ptx(gqa, d, hkv, nc, fused=fused, max_splits=ms)
    # one arrival a CTA, a release fence before it and an acquire fence after it, and the
    # partials are read back through the coherent path (never ld.global.nc: other CTAs of this
    # grid wrote them)
    assert count(ptx, "atom.global.add") == 1
    assert count(ptx, "membar.gl") == 2
    assert count(ptx, "ld.global.nc") == 0
    assert count(ptx, "griddepcontrol.wait") == 1
    assert count(ptx, "griddepcontrol.launch_dependents") == 0
    assert_uses(ptx, "shfl.sync.bfly.b32", "ex2.approx", "div.approx", "cvt.rn.f16.f32",
                "st.global.u16")
    # the split part is the two-kernel one: same tensor-core work a page
    _check_page_work_and_registers(ptx, d)


def test_attn_mma_fused_ptx_early():
    # early + fused: the consumers' wait, the last page's, and every thread's before the merge
    ptx = _ptx(7, 128, 4, 1, early=True, fused=(2, 16), max_splits=66)
    assert count(ptx, "griddepcontrol.wait") == 3
    assert count(ptx, "griddepcontrol.launch_dependents") == 0
    assert count(ptx, "atom.global.add") == 1
    assert_no_local_memory(ptx)


def test_two_kernel_split_has_no_merge():
    # the default path is the two-kernel one and its kernel knows nothing of the counters
    ptx = _ptx(7, 128, 4, 1, max_splits=66)
    assert count(ptx, "atom.global") == 0 and count(ptx, "membar.gl") == 0
    assert count(ptx, "st.global.u16") == 0


# ---- the kernels under the CUDA simulator -------------------------------------------------------

SIM_PRELUDE = textwrap.dedent('''
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
    from nq.kernels.attention import combine as attn_decode
    from nq.kernels.attention import decode as attn_mma
    from nq.paged import PAGE, gather_kv, pool_shape
    from nq.runtime.kv_cache import make_state

    class LaunchCuda:
        """attn_decode's factories import `cuda` into a closure cell, which the simulator does
        not swap: forward it to the fake module of the running launch."""
        def __getattr__(self, name):
            return getattr(simk._kernel_context, name)

    def inputs(cfg, length, ms, seed):
        """Scattered pages with NaN in every slot the kernels must not read; q; the reference."""
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
        ref = attn_decode.attention_reference(q.reshape(cfg.num_heads, cfg.head_dim), k, v)
        args = (cuda.to_device(q), make_state(pos=length - 1), cuda.to_device(table),
                cuda.to_device(pool))
        return args, ref

    def rel_err(cfg, o, ref):
        got = o.astype(np.float64).reshape(cfg.num_heads, cfg.head_dim)
        err = np.abs(got - ref) / (1e-3 + 2e-3 * np.abs(ref))  # the GPU test's tolerance
        return float(err.max()) if np.isfinite(got).all() else float("inf")
''')

SIM_SCRIPT = SIM_PRELUDE + textwrap.dedent('''
    def case(cfg, length, ms, nc, nst, rpc, seed, early=False):
        args, ref = inputs(cfg, length, ms, seed)
        o = cuda.to_device(np.full(cfg.q_size, np.nan, np.float16))
        pa, pm = attn_mma.attn_mma_workspace(cfg, ms)
        pa.copy_to_device(np.full(pa.shape, np.nan, np.float32))  # unused splits stay NaN
        launch = attn_mma.attn_mma_launcher(cfg, *args, o, pa, pm, consumers=nc, nstage=nst,
                                            rows_per_copy=rpc, early=early)
        launch()
        print(f"g{cfg.gqa_ratio}d{cfg.head_dim}_len{length}_s{ms}_c{nc}_st{nst}_r{rpc}_e{int(early)}",
              rel_err(cfg, o.copy_to_host(), ref), flush=True)

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


FUSED_SCRIPT = SIM_PRELUDE + textwrap.dedent('''
    class GridOrder:
        """The simulator's numpy, except that the blocks of a grid of shape `dims` run in
        `order(n)` (a permutation of their row-major numbers): any split can arrive last."""
        dims = order = None
        def __getattr__(self, name):
            return getattr(np, name)
        def ndindex(self, *dims):
            points = list(np.ndindex(*dims))
            if self.order is None or tuple(dims) != self.dims:
                return iter(points)
            return iter([points[i] for i in self.order(len(points))])
    grid = simk.np = GridOrder()

    class WriteCount:
        """o for the kernels (the simulator hands it over as it is): a host array that counts
        the writes to each element, so a merge by more than one CTA of a kv head shows even
        though the simulator runs the CTAs one after the other (the last would win)."""
        def __init__(self, n):
            self.a = np.full(n, np.nan, np.float16)
            self.shape, self.dtype = self.a.shape, self.a.dtype
            self.writes = np.zeros(n, np.int64)
        def __getitem__(self, i):
            return self.a[i]
        def __setitem__(self, i, value):
            self.a[i] = value
            self.writes[i] += 1
        def take(self):
            """(o, every element written exactly once), and start over."""
            out, once = self.a.copy(), bool((self.writes == 1).all())
            self.a[:] = np.nan
            self.writes[:] = 0
            return out, once

    def fused_case(cfg, length, ms, nc, seed, orders, early=False, warps=0, rows=16):
        """The two-kernel path once, then the fused kernel once per block order with the same
        counters (they must come back to zero each time): the fused o must be the two-kernel
        o bit for bit, each element written once; prints the two-kernel o's error against the
        reference, inf if not."""
        args, ref = inputs(cfg, length, ms, seed)
        o = WriteCount(cfg.q_size)
        pa, pm = attn_mma.attn_mma_workspace(cfg, ms)
        pa.copy_to_device(np.full(pa.shape, np.nan, np.float32))
        attn_mma.attn_mma_launcher(cfg, *args, o, pa, pm, consumers=nc, early=early)()
        two, same = o.take()
        counters = attn_mma.attn_mma_counters(cfg)
        fused = attn_mma.attn_mma_launcher(cfg, *args, o, pa, pm, consumers=nc, early=early,
                                           counters=counters, combine_warps=warps,
                                           combine_rows=rows)
        grid.dims = (ms, cfg.num_kv_heads, 1)
        for order in orders:
            grid.order = order
            for buf in (pa, pm):  # nothing left over from the run before
                buf.copy_to_device(np.full(buf.shape, np.nan, buf.dtype))
            fused()
            got, once = o.take()
            same &= once and bool((got.view(np.uint16) == two.view(np.uint16)).all())
            same &= bool((counters.copy_to_host() == 0).all())
        grid.order = None
        name = (f"fused_g{cfg.gqa_ratio}d{cfg.head_dim}_len{length}_s{ms}_c{nc}_w{warps}_r{rows}"
                f"_e{int(early)}")
        print(name, rel_err(cfg, two, ref) if same else float("inf"), flush=True)

    def bad_counters(cfg, counters):
        args, _ = inputs(cfg, 1, 2, 0)
        pa, pm = attn_mma.attn_mma_workspace(cfg, 2)
        o = cuda.to_device(np.zeros(cfg.q_size, np.float16))
        try:
            attn_mma.attn_mma_launcher(cfg, *args, o, pa, pm, counters=counters)
        except ValueError as e:
            print(f"bad_counters_{counters.dtype}{counters.shape[0]}",
                  0.0 if "counters is" in str(e) else float("inf"), flush=True)

    natural = None
    reverse = lambda n: range(n - 1, -1, -1)               # split 0 arrives last
    shuffled = lambda n: np.random.default_rng(n).permutation(n)
    g2 = tiny_config(head_dim=64, num_heads=2, num_kv_heads=1)
    g3 = tiny_config(head_dim=64, num_heads=6, num_kv_heads=2)
    g2d = tiny_config(head_dim=128, num_heads=2, num_kv_heads=1)
    fused_case(g2d, 1, 3, 1, 10, [natural])  # one split: no atomic; d128 (4 dims a lane)
    fused_case(g3, 17, 2, 1, 11, [natural, reverse])  # 2 splits, 2 kv heads (a counter each),
    #                                                   G = 3 on 2 warps: warp 1's 2nd head idle
    fused_case(g2, 72, 6, 2, 12, [shuffled, reverse], early=True, warps=3, rows=4)
    #   5 splits of 1 page in 2 merge rounds of 4 (the 2nd clamped at max_splits 6), 2 consumers
    #   (warp 1 hands its page to warp 0 and merges), a merge-only warp, early copies
    bad_counters(g3, cuda.to_device(np.zeros(3, np.int32)))
    bad_counters(g3, cuda.to_device(np.zeros(2, np.int64)))
''')

FUSED_CASES = 5


@pytest.mark.slow
def test_fused_combine_under_the_simulator():
    """~20 s: the combine fused into the last CTA of each kv head gives the two-kernel o bit
    for bit, whichever CTA arrives last, and leaves the counters at zero (run twice)."""
    errs, stdout = run_under_simulator(FUSED_SCRIPT, timeout=600)
    assert len(errs) == FUSED_CASES, stdout
    bad = {name: e for name, e in errs.items() if not e <= 1.0}
    assert not bad, bad
