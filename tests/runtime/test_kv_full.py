"""Running out of KV pages: a clear KVCacheFull, and nothing changed by the refused request.

The allocator and reserve() refuse a request they cannot meet whole, taking nothing; the
engine (on test_engine_host.py's fake device) refuses a prompt + generation that outgrows
its context or its page pool before it uploads or runs anything, so the context it had is
intact and the next request's tokens are the reference's.
"""
import numpy as np
import pytest

from nq.generate import generate
from nq.paged import PAGE
from nq.runtime.kv_cache import KVCacheFull, PageAllocator, Sequence, release, reserve
import test_engine_host
from test_engine_host import GREEDY, reference

engine = test_engine_host.engine     # the fake-device fixture, both prompt paths


def test_allocator_refuses_whole_and_recovers():
    a = PageAllocator(5)
    got = a.alloc(5)
    with pytest.raises(KVCacheFull, match=r"KV cache full: 5 pages of 16 tokens in use, 0 free, "
                                          r"1 more needed \(pool of 5 pages = 80 tokens\); raise -c"):
        a.alloc(1)
    a.free(got[:2])
    with pytest.raises(KVCacheFull, match="2 free, 3 more needed"):
        a.alloc(3)
    assert a.n_free == 2 and a.n_used == 3          # the refused request took nothing
    assert sorted(a.alloc(2) + got[2:]) == list(range(5))
    with pytest.raises(ValueError, match="double free"):
        a.free([got[2], got[2]])


def test_reserve_refuses_whole():
    a = PageAllocator(3)
    s = Sequence(max_pages=8)
    reserve(a, s, 2 * PAGE)
    before = (list(s.pages), s.table.copy(), a.n_free)
    with pytest.raises(KVCacheFull, match="1 free, 2 more needed"):
        reserve(a, s, 4 * PAGE)                      # the pool, not the table, is short
    with pytest.raises(KVCacheFull, match=r"a sequence of 129 tokens needs 9 pages of 16, the "
                                          r"block table holds 8; raise -c"):
        reserve(a, s, 8 * PAGE + 1)
    assert s.pages == before[0] and np.array_equal(s.table, before[1]) and a.n_free == before[2]
    release(a, s)
    assert a.n_free == 3


def _snapshot(e):
    return (e.length, list(e.seq.pages), e.seq.table.copy(), e.alloc.n_free,
            e.feed_meta.a.copy(), e.state.a.copy())


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def test_engine_refuses_a_context_over_max_len(engine):
    first = list(engine.generate_ids([3, 4, 5], 4, GREEDY))
    before = _snapshot(engine)
    # the prompt alone fits (6 + 20 tokens), the generation does not (+ 50)
    with pytest.raises(KVCacheFull, match=r"context of 76 tokens exceeds this engine's 64; raise -c"):
        list(engine.generate_ids(list(range(1, 21)), 50, GREEDY))
    assert _same(_snapshot(engine), before)
    # the context survived: a decode continues it, and fed token 9 is what the cache holds
    engine.decode(9)
    assert engine.cache[engine.length - 1] == 9
    got = list(engine.generate_ids([11], 3, GREEDY))
    assert got == reference([3, 4, 5] + first[:-1] + [9, 11], 3)


def test_engine_refuses_when_the_pool_runs_out(engine):
    engine.alloc = PageAllocator(2)                  # a pool smaller than the block table
    engine.reset()
    with pytest.raises(KVCacheFull, match=r"KV cache full: 0 pages of 16 tokens in use, 2 free, "
                                          r"3 more needed .*raise -c"):
        generate(engine, list(range(1, 30)), 10, GREEDY)
    assert engine.length == 0 and engine.alloc.n_free == 2 and engine.seq.pages == []
    out, stats = generate(engine, [3, 4, 5], 6, GREEDY)   # what fits still runs, exactly
    assert out == reference([3, 4, 5], 6) and stats.stop_reason == "length"
    assert engine.alloc.n_used == len(engine.seq.pages) == 1


def test_numpy_backend_refuses_a_prompt_whole(tiny_cfg):
    """The reference backend prefills in chunks; a prompt that does not fit is refused before
    the first chunk, so the cache keeps exactly what it had."""
    from nq.ref import NumpyBackend, RefModel, random_weights
    b = NumpyBackend(RefModel(tiny_cfg, random_weights(tiny_cfg), max_len=16), chunk=4)
    want = b.prefill(np.arange(1, 11))
    with pytest.raises(ValueError, match=r"KV cache full: 10 cached \+ 10 new tokens exceeds "
                                         r"max_len=16"):
        b.prefill(np.arange(1, 11))
    assert b.length == 10
    b.truncate(9)
    assert np.allclose(b.prefill([10]), want, atol=1e-5)   # the cached rows are untouched
