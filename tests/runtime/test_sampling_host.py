"""The sampled decode path's host logic on the fake device of test_engine_host.py (CPU, CI).

The device sampler is replaced by `FakeSampler`: its history (ctx by position, a length) obeys
the kernels' rules (a step enters its input token only at pos == length; the history methods
set the length), and its draw is the NumPy reference of the kernels (nq/kernels/sampler/
reference.py) over the same context.  So what is checked is the engine's side: which graph a
setting picks, the parameter block, the history after prompts, stops, truncate and reset (it
must equal a fresh engine's fed the same ids), and seeded tokens.
"""
import numpy as np
import pytest

from nq.generate import generate
from nq.kernels.sampler import pack_params, sample_reference
from nq.kernels.sampler.params import P_SEED_HI, P_SEED_LO, P_TOP_K, P_WINDOW, unpack_params
from nq.kernels.sampler.reference import history_counts
from nq.paged import STATE_POS, STATE_STEP, STATE_TOKEN
from nq.runtime.sampling import DeviceSampling, needs_device_sampler, pack_sampling
from nq.sample import SamplingParams
from test_engine_host import GREEDY, VOCAB, engine, reference, toy_logits  # noqa: F401

SAMPLED = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.0, repeat_penalty=1.6,
                         repeat_last_n=-1, seed=11)
WINDOWED = SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=2.0,
                          repeat_last_n=3, presence_penalty=0.5, frequency_penalty=0.25, seed=5)


class FakeSampler:
    """The device Sampler's interface over numpy, with the kernels' history rules."""

    def __init__(self, ring):
        self.ring, self.valid = ring, VOCAB
        self.ctx, self.length = np.full(ring, -1, np.int32), 0
        self.block = self.pack()
        self.launches = self.uploads = 0

    def pack(self, **kw):
        return pack_params(valid_vocab=self.valid, max_top_k=64, history_cap=self.ring, **kw)

    def set_params(self, block, stream=0):
        self.block = np.array(block)
        self.uploads += 1

    def launch(self, logits, state, out_ids, stream=0):
        self.launches += 1
        s = state.a
        tok, pos, step = int(s[STATE_TOKEN]), int(s[STATE_POS]), int(s[STATE_STEP])
        if pos == self.length:  # the step enters its input token once
            self.ctx[pos] = tok
            self.length = pos + 1
        assert self.length == pos + 1, "the history must reach the step's position"
        t, _ = sample_reference(logits.a, self.ctx[: pos + 1], self.block, step, self.valid)
        out_ids.a[step % out_ids.a.size] = t
        s[STATE_TOKEN], s[STATE_POS], s[STATE_STEP] = t, pos + 1, step + 1

    def reset(self, stream=0):
        self.ctx[:], self.length = -1, 0

    def append_history(self, ids, start, stream=0):
        ids = np.asarray(getattr(ids, "a", ids))
        self.ctx[start: start + ids.size] = ids
        self.length = start + ids.size

    def truncate_history(self, n, stream=0):
        self.length = int(n)

    def counts(self):
        return history_counts(self.ctx[: self.length], int(self.block[P_WINDOW]), VOCAB)


@pytest.fixture
def eng(engine):  # noqa: F811
    engine.sampling = DeviceSampling(engine, FakeSampler(engine.max_len))
    return engine


def sampled_reference(context, prompt_len, n, block):
    """The tokens the sampled path must give: the reference draw over the context, step by
    step; the first draw is at step prompt_len - 1 (the engine's step numbering)."""
    ctx, out = list(context), []
    for k in range(n):
        t, _ = sample_reference(toy_logits(ctx[-1], len(ctx) - 1), np.array(ctx), block,
                                prompt_len - 1 + k, VOCAB)
        out.append(t)
        ctx.append(t)
    return out


def assert_history_is(eng, ids):
    """The device history equals a fresh engine's fed exactly `ids`."""
    fake = eng.sampling.sampler
    assert eng.sampling.hist_n == fake.length == len(ids) == eng.length
    np.testing.assert_array_equal(fake.ctx[: fake.length], ids)
    window = int(fake.block[P_WINDOW])
    np.testing.assert_array_equal(fake.counts(), history_counts(ids, window, VOCAB))


def test_wiring_per_params():
    assert not needs_device_sampler(GREEDY)
    for kw in (dict(temperature=0.7), dict(repeat_penalty=1.05), dict(presence_penalty=0.1),
               dict(frequency_penalty=-0.1)):
        assert needs_device_sampler(SamplingParams(**{"temperature": 0.0, **kw}))


def test_param_block():
    fake = FakeSampler(64)
    b = pack_sampling(SAMPLED, fake.pack, 64)
    got = unpack_params(b)
    assert got["top_k"] == 20 and got["window"] == -1 and got["seed_lo"] == 11
    assert np.isclose(got["temperature"], 0.9) and np.isclose(got["repeat"], 1.6)
    # top_k <= 0 (serve's -1) is off; a window longer than the context is the whole context
    b = pack_sampling(SamplingParams(top_k=-1, repeat_penalty=1.1, repeat_last_n=500, seed=1),
                      fake.pack, 64)
    assert b[P_TOP_K] == 0 and b[P_WINDOW] == -1
    # no penalty at all: no history is counted
    assert pack_sampling(SamplingParams(repeat_penalty=1.0, seed=1), fake.pack, 64)[P_WINDOW] == 0
    # greedy with a penalty: top-k 1 over the penalised logits
    assert pack_sampling(SamplingParams(temperature=0, repeat_penalty=1.3, seed=1),
                         fake.pack, 64)[P_TOP_K] == 1
    # seed None: a fresh 64-bit key each time
    a = pack_sampling(SamplingParams(seed=None), fake.pack, 64)
    c = pack_sampling(SamplingParams(seed=None), fake.pack, 64)
    assert (a[P_SEED_LO], a[P_SEED_HI]) != (c[P_SEED_LO], c[P_SEED_HI])
    big = lambda **kw: pack_params(valid_vocab=1000, max_top_k=64, history_cap=64, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="capacity"):
        pack_sampling(SamplingParams(top_k=65, seed=1), big, 64)


def test_greedy_keeps_the_argmax_graph(eng):
    assert list(eng.generate_ids([3, 4, 5], 6, GREEDY)) == reference([3, 4, 5], 6)
    assert eng.sampling.sampler.launches == 0


@pytest.mark.parametrize("params", [SAMPLED, WINDOWED], ids=["whole", "window"])
def test_sampled_tokens_and_history(eng, params):
    block = pack_sampling(params, eng.sampling.sampler.pack, eng.max_len)
    prompt = [3, 4, 5, 6]
    got = list(eng.generate_ids(prompt, 7, params))
    assert got == sampled_reference(prompt, len(prompt), 7, block)
    assert got != reference(prompt, 7)  # the penalties and draws changed something
    assert_history_is(eng, prompt + got[:-1])
    # the same seed and prompt again: the same tokens; parameters uploaded once
    eng.reset()
    assert_history_is(eng, [])
    assert list(eng.generate_ids(prompt, 7, params)) == got
    assert eng.sampling.sampler.uploads == 1


def test_stop_truncate_and_reset_give_a_fresh_engines_history(eng):
    prompt = [3, 4, 5, 6, 7]
    want = list(eng.generate_ids(prompt, 8, SAMPLED))
    eng.reset()
    out, stats = generate(eng, prompt, 8, SAMPLED, stop_ids=[want[3]])
    assert out == want[:4] and stats.stop_reason == "eos"
    # the graph ran one step past the stop and entered want[3]: the cache does not keep it
    assert_history_is(eng, prompt + want[:3])
    eng.truncate(6)
    assert_history_is(eng, prompt + want[:1])
    # continuing after truncate samples as a fresh engine fed the same ids would
    ctx = prompt + want[:1]
    block = pack_sampling(SAMPLED, eng.sampling.sampler.pack, eng.max_len)
    got = list(eng.generate_ids([9, 2], 5, SAMPLED))
    assert got == sampled_reference(ctx + [9, 2], 2, 5, block)
    assert_history_is(eng, ctx + [9, 2] + got[:-1])


def test_greedy_turns_between_sampled_ones_are_caught_up(eng):
    """A greedy turn does not run the sampler; the next sampled turn uploads what it added."""
    first = list(eng.generate_ids([3, 4, 5], 4, GREEDY))
    second = list(eng.generate_ids([8], 5, WINDOWED))
    ctx = [3, 4, 5] + first[:-1] + [8]
    block = pack_sampling(WINDOWED, eng.sampling.sampler.pack, eng.max_len)
    assert second == sampled_reference(ctx, 1, 5, block)
    assert_history_is(eng, ctx + second[:-1])
    eng.decode(second[-1])  # the host-sampled interface feeds a token too
    third = list(eng.generate_ids([1, 2], 3, WINDOWED))
    ctx = ctx + second + [1, 2]
    assert third == sampled_reference(ctx, 2, 3, block)


def test_a_new_window_changes_nothing_but_the_counts(eng):
    list(eng.generate_ids([3, 4, 5, 6], 4, SAMPLED))
    ids = list(eng._ids[: eng.length])
    list(eng.generate_ids([7], 1, WINDOWED))  # set_params with another window, one token
    assert_history_is(eng, ids + [7])


def test_chat_and_serve_controls_reach_the_device_params():
    """`/set presence-penalty` in chat and a request's presence/frequency penalties in serve land
    in SamplingParams, hence in the device block (no host wrapper samples them any more)."""
    from nq.chat import parse_set
    from nq.serve.params import sampling
    p = parse_set(SamplingParams(temperature=0.0, repeat_penalty=1.0), "presence-penalty 0.5")
    assert p.presence_penalty == 0.5 and needs_device_sampler(p)
    p = parse_set(p, "frequency-penalty -0.25")
    block = unpack_params(pack_sampling(p, FakeSampler(64).pack, 64))
    assert np.isclose(block["presence"], 0.5) and np.isclose(block["frequency"], -0.25)
    assert block["top_k"] == 1 and block["window"] == 64  # greedy over the penalised logits
    params, presence, frequency = sampling({"temperature": 0, "presence_penalty": 1.5,
                                            "frequency_penalty": 0.5}, {})
    assert (params.presence_penalty, params.frequency_penalty) == (1.5, 0.5) == (presence,
                                                                                frequency)
    assert needs_device_sampler(params)


def test_the_sampled_head_after_a_batched_prefill(eng):
    """The last prompt token's sampled step is the head on the batched path (lm_head and the
    sampler on the prefill's last row, no layers): the same tokens and history as the replays,
    one sampler launch a generated token."""
    batched = eng.prefiller is not None
    block = pack_sampling(SAMPLED, eng.sampling.sampler.pack, eng.max_len)
    prompt = [3, 4, 5, 6, 7, 8]
    got = list(eng.generate_ids(prompt, 5, SAMPLED))
    assert got == sampled_reference(prompt, len(prompt), 5, block)
    assert eng.sampling.sampler.launches == 5
    assert eng.calls["layers"] == (4 if batched else 5 + 5)
    assert_history_is(eng, prompt + got[:-1])
