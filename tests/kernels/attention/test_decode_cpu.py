"""CPU tier for the decode attention kernels (nq/kernels/attention/decode.py, combine.py): sm_90
PTX compiled offline with the instructions and tensor-core work they promise, ptxas's registers,
the kernels' names, the launcher's refusals, and split + combine run end to end under the CUDA
simulator against the float64 reference."""
import textwrap

import numpy as np
import pytest

from nq.config import tiny_config
from nq.kernels.attention import combine, decode, launch, plan

from ptx_util import (assert_no_local_memory, assert_uses, compile_ptx_sm90, compiled_name,
                      count, have_ptxas, ptxas_report, run_under_simulator)


# ---- compiled code -------------------------------------------------------------------------------

def _ptx(gqa, d, hkv, nc, nstage=plan.NSTAGE, rpc=plan.ROWS_PER_COPY, early=False, max_splits=33):
    body = decode.split_body(gqa, d, hkv, nc, nstage, rpc, max_splits, plan.MIN_PPS, early)
    return compile_ptx_sm90(body, decode.SPLIT_SIG, fastmath=True)


@pytest.mark.parametrize("nc", [1, 2, 4])
@pytest.mark.parametrize("gqa,d,hkv", [(7, 128, 4), (2, 64, 2), (8, 128, 1), (1, 64, 8)])
def test_split_ptx(gqa, d, hkv, nc):
    ptx = _ptx(gqa, d, hkv, nc)
    assert_uses(ptx, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",
                "mbarrier.try_wait.parity", "mbarrier.arrive.expect_tx", "fence.proxy.async",
                "griddepcontrol.wait", "ex2.approx")
    # Per page: D/16 k-steps x 2 token n-tiles (scores), 1 (l = P.1), D/8 dim n-tiles (P V);
    # all unrolled, so each appears once in the PTX.
    assert count(ptx, "mma.sync.aligned.m16n8k16") == d // 16 * 2 + 1 + d // 8
    assert count(ptx, "ldmatrix.sync.aligned.m8n8.x4") == d // 8
    # The partials go to global memory once a CTA, and nothing else: no atomics, no fences,
    # no fp16 stores (o is the combine's), and no early trigger of the dependents.
    assert count(ptx, "atom.global") == 0 and count(ptx, "membar.gl") == 0
    assert count(ptx, "st.global.u16") == 0
    assert count(ptx, "griddepcontrol.launch_dependents") == 0
    assert_no_local_memory(ptx)


@pytest.mark.skipif(not have_ptxas(), reason="neither nvJitLink (cuda.core) nor ptxas")
@pytest.mark.parametrize("gqa,d,hkv,nc", [(7, 128, 4, 1), (7, 128, 4, 2), (2, 64, 2, 1)])
def test_split_registers(gqa, d, hkv, nc):
    regs, spills = ptxas_report(_ptx(gqa, d, hkv, nc))
    # 159 at d128 (numba-cuda 0.30; 144 with nvJitLink 13.5): (NC+1) warps a CTA, so registers
    # do not bound occupancy below ~255; spills would put local memory in the page loop.
    assert spills == 0 and regs <= 192


@pytest.mark.parametrize("nstage,rpc", [(2, 32), (4, 2)])
def test_split_ptx_copy_variants(nstage, rpc):
    assert_no_local_memory(_ptx(7, 128, 4, 2, nstage, rpc))


def test_split_ptx_early():
    # early: one wait in the consumer branch, one before the last page's copies
    ptx = _ptx(7, 128, 4, 1, early=True)
    assert count(ptx, "griddepcontrol.wait") == 2
    assert count(_ptx(7, 128, 4, 1), "griddepcontrol.wait") == 1
    assert_no_local_memory(ptx)


def test_split_ptx_ppc():
    # ppc: the engine's kernel (4 consumers, ppc 2) keeps the page loop's work and no local
    # memory; the consumer count a split uses is computed at run time
    body = decode.split_body(7, 128, 4, 4, plan.NSTAGE, 2, 66, 2, True, ppc=2)
    ptx = compile_ptx_sm90(body, decode.SPLIT_SIG, fastmath=True)
    assert count(ptx, "mma.sync.aligned.m16n8k16") == 128 // 16 * 2 + 1 + 128 // 8
    assert_no_local_memory(ptx)


def test_split_ptx_tma():
    _check_tma_ptx(dict(tma=True))


def test_split_ptx_tma_from_has_both_copy_paths():
    ptx = _check_tma_ptx(dict(tma=True, tma_from=12))
    assert_uses(ptx, "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes")


def _check_tma_ptx(kw):
    # tensor-map copies: one instruction a page (tma 1) or a 64-dim half (tma 2), no plain bulk
    # copies, the page loop's work unchanged, no local memory
    body = decode.split_body(7, 128, 4, 4, plan.NSTAGE, 2, 66, 2, True, ppc=2, **kw)
    ptx = compile_ptx_sm90(body, decode.SPLIT_SIG_TMA, fastmath=True)
    assert count(ptx, "cp.async.bulk.tensor.5d.shared::cluster.global.tile") == 1
    if not kw.get("tma_from"):
        assert count(ptx, "cp.async.bulk.shared::cluster.global") == 0
        assert count(ptx, "mma.sync.aligned.m16n8k16") == 128 // 16 * 2 + 1 + 128 // 8
    assert_no_local_memory(ptx)
    if have_ptxas():
        # five warps a CTA, two CTAs an SM: up to 204 registers a thread
        regs, spills = ptxas_report(ptx)
        assert spills == 0 and regs <= 200
    return ptx


@pytest.mark.parametrize("groups", [8, 4])
def test_combine_ptx(groups):
    """attn_combine: the plan before the wait; a split's (m, l) and acc in one 8-byte and one
    16-byte load, all of a chunk's before the first exp2, none behind a branch; no local
    memory."""
    ptx = compile_ptx_sm90(combine.combine_body(128, 66, 2, groups), combine.COMBINE_SIG,
                           fastmath=True)
    assert_uses(ptx, "griddepcontrol.launch_dependents", "griddepcontrol.wait", "ex2.approx",
                "cvt.rn.f16.f32", "ld.global.nc.v2.f32", "ld.global.nc.v4.f32")
    assert_no_local_memory(ptx)
    head, body = ptx.split("griddepcontrol.wait", 1)
    assert head.count("ld.global") == 1
    first = body[:body.index("ex2.approx")]
    rows = min(-(-66 // groups), combine.VEC_CHUNK_ROWS)
    assert first.count("ld.global.nc.v2.f32") == first.count("ld.global.nc.v4.f32") == rows
    assert first.count("ld.global") == 2 * rows
    # the loads, then the warp sync, then the first use of what they read
    loads, uses = first.split("bar.warp.sync", 1)
    assert loads.count("ld.global") == 2 * rows and "max.ftz.f32" not in loads
    assert "bra" not in loads
    if have_ptxas():
        regs, spills = ptxas_report(ptx)
        assert spills == 0 and regs <= 128


def test_kernel_names_spell_every_constant():
    assert (compiled_name(launch.split_kernel, 7, 128, 4, 1, 3, 2, 66, 2, True)
            == "attn_split_gqa7_d128_kv4_c1_st3_rpc2_splits66_minpps2_early1")
    assert (compiled_name(combine.combine_kernel, 128, 66, 2)
            == "attn_combine_d128_splits66_minpps2_g8_vec4")


def test_argument_check_refuses_with_what_it_wants():
    cfg = tiny_config()
    pa = np.zeros((4, cfg.num_heads, cfg.head_dim), np.float32)
    pm = np.zeros((4, cfg.num_heads, 2), np.float32)
    ok = dict(q=np.zeros(cfg.q_size, np.float32), state=np.zeros(4, np.int32),
              table=np.zeros(8, np.int32), kv_layer=np.zeros((8, cfg.num_kv_heads, 2, 16,
                                                              cfg.head_dim), np.float16),
              o=np.zeros(cfg.q_size, np.float16), part_acc=pa, part_ml=pm)
    for name, bad, match in (("q", np.zeros(3, np.float32), "q is float32"),
                             ("o", np.zeros(cfg.q_size, np.float32), "o is float32"),
                             ("part_ml", pm[:3], "part_ml is"),
                             ("kv_layer", ok["kv_layer"].astype(np.float32), "kv_layer is")):
        with pytest.raises(ValueError, match=match):
            plan.check_attention_args(cfg, **dict(ok, **{name: bad}))


# ---- the kernels under the CUDA simulator -------------------------------------------------------

SIM_SCRIPT = textwrap.dedent('''
    import sys

    import numpy as np
    from numba import cuda

    sys.path.insert(0, "tests")
    import sim_warp
    sim_warp.patch_simulator(syncwarp=True)   # shuffles, __syncwarp, the polling throttle

    from nq.config import tiny_config
    from nq.kernels import attention
    from nq.paged import PAGE, gather_kv, pool_shape
    from nq.runtime.kv_cache import make_state

    def inputs(cfg, length, seed):
        """Scattered pages with NaN in every slot the kernels must not read; q; the reference."""
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
        ref = attention.attention_reference(q.reshape(cfg.num_heads, cfg.head_dim), k, v)
        args = (cuda.to_device(q), make_state(pos=length - 1), cuda.to_device(table),
                cuda.to_device(pool))
        return args, ref

    seen = [0]

    def case(cfg, length, ms, nc, nst, rpc, seed, early=False, min_pps=1, ppc=0,
             tma=False, tma_from=0):
        seen[0] += 1
        if seen[0] - 1 not in PICK:   # only the cases numbered in PICK (the order below) run
            return
        args, ref = inputs(cfg, length, seed)
        o = cuda.to_device(np.full(cfg.q_size, np.nan, np.float16))
        pa, pm = attention.decode_workspace(cfg, ms)
        pa.copy_to_device(np.full(pa.shape, np.nan, np.float32))  # unused splits stay NaN
        launch = attention.decode_launcher(cfg, *args, o, pa, pm, consumers=nc, nstage=nst,
                                           rows_per_copy=rpc, early=early, min_pps=min_pps,
                                           ppc=ppc, tma=tma, tma_from=tma_from)
        launch()
        got = o.copy_to_host().astype(np.float64).reshape(ref.shape)
        err = np.abs(got - ref) / (1e-3 + 2e-3 * np.abs(ref))  # the GPU test's tolerance
        name = (f"g{cfg.gqa_ratio}d{cfg.head_dim}_len{length}_s{ms}_c{nc}_st{nst}_r{rpc}"
                f"_e{int(early)}_p{min_pps}" + (f"_ppc{ppc}" if ppc else "") + ("_tma" if tma else "")
                + (f"_from{tma_from}" if tma_from else ""))
        print(name, float(err.max()) if np.isfinite(got).all() else float("inf"), flush=True)

    g2 = tiny_config(head_dim=64, num_heads=2, num_kv_heads=1)
    g7 = tiny_config(head_dim=64, num_heads=14, num_kv_heads=2)
    g8 = tiny_config(head_dim=128, num_heads=8, num_kv_heads=1)
    case(g2, 40, 2, 2, 2, 1, 0)    # 2 splits (2 + 1 pages): an idle consumer in the merge, tail 8
    case(g2, 1, 3, 1, 3, 1, 1)     # one token, NC=1 (no merge)
    case(g2, 40, 1, 1, 2, 32, 2)   # one split of 3 pages over 2 stages: wraps; one copy a page
    case(g2, 49, 3, 4, 2, 2, 3)    # NC=4, 2 pages a split (2 idle consumers), tail of 1 token
    case(g7, 17, 1, 2, 2, 1, 4)    # odd GQA (rows 7-15 padding), kv head 1
    case(g8, 20, 1, 2, 3, 1, 5)    # GQA 8 fills the 8 rows, d128: one page per consumer, tail 4
    case(g2, 72, 2, 1, 3, 2, 6, early=True, min_pps=2)  # the engine's options: 5 pages, 3 + 2
    #                                  a split, the last page's stage waits first
    # ppc (a split's pages over min(NC, pps // ppc) consumers): 8 pages over all 4 (two
    # stages, the last page's tail 13 tokens); 2-page splits on 1 of 4 (three return at once,
    # no merge); 5 pages on 2 of 3 (stages of 2, 2, 1: a consumer idle in the last)
    case(g2, 8 * 16 - 3, 1, 4, 2, 4, 12, early=True, min_pps=2, ppc=2)
    case(g2, 40, 2, 4, 2, 2, 13, min_pps=2, ppc=2)
    case(g2, 5 * 16, 1, 3, 2, 2, 14, ppc=2)
    # tma (a tensor-map copy a 64-dim half into 128-byte swizzled slots): d128, 4 pages over 2
    # consumers, tail 5; d128 in 2 splits with the engine's early wait; d64 (one half), two kv
    # heads
    case(g8, 3 * 16 + 5, 1, 2, 2, 2, 15, tma=True)
    case(g8, 37, 2, 4, 2, 2, 16, early=True, min_pps=2, ppc=1, tma=True)
    case(g7, 40, 2, 1, 3, 2, 17, early=True, tma=True)
    # tma_from (tensor-map copies from 3 pages a split, bulk copies below; one kernel): a split
    # of 3 pages takes the tensor path, splits of 1 page the bulk path
    case(g8, 3 * 16 - 2, 1, 2, 2, 2, 18, early=True, tma=True, tma_from=3)
    case(g8, 3 * 16 - 2, 3, 2, 2, 2, 19, early=True, tma=True, tma_from=3)
''')

# ~10 s a case on 2 cores (the simulator runs each mma / ldmatrix as a 32-thread rendezvous
# in Python).  CI's tier: one token, four consumers, GQA 8 at d128, the engine's options (old
# and new: cases 6, 7), ppc's one-of-four, the tensor-map copies at d128 and d64, tma_from's
# switch; the long tier (`pytest -m long`) the rest.  (The cluster merge's two cases went with
# it, after 342710b; the fresh row's three, after 83f4990.)
SIM_PICK = (1, 3, 5, 6, 7, 8, 10, 12, 13)
SIM_PICK_LONG = (0, 2, 4, 9, 11, 14)


def _split_and_combine_under_the_simulator(pick):
    errs, stdout = run_under_simulator(f"PICK = {pick!r}\n" + SIM_SCRIPT, timeout=600)
    assert len(errs) == len(pick), stdout
    bad = {name: e for name, e in errs.items() if not e <= 1.0}  # err / (atol + rtol |ref|)
    assert not bad, bad


@pytest.mark.slow
def test_split_and_combine_under_the_simulator():
    _split_and_combine_under_the_simulator(SIM_PICK)


@pytest.mark.long
def test_split_and_combine_under_the_simulator_other_cases():
    _split_and_combine_under_the_simulator(SIM_PICK_LONG)


COMBINE_SCRIPT = textwrap.dedent('''
    import sys

    import numpy as np
    from numba import cuda

    sys.path.insert(0, "tests")
    import sim_warp
    sim_warp.patch_simulator(syncwarp=True)

    from nq.kernels.attention import combine
    from nq.kernels.attention.plan import split_plan
    from nq.paged import PAGE
    from nq.runtime.kv_cache import make_state

    def case(length, ms, min_pps, groups, seed, hq=2, d=32):
        """attn_combine alone on random partials: rows past the plan's splits hold NaN and
        inf (never written in a step), m spans 60 so the weights underflow for some splits."""
        rng = np.random.default_rng(seed)
        _, n = split_plan(length, ms, min_pps)
        m = rng.uniform(-30, 30, (ms, hq)).astype(np.float32)
        l = rng.uniform(1, 16, (ms, hq)).astype(np.float32)
        acc = rng.standard_normal((ms, hq, d)).astype(np.float32) * l[:, :, None]
        ml = np.stack([m, l], axis=2)
        ml[n:, :, 0], ml[n:, :, 1], acc[n:] = np.inf, np.nan, np.nan
        w = np.exp2(m[:n].astype(np.float64) - m[:n].max(axis=0))
        ref = (np.einsum("sh,shd->hd", w, acc[:n]) / (w * l[:n]).sum(axis=0)[:, None]).ravel()
        o = cuda.to_device(np.full(hq * d, np.nan, np.float16))
        args = (make_state(pos=length - 1), cuda.to_device(acc.reshape(-1)),
                cuda.to_device(ml.reshape(-1)), o)
        threads = combine.combine_threads(d, groups)
        combine.combine_kernel(d, ms, min_pps, groups)[hq, threads](*args)
        got = o.copy_to_host().astype(np.float64)
        err = np.abs(got - ref) / (1e-3 + 2e-3 * np.abs(ref))
        print(f"len{length}_s{ms}_p{min_pps}_g{groups}",
              float(err.max()) if np.isfinite(got).all() else float("inf"), flush=True)

    for groups in (8, 4, 1):   # a thread's splits in 1, 2 and 5 chunks (16 rows a chunk)
        case(1, 66, 2, groups, 0)                  # one split, 65 stale rows
        case(40 * PAGE, 66, 2, groups, 1)          # 20 splits: groups of 3 and 2
        case(66 * 8 * PAGE, 66, 2, groups, 2)      # every row a split
        case(5 * PAGE + 3, 7, 1, groups, 3)        # 6 of 7: fewer rows than groups x 2
''')

COMBINE_CASES = 12


@pytest.mark.slow
def test_combine_forms_under_the_simulator():
    """attn_combine with 8, 4 and 1 split groups (a thread's splits loaded in 1, 2 and 5
    chunks) against the float64 merge of the same partials."""
    errs, stdout = run_under_simulator(COMBINE_SCRIPT, timeout=600)
    assert len(errs) == COMBINE_CASES, stdout
    bad = {name: e for name, e in errs.items() if not e <= 1.0}
    assert not bad, bad

def test_engine_options_are_launcher_keywords():
    """The engine's ATTN_OPTIONS (what the 7B step runs) are knobs decode_launcher still has."""
    import inspect

    from nq.runtime.step import ATTN_OPTIONS
    knobs = {n for n, p in inspect.signature(launch.decode_launcher).parameters.items()
             if p.kind is p.KEYWORD_ONLY}
    assert set(ATTN_OPTIONS) <= knobs == {"consumers", "nstage", "rows_per_copy", "min_pps", "early",
                                         "ppc", "tma", "tma_from", "merge",
                                         "trigger"}


def test_step_attention_options_take_an_experiment_over_the_defaults():
    from nq.runtime.step import ATTN_OPTIONS, attention_options
    assert attention_options() == ATTN_OPTIONS
    assert attention_options({"early": False, "min_pps": 4}) == \
        {**ATTN_OPTIONS, "early": False, "min_pps": 4}
    assert attention_options({"tma": False})["tma"] is False


def test_step_grid_is_one_wave_of_one_cta_an_sm():
    # the step's split kernel (step.py ATTN_OPTIONS, split_width): four stages of four tensor-
    # map slots are more than half of an SM's shared memory, so one CTA an SM, and the grid is
    # the most splits a kv head whose CTAs fit one wave
    from nq.kernels.common import SMEM_OPTIN_LIMIT
    from nq.runtime.step import ATTN_OPTIONS
    o = ATTN_OPTIONS
    nbytes = plan.cta_smem_bytes(128, o["consumers"], o["nstage"], o["rows_per_copy"], o["tma"],
                                 o["tma_from"])
    assert nbytes == plan.smem_bytes(128, 4, 4, 2, tma=True) + plan.barrier_bytes(4)
    assert SMEM_OPTIN_LIMIT // 2 < nbytes <= SMEM_OPTIN_LIMIT and plan.ctas_an_sm(nbytes) == 1
    assert [plan.one_wave_splits(kv) for kv in (2, 4, 8)] == [66, 33, 16]   # one CTA an SM
    assert 4 * plan.one_wave_splits(4, 114) <= 114        # an H100 PCIe's SMs: still one wave
    assert plan.one_wave_splits(200, 132) == 1
    # the step's width by model: d128 (7B, 14B) one CTA an SM; d64 (0.5B) slots of half the
    # size, two; never past the partials decode_workspace gives the engine
    from nq.config import PRESETS
    from nq.runtime.step import split_width
    widths = {name: split_width(PRESETS[name]) for name in ("0.5b", "7b", "14b", "32b")}
    assert widths == {"0.5b": 132, "7b": 33, "14b": 16, "32b": 16}
    for name, w in widths.items():
        assert w <= plan.default_max_splits(PRESETS[name].num_kv_heads)
    assert split_width(PRESETS["7b"], {**ATTN_OPTIONS, "nstage": 2}) == 66   # 64 KB: two an SM
