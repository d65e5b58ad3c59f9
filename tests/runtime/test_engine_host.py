"""The engine's host-side bookkeeping on a fake device (CPU, CI).

Device arrays are numpy arrays behind the few methods the engine calls; one "step" runs the
NumPy references of feed and argmax around a toy model whose next token is a fixed function
of (token, position): its "layers" leave (token, position) in the residual `x`, its "lm_head"
turns `x` into logits.  The batched prefill is the real Prefill.run chunk loop around a toy
chunk that leaves each token's (token, position) in its row of Prefill.x, so the engine's
head (lm_head and argmax on the last row) gives the logits the last token's step would.
What is checked is the engine's own logic: which step's output is the k-th generated token,
what the cache holds after a stop, prefill continuing a context, that reset() forgets the
last prompt, and that the batched path runs no full step for the prompt and ends in the
replay path's state.  The kernels themselves are tested on the GPU.
"""
import numpy as np
import pytest

import nq.runtime.engine as E
from nq.generate import generate
from nq.kernels.feed import feed_reference
from nq.paged import STATE_LEN, STATE_POS, STATE_STEP, STATE_TOKEN, pages_for
from nq.runtime.kv_cache import PageAllocator, Sequence
from nq.runtime.prefill import Prefill
from nq.sample import SamplingParams

GREEDY = SamplingParams(temperature=0.0, repeat_penalty=1.0)
VOCAB = 50
CHUNK = 4  # the fake prefill's chunk: the tests' prompts of 5 and more cross it


class Arr:
    def __init__(self, a):
        self.a = a

    def __getitem__(self, k):
        return Arr(self.a[k])

    def copy_to_device(self, h, stream=None):  # from the host, or another Arr (device to device)
        self.a[...] = np.asarray(getattr(h, "a", h)).reshape(self.a.shape)

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


class FakePrefill(Prefill):
    """Prefill's own run and last_row around a toy chunk: its tokens enter the cache, and row i
    of x holds (token, position) of the chunk's token i, as the layers would leave it for the
    toy model.  Rows past the chunk keep what an earlier chunk left there."""

    def __init__(self, e, chunk):
        self.eng, self.chunk, self.gemm = e, chunk, {}
        self.x = Arr(np.full((chunk, 2), -1, np.float32))  # (chunk, "hidden") residual rows
        self.chunks = []

    def _chunk(self, first, start, m, stream):
        self.chunks.append(m)
        for i in range(m):
            tok = int(self.eng.prompt.a[first + i])
            self.eng.cache[start + i] = tok
            self.x.a[i] = tok, start + i


@pytest.fixture(params=["replay", "batched"])
def engine(monkeypatch, request):
    return fake_engine(monkeypatch, request.param)


def fake_engine(monkeypatch, prefill, chunk=CHUNK):
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
    e.x = Arr(np.zeros(2, np.float32))  # the residual stream: (token, position) after "layers"
    e.graph, e.cache, e.pdl, e.startup = None, {}, True, {}
    e._ids, e.sampling, e.valid_vocab = np.full(max_len, -1, np.int32), None, VOCAB
    e.calls = {"layers": 0, "lm_head": 0}

    def model(st):  # feed, then "the layers": the token enters the cache, x its (token, pos)
        s = e.state.a
        feed_reference(e.prompt.a, e.feed_meta.a, s)
        tok, pos = int(s[STATE_TOKEN]), int(s[STATE_POS])
        e.cache[pos] = tok
        e.x.a[:] = tok, pos
        e.calls["layers"] += 1

    def lm_head(st):
        e.logits.a[:] = toy_logits(int(e.x.a[0]), int(e.x.a[1]))
        e.calls["lm_head"] += 1

    def argmax(st):
        s = e.state.a
        t = int(np.argmax(e.logits.a))
        e.out_ids.a[s[STATE_STEP] % max_len] = t
        s[STATE_TOKEN], s[STATE_POS], s[STATE_STEP] = t, s[STATE_POS] + 1, s[STATE_STEP] + 1
    e.steps = [("embed", model), ("lm_head", lm_head), ("sample", argmax)]
    # "batched": the whole prompt goes through Prefill.run, its last row through the head
    e.prefiller = FakePrefill(e, chunk) if prefill == "batched" else None
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


def test_a_batched_prompt_takes_no_full_step(engine):
    """The batched path runs the prompt's layers in the prefill and only lm_head and argmax for
    its last token (the head); the replay path one whole step a prompt token."""
    batched = engine.prefiller is not None
    prompt = [3, 4, 5, 6, 7]
    logits = engine.prefill(prompt)
    np.testing.assert_array_equal(logits, toy_logits(7, 4))
    assert engine.calls == ({"layers": 0, "lm_head": 1} if batched else
                            {"layers": 5, "lm_head": 5})
    engine.reset()
    engine.calls.update(layers=0, lm_head=0)
    assert list(engine.generate_ids(prompt, 4, GREEDY)) == reference(prompt, 4)
    # a step a generated token but the last, after the head or the prompt's 5 replays
    assert engine.calls == ({"layers": 3, "lm_head": 4} if batched else
                            {"layers": 5 + 3, "lm_head": 5 + 3})


@pytest.mark.parametrize("context", [[], [1, 2, 3, 4, 5, 6]], ids=["fresh", "after-7"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9, 13])
def test_batched_prefill_ends_as_the_replay(monkeypatch, n, context):
    """prefill(ids), fresh or after a context of 7 (6 prefilled, 1 decoded): the same logits,
    state, out_ids entry of the last prompt token's step, cache, length and id mirror on both
    paths.  Chunks of 4: a prompt of n > 4 takes its last row, (n - 1) % 4, from its last
    chunk; one of a token takes a replay on both."""
    prompt = [(5 * i + 3) % VOCAB for i in range(n)]
    ends = {}
    for mode in ("replay", "batched"):
        e = fake_engine(monkeypatch, mode)
        if context:
            e.decode(int(np.argmax(e.prefill(context))))
        start, calls = e.length, dict(e.calls)
        logits = e.prefill(prompt)
        np.testing.assert_array_equal(logits, toy_logits(prompt[-1], start + n - 1))
        ends[mode] = (logits, e.state.a.copy(), int(e.out_ids.a[n - 1]), dict(e.cache),
                      e.length, e._ids.copy())
        layers = e.calls["layers"] - calls["layers"]
        assert layers == (0 if mode == "batched" and n > 1 else n)
        if mode == "batched" and n > 1:
            want = [CHUNK] * ((n - 1) // CHUNK) + [(n - 1) % CHUNK + 1]
            assert e.prefiller.chunks[-len(want):] == want
    for a, b in zip(ends["replay"], ends["batched"]):
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b)
        else:
            assert a == b
    assert ends["batched"][4] == len(context) + bool(context) + n


def test_one_token_prompt_is_one_step(engine):
    """A prompt of one token is one replay on both paths (the prefill's launches would cost
    more than the step), then generation as usual."""
    got = list(engine.generate_ids([9], 3, GREEDY))
    assert got == reference([9], 3)
    assert engine.calls == {"layers": 3, "lm_head": 3}
    assert engine.length == 3 and engine.cache[0] == 9
