"""The wgmma prefill attention (nq/kernels/attention/prefill_wgmma.py) on the GPU against the
float64 reference, with test_prefill_attn_gpu.py's cases, reference rows and tolerance (the
same roundings: fp16 q, fp16 P, fp32 S and O, fp16 o), plus the long chunks the kernel exists
for (2048 tokens at start 30000) and its other shapes (one warpgroup, BN 64, 4 stages).  NaN in
every cache slot the kernel must not read; rows past m must stay untouched."""
import numpy as np
import pytest

from nq.kernels.attention import prefill_wgmma as W
from nq.paged import PAGE, gather_kv, pool_shape

from test_prefill_attn_gpu import CFGS, checked_rows, reference, tolerance

pytestmark = pytest.mark.gpu

# every case runs on the default loop and on overlap=True (the module doc's "overlap")
OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["base", "ov"])


class Context:
    """A sequence's pages in a scattered pool, with q and o buffers of m_max rows (as
    test_prefill_attn_gpu.Context, on the wgmma launcher).  Slots past `filled` tokens and
    unused pages hold `stale`."""

    def __init__(self, cfg, filled, m_max, seed, stale=np.nan, **shape):
        from numba import cuda
        self.cfg, self.rng = cfg, np.random.default_rng(seed)
        need = -(-filled // PAGE)
        n_pages = need + 3
        pool = self.rng.standard_normal(pool_shape(cfg, n_pages)[1:]).astype(np.float16)
        table = np.full(need + 2, n_pages - 1, np.int32)   # mapped past the context: not read
        self.max_pos = table.shape[0] * PAGE
        table[:need] = self.rng.permutation(n_pages)[:need]
        self.k, self.v = gather_kv(pool, table, filled)
        pool[table[need - 1], :, :, filled - (need - 1) * PAGE:] = stale
        pool[np.setdiff1d(np.arange(n_pages), table[:need])] = stale
        self.q = cuda.device_array((m_max, cfg.num_heads, cfg.head_dim), np.float32)
        self.o = cuda.device_array((m_max, cfg.q_size), np.float16)
        self.launch = W.prefill_attention_launcher(cfg, self.q, cuda.to_device(pool),
                                                   cuda.to_device(table), self.o, **shape)

    def run_and_check(self, m, start, rows=None):
        cfg = self.cfg
        q = (self.rng.standard_normal((self.q.shape[0], cfg.num_heads, cfg.head_dim))
             * 2.0).astype(np.float32)
        self.q.copy_to_device(q)
        self.o.copy_to_device(np.full(self.o.shape, np.nan, np.float16))
        self.launch(m, start)
        got = self.o.copy_to_host()
        assert np.isnan(got[m:]).all(), "rows past m were written"
        assert np.isfinite(got[:m]).all(), "a NaN or inf reached o"
        kv_len = start + m
        rows = rows or checked_rows(m)
        ref = reference(q[:m], self.k[:kv_len], self.v[:kv_len], start, rows)
        err = np.abs(got[np.concatenate(rows)].astype(np.float64) - ref)
        tol = tolerance(ref, self.v[:kv_len])
        worst = np.unravel_index(np.argmax(err / tol), err.shape)
        assert (err <= tol).all(), (f"m={m} start={start}: |err| {err[worst]:.3g} > "
                                    f"{tol[worst]:.3g} at (row, col) {worst}")


@OVERLAP
@pytest.mark.parametrize("length", [1, 15, 16, 17, 255, 4097])
def test_7b_prompt_from_start_0(length, overlap):
    Context(CFGS["7b"], length, length + 2, seed=length,
            overlap=overlap).run_and_check(length, 0)


@OVERLAP
def test_7b_continued_context(overlap):
    ctx = Context(CFGS["7b"], 500, 300, seed=5, overlap=overlap)
    ctx.run_and_check(300, 0)
    ctx.run_and_check(200, 300)


@OVERLAP
@pytest.mark.parametrize("m,start", [(3, 2000), (40, 77), (16, 30000)])
def test_7b_short_chunk_at_depth(m, start, overlap):
    Context(CFGS["7b"], start + m, m, seed=m, overlap=overlap).run_and_check(m, start)


@OVERLAP
@pytest.mark.parametrize("m,start", [(2048, 6144), (2048, 30000)])
def test_7b_long_chunk_at_depth(m, start, overlap):
    """The 8K and 32K prompts' last chunks: ~50 and ~250 tiles a CTA through the ring.  Rows:
    the first, middle and last 36 (the first, a middle and the last CTAs; the reference of
    all 2048 rows over 32K keys would take minutes)."""
    rows = [range(36), range(m // 2 - 18, m // 2 + 18), range(m - 36, m)]
    Context(CFGS["7b"], start + m, m, seed=start, overlap=overlap).run_and_check(m, start, rows)


@OVERLAP
@pytest.mark.parametrize("stale", [np.inf, 6e4], ids=["inf", "big"])
def test_stale_slots_are_never_read(stale, overlap):
    Context(CFGS["7b"], 49, 49, seed=9, stale=stale, overlap=overlap).run_and_check(49, 0)


@OVERLAP
@pytest.mark.parametrize("name", ["0.5b-heads", "tiny", "g8", "g1"])
@pytest.mark.parametrize("m,start", [(17, 0), (70, 130)])
def test_gqa_shapes(name, m, start, overlap):
    Context(CFGS[name], start + m, m, seed=len(name) + m,
            overlap=overlap).run_and_check(m, start)


@OVERLAP
@pytest.mark.parametrize("shape", [dict(warpgroups=1), dict(bn=64), dict(bn=64, nstage=4),
                                   dict(warpgroups=1, bn=64, nstage=5)],
                         ids=["wg1", "bn64", "bn64-st4", "wg1-bn64-st5"])
def test_other_shapes(shape, overlap):
    ctx = Context(CFGS["7b"], 700, 400, seed=3, overlap=overlap, **shape)
    ctx.run_and_check(400, 300)


def test_launch_refuses_what_the_table_cannot_reach():
    ctx = Context(CFGS["tiny"], 40, 8, seed=0)
    for m, start in ((0, 0), (9, 0), (8, ctx.max_pos - 7), (1, -1)):
        with pytest.raises(ValueError, match="prefill attention"):
            ctx.launch(m, start)
