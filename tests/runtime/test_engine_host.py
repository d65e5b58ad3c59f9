"""The engine's host-side bookkeeping on a fake device (CPU, CI).

Device arrays are numpy arrays behind the few methods the engine calls; one "step" runs the
NumPy references of feed and argmax around a toy model whose next token is a fixed function
of (token, position).  What is checked is the engine's own logic: which replay's output is
the k-th generated token, what the cache holds after a stop, prefill continuing a context,
and that reset() forgets the last prompt.  The kernels themselves are tested on the GPU.
"""
import numpy as np
import pytest

import nq.runtime.engine as E
from nq.generate import generate
from nq.kernels.feed import feed_reference
from nq.paged import STATE_LEN, STATE_POS, STATE_STEP, STATE_TOKEN, pages_for
from nq.runtime.kv_cache import PageAllocator, Sequence
from nq.sample import SamplingParams

GREEDY = SamplingParams(temperature=0.0, repeat_penalty=1.0)
VOCAB = 50


class Arr:
    def __init__(self, a):
        self.a = a

    def __getitem__(self, k):
        return Arr(self.a[k])

    def copy_to_device(self, h, stream=None):
        self.a[...] = np.asarray(h).reshape(self.a.shape)

    def copy_to_host(self, out=None, stream=None):
        if out is None:
            return self.a.copy()
        out[...] = self.a


class Event:
    def record(self, stream):
        pass

    def synchronize(self):
        pass


class Stream:
    def synchronize(self):
        pass


def toy_next(tok, pos):
    return (tok * 7 + pos) % VOCAB


class FakePrefill:
    """The batched prefill's effect on the toy model: the prompt tokens enter the cache."""

    def __init__(self, e):
        self.e = e

    def run(self, first, start, n, stream):
        for i in range(n):
            self.e.cache[start + i] = int(self.e.prompt.a[first + i])


@pytest.fixture(params=["replay", "batched"])
def engine(monkeypatch, request):
    from numba import cuda
    monkeypatch.setattr(cuda, "event", lambda timing=False: Event())
    max_len = 64
    e = E.Engine.__new__(E.Engine)  # no GPU: the fields __init__ would allocate, as numpy
    e.max_len, e.stream = max_len, Stream()
    e.alloc = PageAllocator(pages_for(max_len) + 1)
    e.seq = Sequence(max_pages=pages_for(max_len))
    e.d_table = Arr(np.zeros(e.seq.max_pages, np.int32))
    e.state = Arr(np.zeros(STATE_LEN, np.int32))
    e.out_ids, e.prompt = Arr(np.zeros(max_len, np.int32)), Arr(np.zeros(max_len, np.int32))
    e.feed_meta, e.logits = Arr(np.zeros(2, np.int32)), Arr(np.zeros(VOCAB, np.float32))
    e._h_state, e._h_tok = np.zeros(STATE_LEN, np.int32), np.zeros(2, np.int32)
    e.graph, e.cache, e.pdl, e.startup = None, {}, True, {}
    e._ids, e.sampling, e.valid_vocab = np.full(max_len, -1, np.int32), None, VOCAB

    def model(st):  # feed, then "the model": logits of (token, position)
        s = e.state.a
        feed_reference(e.prompt.a, e.feed_meta.a, s)
        tok, pos = int(s[STATE_TOKEN]), int(s[STATE_POS])
        e.cache[pos] = tok
        e.logits.a[:] = toy_logits(tok, pos)

    def argmax(st):
        s = e.state.a
        t = int(np.argmax(e.logits.a))
        e.out_ids.a[s[STATE_STEP] % max_len] = t
        s[STATE_TOKEN], s[STATE_POS], s[STATE_STEP] = t, s[STATE_POS] + 1, s[STATE_STEP] + 1
    e.steps = [("embed", model), ("sample", argmax)]
    # "batched": all but the last prompt token go through Prefill.run, the last through a step
    e.prefiller = FakePrefill(e) if request.param == "batched" else None
    e.reset()
    return e


def toy_logits(tok, pos):
    """Argmax is toy_next; a gentle slope under it, so penalties and draws have something
    to choose between."""
    x = np.linspace(0.0, 1.5, VOCAB, dtype=np.float32)
    x[toy_next(tok, pos)] = 3.0
    return x


def reference(context, n):
    seq, out = list(context), []
    t = toy_next(seq[-1], len(seq) - 1)
    for _ in range(n):
        out.append(t)
        seq.append(t)
        t = toy_next(t, len(seq) - 1)
    return out


def test_greedy_ids_and_cache_length(engine):
    got = list(engine.generate_ids([3, 4, 5], 6, GREEDY))
    assert got == reference([3, 4, 5], 6)
    assert engine.length == 3 + 6 - 1  # the last token is returned, not yet fed
    assert [engine.cache[p] for p in range(8)] == [3, 4, 5] + got[:5]


def test_stop_id_books_the_cache(engine):
    want = reference([3, 4, 5], 6)
    out, stats = generate(engine, [3, 4, 5], 6, GREEDY, stop_ids=[want[2]])
    assert out == want[:3] and stats.stop_reason == "eos"
    assert engine.length == 3 + 3 - 1


def test_a_second_prompt_continues_the_context(engine):
    first = list(engine.generate_ids([3, 4, 5], 4, GREEDY))
    second = list(engine.generate_ids([9], 3, GREEDY))
    assert second == reference([3, 4, 5] + first[:-1] + [9], 3)




def test_reset_forgets_the_last_prompt(engine):
    list(engine.generate_ids([3, 4, 5], 2, GREEDY))
    engine.reset()
    engine.decode(9)
    assert engine.cache[0] == 9


def test_truncate_then_continue(engine):
    first = list(engine.generate_ids([3, 4, 5, 6, 7], 3, GREEDY))
    assert engine.length == 5 + 3 - 1
    engine.truncate(4)  # keep [3, 4, 5, 6]; position 4 onwards is rewritten
    got = list(engine.generate_ids([8, 9], 3, GREEDY))
    assert got == reference([3, 4, 5, 6, 8, 9], 3) and first
    assert [engine.cache[p] for p in range(6)] == [3, 4, 5, 6, 8, 9]
