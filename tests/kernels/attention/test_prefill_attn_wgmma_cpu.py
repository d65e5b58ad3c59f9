"""CPU tier for the wgmma prefill attention (nq/kernels/attention/prefill_wgmma.py): the tile
layout against the descriptor models of both operands (K K-major, V MN-major), the sm_90a PTX
of the 7B and 0.5B head shapes with ptxas accepting it (no spills, no local memory, no
serialised wgmma), and the kernel under the CUDA simulator on tiny shapes against the float64
reference with test_prefill_attn_gpu's tolerance.

The simulator runs the wgmma twins synchronously, so it checks the copies, swizzle,
descriptors, fragments, masking and softmax -- not the waits (the GPU test does).  Its wgmmas
go through `fast_wgmma_twin` below, the twin's model vectorised (checked against
nq.ptx.wgmma.wgmma_group_model here): the twin proper assembles the 64 x 16 A element by
element in every one of 128 threads, seconds a wgmma."""
import textwrap

import numpy as np
import pytest

from nq.config import PRESETS
from nq.kernels.attention import prefill, prefill_wgmma as W
from nq.ptx import wgmma as G

ptx_util = pytest.importorskip("ptx_util")


# ---- layout: the tile the copies write is the operand each descriptor names ---------------------

@pytest.mark.parametrize("d,bn", [(128, 128), (64, 128), (128, 64)])
def test_k_tile_is_the_k_major_operand(d, bn):
    """Element (key r, dim x) of a K tile, where the cp.async plan puts it (tile_offset), is
    where the S wgmma's descriptor for x's k16 step reads it: start = half x // 64, + 32 bytes
    a k16 step of the half, SBO 1024, 128B swizzle (the tile 1024-aligned)."""
    r, x = np.meshgrid(np.arange(bn), np.arange(d), indexing="ij")
    placed = np.vectorize(lambda rr, xx: W.tile_offset(rr, xx // 8, bn) + 2 * (xx % 8))(r, x)
    ks = x // 16
    start = (ks // 4) * bn * W.ROW + 32 * (ks % 4)
    read = G.smem_offset(r, x % 16, 16, 1024, G.SWIZZLE_128B, start)
    assert np.array_equal(placed, read)
    assert sorted(placed.reshape(-1).tolist()) == list(range(0, 2 * bn * d, 2))


@pytest.mark.parametrize("d,bn", [(128, 128), (64, 128), (128, 64)])
def test_v_tile_is_the_mn_major_operand(d, bn):
    """Element (key k, dim n) of a V tile is where the P V wgmma's trans-b descriptor for k's
    k16 step reads it: start + 2048 a step (16 keys), LBO = bn x 128 (the next 64 dims), SBO
    1024 (8 keys), 128B swizzle."""
    k, n = np.meshgrid(np.arange(bn), np.arange(d), indexing="ij")
    placed = np.vectorize(lambda kk, nn: W.tile_offset(kk, nn // 8, bn) + 2 * (nn % 8))(k, n)
    read = G.smem_offset_mn(n, k % 16, bn * W.ROW, 1024, G.SWIZZLE_128B, (k // 16) * 2048)
    assert np.array_equal(placed, read)


def test_shared_memory_and_tiling_of_the_7b():
    cfg = PRESETS["7b"]
    assert prefill.tokens_per_cta(cfg.gqa_ratio, 4 * W.WARPGROUPS) == 18   # 126 of 128 rows
    assert W.smem_bytes(cfg.head_dim) == 3 * 65536 + 1024 <= 227 * 1024
    with pytest.raises(ValueError, match="shared memory"):
        W.check_shape(cfg, 2, 128, 4)
    with pytest.raises(ValueError, match="unsupported"):
        W.check_shape(cfg, 2, 128, 2)        # a tile reads two stages: nstage >= 3


# ---- the fast twin -------------------------------------------------------------------------------

_TH = np.arange(128)
_W, _G, _T = _TH // 32, (_TH % 32) // 4, _TH % 4
_REG, _HALF = np.arange(4), np.arange(2)
A_ROW = (16 * _W + _G)[:, None, None] + 8 * (_REG & 1)[None, :, None] + 0 * _HALF
A_COL = (2 * _T)[:, None, None] + _HALF[None, None, :] + 8 * (_REG >> 1)[None, :, None]


def d_index(n):
    """(rows, cols), each (128, n/2): D's element of accumulator j of thread th."""
    j = np.arange(n // 2)
    i, r = j // 4, j % 4
    return ((16 * _W + _G)[:, None] + 8 * (r >> 1)[None, :],
            (2 * _T)[:, None] + 8 * i[None, :] + (r & 1)[None, :])


def group_product(n, regs, b, d, scale_d):
    """wgmma_group_model with the A fragments given as registers: regs (128, 4) uint32, b (N,
    16) float64, d (128, N/2) -> (128, N/2) float32."""
    a = np.zeros((64, 16))
    a[A_ROW, A_COL] = np.asarray(regs, np.uint32).view(np.float16).reshape(128, 4, 2)
    rows, cols = d_index(n)
    out = (a @ np.asarray(b, np.float64).T)[rows, cols]
    if scale_d:
        out = out + np.asarray(d, np.float64)
    return out.astype(np.float32)


def test_group_product_is_the_twin_model():
    rng = np.random.default_rng(0)
    for n in (16, 64):
        regs = (rng.standard_normal((128, 8)) * 2).astype(np.float16).view(np.uint32)
        b = (rng.standard_normal((n, 16))).astype(np.float16).astype(np.float64)
        d = rng.standard_normal((128, n // 2)).astype(np.float32)
        a = np.zeros((64, 16))
        for th in range(128):
            for reg in range(4):
                for half in range(2):
                    a[G.a_fragment_coords(th, reg, half)] = \
                        regs[th:th + 1, reg].view(np.float16)[half]
        for sd in (0, 1):
            want = G.wgmma_group_model(n, a, b, d, sd)
            np.testing.assert_allclose(group_product(n, regs, b, d, sd), want, rtol=1e-6,
                                       atol=1e-6)


def fast_wgmma_twin(n, trans_b):
    """The rs wgmma twin (K-major or trans-b B), vectorised with group_product."""
    import threading

    from nq.ptx import _sim
    read = G.read_operand_mn if trans_b else G.read_operand

    def twin(acc, a0, a1, a2, a3, desc_b, scale_d):
        mine = [float(acc[j]) for j in range(n // 2)]
        everyone = _sim.warp_exchange(((int(a0), int(a1), int(a2), int(a3)), mine,
                                       int(desc_b), int(scale_d)), size=128)
        assert len({e[2] for e in everyone}) == 1 and len({e[3] for e in everyone}) == 1
        th = threading.current_thread().thread_id % 128
        regs = np.array([e[0] for e in everyone], np.uint32)
        d = np.array([e[1] for e in everyone], np.float32)
        out = group_product(n, regs, read(desc_b, n), d, scale_d)[th]
        for j in range(n // 2):
            acc[j] = out[j]
    return twin


def install_fast_twins(widths=(64, 128)):
    """Put the fast twins where prefill_wgmma's factory takes its wgmmas from (the wrapper
    cache; under the simulator a wrapper is its twin), for S and O of every width, and give
    each simulated block a fresh stand-in shared window: the descriptor's 14-bit start field
    reaches 256 KiB, and the simulator registers every block's shared array anew."""
    from numba.cuda.simulator import kernel as simk

    from nq.ptx import _sim
    for n in widths:
        G._cache[("rs", n, 0)] = fast_wgmma_twin(n, False)
        G._cache[("rs_tb", n, 0)] = fast_wgmma_twin(n, True)
    run = simk.BlockManager.run

    def fresh_window(self, *args):
        with _sim._lock:
            _sim._regions.clear()
            _sim._next_base = 0x400
        return run(self, *args)
    simk.BlockManager.run = fresh_window


# ---- compiled code -------------------------------------------------------------------------------

def _ptx(gqa, d, hkv, wg=W.WARPGROUPS, bn=W.BN, nstage=W.NSTAGE, overlap=False):
    return ptx_util.compile_ptx_sm90(W._prefill_kernel(gqa, d, hkv, wg, bn, nstage, overlap),
                                     prefill.SIG, cc=ptx_util.SM90A, fastmath=True,
                                     launch_bounds=(128 * wg,))


@pytest.mark.skipif(__import__("nq.ptx").ptx.SIMULATOR, reason="the simulator compiles nothing")
@pytest.mark.parametrize("overlap", [False, True], ids=["base", "overlap"])
@pytest.mark.parametrize("name", ["7b", "0.5b"])
def test_prefill_wgmma_ptx_sm90a(name, overlap, capsys):
    cfg = PRESETS[name]
    d = cfg.head_dim
    ptx = _ptx(cfg.gqa_ratio, d, cfg.num_kv_heads, overlap=overlap)
    assert ".target sm_90a" in ptx
    s_mma = f"wgmma.mma_async.sync.aligned.m64n{W.BN}k16.f32.f16.f16"
    ptx_util.assert_uses(ptx, s_mma, "wgmma.fence.sync.aligned",
                         "wgmma.commit_group.sync.aligned", "wgmma.wait_group.sync.aligned",
                         "cp.async.cg.shared.global", "fence.proxy.async.shared::cta",
                         "ex2.approx", "shfl.sync.bfly")
    # S: D/16 k16 steps for tile 0 and in each loop; P V (trans-b, N = D): BN/16 in each loop
    # and after them -- unrolled, so every accumulator index is a constant
    # (the loop body twice: tiles below the diagonal without the mask, the rest with it)
    n_s, n_o = 3 * d // 16, 3 * W.BN // 16
    o_mma = f"wgmma.mma_async.sync.aligned.m64n{d}k16.f32.f16.f16"
    if o_mma == s_mma:
        assert ptx_util.count(ptx, s_mma) == n_s + n_o
    else:
        assert (ptx_util.count(ptx, s_mma), ptx_util.count(ptx, o_mma)) == (n_s, n_o)
    assert ptx.count(", 1, 1, 1;") == n_o          # the trans-b ones
    ptx_util.assert_no_local_memory(ptx)
    if not ptx_util.have_ptxas():
        pytest.skip("no ptxas / nvJitLink here: the PTX checks above stand")
    log = ptx_util.ptxas_log(ptx)
    regs, spills = ptx_util.ptxas_report(ptx)
    with capsys.disabled():
        print(f"\nprefill_attn_wgmma {name} overlap={overlap}: {regs} registers, {spills} "
              f"spill bytes, {W.smem_bytes(d)} B smem")
    # 252 / 253 (overlap) at d128 (numba-cuda 0.30, CUDA 13.0): 256 threads, one CTA an SM
    assert "serialized" not in log, log      # ptxas could not prove the wgmma pipeline
    # the overlap loop (P_{j-1} live through the softmax) spills 48-104 bytes (by ptxas
    # version) of the epilogue's row indices at entry and reloads them after the loops
    # (nvdisasm: no STL/LDL inside a loop); the default loop spills nothing
    assert spills <= (128 if overlap and d == 128 else 0) and regs <= 255, (regs, spills)


# ---- the kernel under the CUDA simulator ---------------------------------------------------------

SIM_SCRIPT = textwrap.dedent('''
    import sys

    import numpy as np
    from numba import cuda

    sys.path.insert(0, "tests")
    sys.path.insert(0, "tests/kernels/attention")
    import sim_warp
    sim_warp.patch_simulator()   # shuffles and the polling throttle
    import test_prefill_attn_wgmma_cpu as T

    from nq.config import tiny_config
    from nq.kernels.attention import prefill, prefill_wgmma as W
    from nq.paged import PAGE, gather_kv, pool_shape

    seen = [0]

    def case(cfg, m, start, seed, m_max=None, wg=1, bn=64, nstage=3, overlap=False):
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
        launch = W.prefill_attention_launcher(cfg, cuda.to_device(q), cuda.to_device(pool),
                                              cuda.to_device(table), o, warpgroups=wg, bn=bn,
                                              nstage=nstage, overlap=overlap)
        launch(m, start)
        got = o.copy_to_host()
        ref = prefill.prefill_attention_reference(prefill.rounded_q(q[:m], cfg.head_dim), k, v,
                                                  start).reshape(m, -1)
        err = np.abs(got[:m].astype(np.float64) - ref) / tolerance(ref, v)
        ok = np.isfinite(got[:m]).all() and np.isnan(got[m:]).all()  # rows past m untouched
        name = (f"g{cfg.gqa_ratio}d{cfg.head_dim}_m{m}_s{start}_wg{wg}_bn{bn}_st{nstage}"
                + ("_ov" if overlap else ""))
        print(name, float(err.max()) if ok else float("inf"), flush=True)

    __TOLERANCE__
    T.install_fast_twins()
    g4 = tiny_config(head_dim=64, num_heads=4, num_kv_heads=1)            # G 4, d 64
    g8 = tiny_config(head_dim=128, num_heads=8, num_kv_heads=1)           # G 8, d 128
    g7 = tiny_config(head_dim=128, num_heads=7, num_kv_heads=1)           # the 7B's G 7, d 128
    # 16 tokens a CTA: m 21 is two CTAs, the second short (padding rows), start 13 > 0;
    # 3 tiles of 64 keys through 3 stages (the ring wraps, online softmax over 3 steps); tile 1
    # (keys 64..127) lies below every row of the first CTA: the loop without the mask
    case(g4, 21, 130, seed=1, m_max=24)
    # d 128 (two 64-dim halves: K's k16 steps 4-7, V's LBO), 2 tiles, the tail page
    case(g8, 3, 100, seed=2)
    # the 7B's CTA: G 7, d 128, two warpgroups (18 tokens; m 12 leaves the second warpgroup
    # 21 real rows and 43 padding ones), BN 128, 3 stages; start 120 makes 2 tiles
    case(g7, 12, 120, seed=3, wg=2, bn=128)
    # overlap=True (the rescale under S_j, the unconditional refill after the softmax): the ring
    # wraps with zero-filled tail tiles (4 tiles of 64 keys, 3 stages), and the 7B CTA
    case(g4, 21, 190, seed=4, m_max=24, overlap=True)
    case(g7, 12, 120, seed=5, wg=2, bn=128, overlap=True)
''')


# ~40 s a case on 2 cores.  CI's tier: the ring wrapping over two CTAs (case 0) and the 7B's
# CTA (2), in the engine's loop; the long tier (`pytest -m long`) d 128 at G 8 (1) and the
# opt-in overlap loop (3, 4; NQ_ATTN_OVERLAP=1).
SIM_PICK = (0, 2)
SIM_PICK_LONG = (1, 3, 4)


@pytest.mark.slow
def test_prefill_wgmma_under_the_simulator():
    _prefill_wgmma_under_the_simulator(SIM_PICK)


@pytest.mark.long
def test_prefill_wgmma_under_the_simulator_other_cases():
    _prefill_wgmma_under_the_simulator(SIM_PICK_LONG)


def _prefill_wgmma_under_the_simulator(pick):
    import inspect

    import test_prefill_attn_gpu
    source = inspect.getsource(test_prefill_attn_gpu.tolerance)  # the GPU test's, verbatim
    script = f"PICK = {pick!r}\n" + SIM_SCRIPT
    errs, stdout = ptx_util.run_under_simulator(script.replace("__TOLERANCE__", source),
                                                timeout=600)
    assert len(errs) == len(pick), stdout
    bad = {name: e for name, e in errs.items() if not e <= 1.0}
    assert not bad, bad
