"""The device sampler on the GPU at Qwen2.5's vocabulary: tokens equal to the NumPy reference
for many (seed, step), greedy equal to argmax, seeds reproducible in a graph, chi-square of the
draws against the filtered softmax per control, and the penalty history on the right ids."""
import numpy as np
import pytest

from nq.kernels.sampler import Sampler, filtered_distribution, sample_reference
from nq.kernels.sampler.reference import history_counts, penalize
from nq.kernels.sampler.params import unpack_params
from nq.paged import STATE_LEN, STATE_POS, STATE_STEP, STATE_TOKEN

pytestmark = pytest.mark.gpu

V, VALID = 152064, 151665   # Qwen2.5: lm_head rows, tokenizer size


@pytest.fixture(scope="module")
def sampler():
    return Sampler(V, VALID, max_len=4096)


def lm_like_logits(seed, peak=60, spread=3.0):
    """A long tail around 0 and `peak` tokens well above it (what an LM head gives), with the
    padded rows set high so that choosing one would show."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(V).astype(np.float32) * np.float32(spread)
    hot = rng.choice(VALID, peak, replace=False)
    x[hot] += np.float32(10) + rng.standard_normal(peak).astype(np.float32) * 2
    x[VALID:] = 1e4
    return x


def run_step(s, d_logits, ctx, step, ring=64):
    """One eager launch with context ctx (the input token last) seeded; returns the token."""
    from numba import cuda
    s.reset()
    s.seed_history(ctx[:-1])
    st = np.zeros(STATE_LEN, np.int32)
    st[STATE_TOKEN], st[STATE_POS], st[STATE_STEP] = ctx[-1], len(ctx) - 1, step
    d_state = cuda.to_device(st)
    out = cuda.to_device(np.full(ring, -1, np.int32))
    s.launch(d_logits, d_state, out)
    got = d_state.copy_to_host()
    assert got[STATE_POS] == len(ctx) and got[STATE_STEP] == step + 1
    assert out.copy_to_host()[step % ring] == got[STATE_TOKEN]
    return int(got[STATE_TOKEN])


CONTROLS = {
    "qwen_defaults": dict(temperature=0.7, top_k=20, top_p=0.8, repeat_penalty=1.05),
    "top_p_only": dict(top_k=0, top_p=0.95, temperature=1.0),
    "min_p": dict(top_k=0, top_p=1.0, min_p=0.02, temperature=1.3),
    "top_k_big": dict(top_k=1000, top_p=1.0, temperature=1.0),
    "nothing_cut": dict(top_k=0, top_p=1.0, temperature=1.0),
    "penalties_window": dict(top_k=40, top_p=0.9, repeat_penalty=1.3, presence_penalty=0.4,
                             frequency_penalty=0.3, repeat_last_n=8),
}


@pytest.mark.parametrize("control", list(CONTROLS))
def test_tokens_equal_reference(sampler, control):
    """Many (seed, step): the kernel's token is the reference's, except where the reference
    itself says the fp32 libm difference could flip it (score gap or top-p cut within ~1e-5)."""
    from numba import cuda
    rng = np.random.default_rng(7)
    mismatches = []
    n = 40
    for t in range(n):
        logits = lm_like_logits(100 + t)
        ctx = [int(i) for i in rng.integers(0, VALID, 12)]
        ctx += [ctx[3], ctx[3]]                       # repeats for the penalties
        prm = sampler.pack(seed=int(rng.integers(2**63)), **CONTROLS[control])
        sampler.set_params(prm)
        step = int(rng.integers(0, 10_000))
        got = run_step(sampler, cuda.to_device(logits), ctx, step)
        want, info = sample_reference(logits, ctx, prm, step, VALID)
        assert got < VALID
        if got != want:
            mismatches.append((t, got, want, info["margin"], info["p_margin"]))
            assert info["margin"] < 1e-4 or info["p_margin"] < 1e-5, mismatches
    assert len(mismatches) <= 1, mismatches


def test_greedy_is_argmax_with_ties(sampler):
    from numba import cuda
    logits = lm_like_logits(3)
    logits[[500, 77, 90000]] = 50.0                   # a three-way tie: the lowest id wins
    sampler.set_params(sampler.pack(temperature=0, repeat_penalty=1.0))
    got = run_step(sampler, cuda.to_device(logits), [1, 2, 3], 11)
    assert got == 77 == int(np.argmax(logits[:VALID]))


def test_greedy_with_penalty_matches_host_sampler(sampler):
    """temperature 0 with a repetition penalty: argmax of the penalised logits (nq/sample.py)."""
    from numba import cuda
    from nq.sample import Sampler as HostSampler, SamplingParams
    logits = lm_like_logits(4)
    ctx = [int(np.argmax(logits[:VALID])), 5, 6]
    sampler.set_params(sampler.pack(temperature=0, repeat_penalty=3.0, repeat_last_n=64))
    got = run_step(sampler, cuda.to_device(logits), ctx, 0)
    host = HostSampler(SamplingParams(temperature=0, repeat_penalty=3.0, repeat_last_n=64))
    assert got == host.sample(logits[:VALID], ctx)


def test_graph_replays_equal_eager_and_seed_reproduces(sampler):
    """The same seed gives the same tokens eagerly and as graph replays; another seed differs."""
    from numba import cuda
    from nq.runtime.graphs import CapturedGraph
    logits = cuda.to_device(lm_like_logits(5, peak=400))
    stream = cuda.stream()

    def run(seed, graph):
        sampler.set_params(sampler.pack(seed=seed, top_k=50, top_p=0.95, repeat_penalty=1.1,
                                        repeat_last_n=16), stream)
        sampler.reset(stream)
        st = np.zeros(STATE_LEN, np.int32)
        st[STATE_TOKEN] = 9
        d_state = cuda.to_device(st, stream=stream)
        out = cuda.to_device(np.full(64, -1, np.int32), stream=stream)
        if graph:
            sampler.launch(logits, d_state, out, stream)          # warm, then capture
            stream.synchronize()
            sampler.reset(stream)
            d_state.copy_to_device(st, stream=stream)
            g = CapturedGraph(stream, lambda: sampler.launch(logits, d_state, out, stream),
                              programmatic=True)
            for _ in range(64):
                g.replay()
        else:
            for _ in range(64):
                sampler.launch(logits, d_state, out, stream)
        stream.synchronize()
        return out.copy_to_host()

    a, b, c = run(42, False), run(42, True), run(43, True)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    assert (a < VALID).all()


@pytest.mark.parametrize("control", ["qwen_defaults", "top_p_only", "min_p", "top_k_big"])
def test_chi_square_against_filtered_softmax(sampler, control):
    """>= 100k draws (graph replays, fresh Philox counter each) against softmax(pen / T) over
    the reference's survivors; no penalty history (window 0) so the distribution stays fixed."""
    from numba import cuda
    from nq.runtime.graphs import CapturedGraph
    draws = 100_000
    rng = np.random.default_rng(11)
    logits = rng.standard_normal(V).astype(np.float32)
    logits[:300] += np.linspace(6, 2, 300, dtype=np.float32)   # a few hundred plausible ids
    logits[VALID:] = 1e4
    kw = dict(CONTROLS[control], repeat_penalty=1.0, repeat_last_n=0,
              presence_penalty=0.0, frequency_penalty=0.0)
    prm = sampler.pack(seed=2024, **kw)
    stream = cuda.stream()
    sampler.set_params(prm, stream)
    sampler.reset(stream)
    d_logits = cuda.to_device(logits, stream=stream)
    d_state = cuda.to_device(np.zeros(STATE_LEN, np.int32), stream=stream)
    out = cuda.to_device(np.full(draws, -1, np.int32), stream=stream)
    sampler.launch(d_logits, d_state, out, stream)
    stream.synchronize()
    g = CapturedGraph(stream, lambda: sampler.launch(d_logits, d_state, out, stream),
                      programmatic=True)
    d_state.copy_to_device(np.zeros(STATE_LEN, np.int32), stream=stream)
    for _ in range(draws):
        g.replay()
    stream.synchronize()
    got = out.copy_to_host()
    ids, probs = filtered_distribution(logits, [0], prm, VALID)
    assert np.isin(got, ids).all(), "drew an id outside the filtered set"
    pos = {int(i): j for j, i in enumerate(ids)}
    counts = np.bincount([pos[int(t)] for t in got], minlength=ids.size)
    expected = probs * draws
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    chi2 = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    df = int(keep.sum()) - 1
    # Wilson-Hilferty: z of a chi-square with df degrees of freedom; 4.5 sigma ~ p 3e-6
    z = ((chi2 / df) ** (1 / 3) - (1 - 2 / (9 * df))) / np.sqrt(2 / (9 * df))
    assert z < 4.5, (control, chi2, df, z)


@pytest.mark.parametrize("window", [-1, 3, 0])
def test_penalty_history_on_the_right_ids(sampler, window):
    """Steps commit their input token (and drop the one leaving a window): after a seeded
    prompt and several steps the count table and the penalised logits are the reference's."""
    from numba import cuda
    logits = lm_like_logits(9)
    prm = sampler.pack(seed=1, top_k=20, repeat_penalty=1.5, presence_penalty=0.25,
                       frequency_penalty=0.5, repeat_last_n=window)
    sampler.set_params(prm)
    sampler.reset()
    prompt = [5, 9, 9, 12, 5, 700]
    sampler.seed_history(prompt[:-1])
    st = np.zeros(STATE_LEN, np.int32)
    st[STATE_TOKEN], st[STATE_POS] = prompt[-1], len(prompt) - 1
    d_state = cuda.to_device(st)
    out = cuda.to_device(np.full(16, -1, np.int32))
    d_logits = cuda.to_device(logits)
    ctx = list(prompt)
    for _ in range(6):
        sampler.launch(d_logits, d_state, out)
        want_pen = penalize(logits, history_counts(ctx, window, V), unpack_params(prm), VALID)
        np.testing.assert_array_equal(sampler.pen.copy_to_host()[:VALID], want_pen)
        ctx.append(int(d_state.copy_to_host()[STATE_TOKEN]))
    np.testing.assert_array_equal(sampler.counts.copy_to_host(),
                                  history_counts(ctx[:-1], window, V))
    # truncate and append through the device ring give the same table as a fresh count
    sampler.truncate_history(4)
    np.testing.assert_array_equal(sampler.counts.copy_to_host(),
                                  history_counts(ctx[:4], window, V))
    more = np.array([77, 78, 77], np.int32)
    sampler.append_history(cuda.to_device(more), 4)
    np.testing.assert_array_equal(sampler.counts.copy_to_host(),
                                  history_counts(ctx[:4] + more.tolist(), window, V))
    assert sampler.history_length() == 7
