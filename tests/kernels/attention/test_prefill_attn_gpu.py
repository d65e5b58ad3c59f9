"""Causal prefill attention (nq/kernels/attention/prefill.py) on the GPU against the float64
reference, for the 7B head shape and the GQA extremes, chunks at start 0 and continuing a
context, with NaN in every slot the kernel must not read.

The reference is computed from the values the kernel multiplies: K and V as the fp16 pool holds
them and q as the fp16 fp16(q * log2(e)/sqrt(D)) it rounds on load (prefill.rounded_q; that
rounding moves o by up to ~2e-3 at these q scales, which is the input precision every fp16
flash attention has).  `tolerance` bounds what is left, element by element.
"""
import numpy as np
import pytest

from nq.config import PRESETS, tiny_config
from nq.kernels.attention import prefill
from nq.paged import PAGE, gather_kv, pool_shape

pytestmark = pytest.mark.gpu

CFGS = {"7b": PRESETS["7b"],                                             # G 7, d 128
        "0.5b-heads": tiny_config(head_dim=64, num_heads=14, num_kv_heads=2),   # G 7, d 64
        "tiny": tiny_config(),                                           # G 2, d 64
        "g8": tiny_config(head_dim=128, num_heads=8, num_kv_heads=1),    # G 8, d 128
        "g1": tiny_config(head_dim=64, num_heads=4, num_kv_heads=4)}     # MHA, d 64


def tolerance(ref, v):
    """Bound on |o - ref| per element; ref from rounded q and the fp16 K/V, v (n keys, kv heads,
    D) the values attended.  P is rounded to fp16 for the P V mma while l sums the fp32 p, so
    o = sum p (1 + d) v / sum p with |d| <= 2^-11 where p is a normal fp16 and an absolute
    2^-25 where it is subnormal (p < 2^-14; l >= 1, the row max's weight): <= 2^-11 max|v| +
    n 2^-25 max|v|.  fp32 accumulation over n/16 mma and n terms of l, and ex2.approx (2^-22
    relative), add ~n 2^-28 max|v|.  o's fp16 rounding: 2^-11 |o|.  Together under
    2^-11 (max|v| + |o|) + n 2^-24 max|v|; a wrong mask, page or stage moves o by ~|v|/n."""
    vmax = float(np.abs(np.asarray(v, np.float64)).max())
    return 2.0 ** -11 * (vmax + np.abs(ref)) + v.shape[0] * 2.0 ** -24 * vmax


def reference(q, k, v, start, rows):
    """prefill.prefill_attention_reference of the query rows in `rows` (a list of ranges), head
    by head: the float64 scores of all 4097 rows would be 28 x 4097^2 numbers (54 s here)."""
    m, hq, d = q.shape
    g = hq // k.shape[1]
    q = prefill.rounded_q(q, d)
    o = np.empty((sum(len(r) for r in rows), hq, d))
    i = 0
    for r in rows:
        for h in range(hq):
            o[i:i + len(r), h:h + 1] = prefill.prefill_attention_reference(
                q[r.start:r.stop, h:h + 1], k[:, h // g:h // g + 1], v[:, h // g:h // g + 1],
                start + r.start)
        i += len(r)
    return o.reshape(len(o), hq * d)


def checked_rows(m):
    """Every row up to 300; beyond, the first and last 128 and 64 from the middle (each CTA
    of 18 rows is independent, so these cover the first, middle and last CTAs and tiles)."""
    if m <= 300:
        return [range(m)]
    return [range(128), range(m // 2 - 32, m // 2 + 32), range(m - 128, m)]


class Context:
    """A sequence's pages in a scattered pool, with q and o buffers of m_max rows.  Slots past
    `filled` tokens and unused pages hold `stale` (NaN unless told)."""

    def __init__(self, cfg, filled, m_max, seed, stale=np.nan, warps=prefill.WARPS,
                 nstage=prefill.NSTAGE):
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
        self.launch = prefill.prefill_attention_launcher(
            cfg, self.q, cuda.to_device(pool), cuda.to_device(table), self.o, warps=warps,
            nstage=nstage)

    def run_and_check(self, m, start):
        """Fresh q rows for positions start..start+m-1, o poisoned, one launch; asserts the
        bound and that rows past m were not written."""
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
        rows = checked_rows(m)
        ref = reference(q[:m], self.k[:kv_len], self.v[:kv_len], start, rows)
        err = np.abs(got[np.concatenate(rows)].astype(np.float64) - ref)
        tol = tolerance(ref, self.v[:kv_len])
        worst = np.unravel_index(np.argmax(err / tol), err.shape)
        assert (err <= tol).all(), (f"m={m} start={start}: |err| {err[worst]:.3g} > "
                                    f"{tol[worst]:.3g} at (row, col) {worst}")


@pytest.mark.parametrize("length", [1, 15, 16, 17, 255, 4097])
def test_7b_prompt_from_start_0(length):
    Context(CFGS["7b"], length, length + 2, seed=length).run_and_check(length, 0)


def test_7b_continued_context():
    """A 300-token prompt, then a 200-token turn continuing it (start = 300): the pages of
    both chunks, read back by the second launch."""
    ctx = Context(CFGS["7b"], 500, 300, seed=5)
    ctx.run_and_check(300, 0)
    ctx.run_and_check(200, 300)


@pytest.mark.parametrize("m,start", [(3, 2000), (40, 77)])
def test_7b_short_chunk_at_depth(m, start):
    Context(CFGS["7b"], start + m, m, seed=m).run_and_check(m, start)


@pytest.mark.parametrize("stale", [np.inf, 6e4], ids=["inf", "big"])
def test_stale_slots_are_never_read(stale):
    Context(CFGS["7b"], 49, 49, seed=9, stale=stale).run_and_check(49, 0)


@pytest.mark.parametrize("name", ["0.5b-heads", "tiny", "g8", "g1"])
@pytest.mark.parametrize("m,start", [(17, 0), (70, 130)])
def test_gqa_shapes(name, m, start):
    Context(CFGS[name], start + m, m, seed=len(name) + m).run_and_check(m, start)


@pytest.mark.parametrize("warps,nstage", [(4, 2), (8, 4)])
def test_warps_and_stages(warps, nstage):
    ctx = Context(CFGS["7b"], 700, 400, seed=warps, warps=warps, nstage=nstage)
    ctx.run_and_check(400, 300)


def test_launch_refuses_what_the_table_cannot_reach():
    ctx = Context(CFGS["tiny"], 40, 8, seed=0)
    for m, start in ((0, 0), (9, 0), (8, ctx.max_pos - 7), (1, -1)):
        with pytest.raises(ValueError, match="prefill attention"):
            ctx.launch(m, start)
