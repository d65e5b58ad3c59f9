"""The GPU engine's snapshot()/restore() (nq/runtime/kv_snapshot.py) on the CPU: the page copies
by logical position (numpy pools and the CUDA simulator's device arrays), the recycled host
buffers and their bound, and the engine's own methods driven by nq serve's PromptCache on a fake
device whose toy model reads its whole context through the block table and the KV pages -- so
a page restored to the wrong place, or a length off by one, changes the tokens."""
import types

import numpy as np
import pytest

import nq.runtime.engine as E
from nq.generate import generate
from nq.kernels.feed import feed_reference
from nq.paged import PAGE, STATE_LEN, STATE_POS, STATE_STEP, STATE_TOKEN, gather_kv, pages_for
from nq.runtime import kv_snapshot as K
from nq.runtime.kv_cache import PageAllocator, Sequence
from nq.sample import SamplingParams
from nq.serve.prompt_cache import PromptCache
from test_engine_host import Arr  # the fake device array

GREEDY = SamplingParams(temperature=0.0, repeat_penalty=1.0)
VOCAB = 97


def test_page_runs():
    assert K.page_runs([]) == []
    assert K.page_runs([4, 5, 6, 0, 1, 9]) == [(0, 4, 3), (3, 0, 2), (5, 9, 1)]
    assert K.page_runs([3, 2]) == [(0, 3, 1), (1, 2, 1)]


def test_save_then_load_into_other_pages_keeps_every_token():
    rng = np.random.default_rng(0)
    shape = (3, 12, 2, 2, PAGE, 8)  # (L, n_pages, Hkv, 2, PAGE, D)
    pool = rng.standard_normal(shape).astype(np.float16)
    src, dst, length = [7, 8, 2, 3, 4, 11], [0, 1, 5, 9, 10, 6], 83
    buffers = K.HostBuffers((3, 6) + shape[2:], pinned=False)
    snap = K.save(Arr(pool), src, length, buffers, None)
    assert snap.length == length and snap.nbytes == 3 * pages_for(length) * int(np.prod(shape[2:])) * 2
    pool[:, src] = 0  # the live sequence is overwritten after the copy was taken
    other = np.zeros(shape, np.float16)
    K.load(snap, Arr(other), dst, None)
    ref = np.random.default_rng(0).standard_normal(shape).astype(np.float16)
    for layer in range(3):
        got = gather_kv(other[layer], np.array(dst), length)
        want = gather_kv(ref[layer], np.array(src), length)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    with pytest.raises(ValueError, match="pages reserved"):
        K.load(snap, Arr(other), dst[:3], None)


def test_host_buffers_are_recycled_and_bounded():
    b = K.HostBuffers((1, 2, 1, 2, PAGE, 4), limit=2, pinned=False)
    x, y = b.take(), b.take()
    with pytest.raises(K.SnapshotLimit, match="discard one"):
        b.take()
    b.give(x)
    assert b.take() is x and b.count == 2 and b.buffer_bytes == 2 * 2 * PAGE * 4 * 2
    del y


SIM = """
import numpy as np
from numba import cuda
from nq.runtime import kv_snapshot as K
s = cuda.stream()
pool = np.random.default_rng(0).standard_normal((2, 8, 2, 2, 16, 4)).astype(np.float16)
kv, other = cuda.to_device(pool, stream=s), cuda.to_device(np.zeros_like(pool), stream=s)
snap = K.save(kv, [5, 6, 2, 3], 50, K.HostBuffers((2, 6, 2, 2, 16, 4)), s)
K.load(snap, other, [0, 1, 7, 4], s)
s.synchronize()
print("same", int((other.copy_to_host()[:, [0, 1, 7, 4]] == pool[:, [5, 6, 2, 3]]).all()))
"""


def test_save_and_load_with_the_simulators_device_arrays():
    """numba's own slicing, pinned buffers and stream copies (the calls the GPU makes), under
    the simulator."""
    from ptx_util import run_under_simulator
    values, _ = run_under_simulator(SIM, timeout=300)
    assert values == {"same": 1.0}


# ---- the engine's methods, on a fake device ---------------------------------------------------
def toy_next(pool, table, pos):
    """The toy model: the next token is a hash of every K/V value of positions 0..pos, read
    through the block table, as attention reads them."""
    k, v = gather_kv(pool[0], table, pos + 1)
    w = np.arange(1, pos + 2, dtype=np.int64)
    return int((w @ k[:, 0, 0].astype(np.int64) * 31 + w @ v[:, 0, 1].astype(np.int64)) % VOCAB)


def fake_engine(max_len=96):
    e = E.Engine.__new__(E.Engine)  # no GPU: the fields __init__ would allocate, as numpy
    e.cfg = types.SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=2)
    e.max_len, e.stream = max_len, types.SimpleNamespace(synchronize=lambda: None)
    e.n_pages = pages_for(max_len) + 1
    e.alloc = PageAllocator(e.n_pages)
    e.seq = Sequence(max_pages=pages_for(max_len))
    e.kv = Arr(np.zeros((2, e.n_pages, 1, 2, PAGE, 2), np.float16))
    e.d_table = Arr(np.zeros(e.seq.max_pages, np.int32))
    e.state = Arr(np.zeros(STATE_LEN, np.int32))
    e.out_ids, e.prompt = Arr(np.zeros(max_len, np.int32)), Arr(np.zeros(max_len, np.int32))
    e.feed_meta, e.logits = Arr(np.zeros(2, np.int32)), Arr(np.zeros(VOCAB, np.float32))
    e._h_state, e._h_tok = np.zeros(STATE_LEN, np.int32), np.zeros(2, np.int32)
    e.graph, e.prefiller = None, None
    e._ids, e.sampling, e.valid_vocab = np.full(max_len, -1, np.int32), None, VOCAB

    def run_eager(regions=None):  # feed, "rope_kv" (token and position into the page), model
        s, pool, table = e.state.a, e.kv.a, e.d_table.a
        feed_reference(e.prompt.a, e.feed_meta.a, s)
        tok, pos = int(s[STATE_TOKEN]), int(s[STATE_POS])
        page, slot = int(table[pos // PAGE]), pos % PAGE
        pool[:, page, 0, 0, slot, 0] = tok
        pool[:, page, 0, 1, slot, 1] = (tok * 3 + pos) % 251
        t = toy_next(pool, table, pos)
        e.logits.a[:] = 0
        e.logits.a[t] = 1
        e.out_ids.a[s[STATE_STEP] % max_len] = t
        s[STATE_TOKEN], s[STATE_POS], s[STATE_STEP] = t, pos + 1, s[STATE_STEP] + 1
    e.run_eager = run_eager
    e.reset()
    return e


@pytest.fixture
def no_events(monkeypatch):
    from numba import cuda
    ev = types.SimpleNamespace(record=lambda stream: None, synchronize=lambda: None)
    monkeypatch.setattr(cuda, "event", lambda timing=False: ev)


def test_engine_restore_continues_exactly(no_events):
    eng, fresh = fake_engine(), fake_engine()
    eng.keep_snapshots(2)
    eng._snapshots.pinned = False
    a = list(eng.generate_ids([5, 6, 7, 8, 9] * 4, 7, GREEDY))
    snap = eng.snapshot()
    list(eng.generate_ids([1, 2, 3], 30, GREEDY))  # more tokens, over the same pages
    eng.reset()
    eng.alloc.alloc(2)  # the restored sequence gets other page ids than it was saved from
    eng.restore(snap)
    assert eng.length == 20 + 7 - 1 and eng.seq.pages[0] != 0
    # the host mirror of the cache ids (the sampler's penalty history is rebuilt from it)
    assert list(eng._ids[:eng.length]) == [5, 6, 7, 8, 9] * 4 + a[:6]
    assert (eng._ids[eng.length:] == -1).all()
    got = list(eng.generate_ids([4, 4], 12, GREEDY))
    list(fresh.generate_ids([5, 6, 7, 8, 9] * 4, 7, GREEDY))
    assert got == list(fresh.generate_ids([4, 4], 12, GREEDY))
    assert a and got != list(fake_engine().generate_ids([4, 4], 12, GREEDY))  # the context counts
    eng.discard(snap)
    assert eng._snapshots.free == [snap.host]


def test_prompt_cache_on_the_engine_keeps_k_minus_one_conversations(no_events):
    """Three conversations taking turns with --cache-slots 3: each new turn finds its prefix
    (in the live cache or a saved copy), answers as a fresh engine would, and no more than K
    host buffers are ever made."""
    eng = fake_engine()
    cache = PromptCache(eng, slots=3)
    eng._snapshots.pinned = False
    assert cache.pinned_bytes == 3 * 2 * pages_for(96) * 2 * PAGE * 2 * 2
    rng = np.random.default_rng(1)
    talks = {c: [int(t) for t in rng.integers(0, VOCAB, 9)] for c in "abc"}
    for turn in range(4):
        for c in "abc":
            ids = talks[c]
            kept = cache.prepare(ids)
            if turn:
                assert kept == len(ids) - 2, (turn, c)
            out, _ = generate(eng, ids[kept:], 3, GREEDY, keep_context=True)
            cache.hold(ids + out[:-1])
            want, _ = generate(fake_engine(), ids, 3, GREEDY)
            assert out == want, (turn, c)
            talks[c] = ids + out + [int(rng.integers(0, VOCAB))]
            assert len(cache.saved) <= 2 and eng._snapshots.count <= 3
    assert eng.length == len(cache.ids)


def test_no_free_host_buffer_skips_the_copy_not_the_request(no_events, capsys):
    eng = fake_engine()
    cache = PromptCache(eng, slots=2)
    eng._snapshots.limit = 0  # as if every buffer were held
    for ids in ([1, 2, 3, 4], [9, 8, 7, 6]):
        kept = cache.prepare(ids)
        out, _ = generate(eng, ids[kept:], 3, GREEDY, keep_context=True)
        cache.hold(ids + out[:-1])
        assert out == generate(fake_engine(), ids, 3, GREEDY)[0]
    assert cache.saved == [] and "prompt cache copy not kept" in capsys.readouterr().err
