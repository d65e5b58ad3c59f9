"""The host sampler: each stage of the llama.cpp chain on hand-made logits, and its seeding."""
import numpy as np
import pytest

from nq.sample import Sampler, SamplingParams

# probabilities 0.5, 0.3, 0.15, 0.05 at temperature 1
LOGITS = np.log(np.array([0.5, 0.3, 0.15, 0.05])).astype(np.float32)
OFF = dict(top_k=0, top_p=1.0, min_p=0.0)  # only the stage under test is on


def sampler(**kw):
    return Sampler(SamplingParams(**{**OFF, "temperature": 1.0, "seed": 0, **kw}))


def test_greedy_is_argmax_and_takes_the_first_of_ties():
    rng = np.random.default_rng(0)
    s = Sampler(SamplingParams(temperature=0.0, seed=1))
    for _ in range(20):
        lg = rng.standard_normal(1000).astype(np.float32)
        assert s.sample(lg) == int(np.argmax(lg))
    assert s.sample(np.array([1.0, 3.0, 3.0, 2.0])) == 1


def test_top_k_1_equals_greedy_at_any_temperature():
    rng = np.random.default_rng(1)
    s = Sampler(SamplingParams(temperature=1.5, top_k=1, top_p=1.0, min_p=0.0, seed=2))
    for _ in range(20):
        lg = rng.standard_normal(5000).astype(np.float32)
        assert s.sample(lg) == int(np.argmax(lg))


def test_same_seed_same_tokens_other_seed_other_tokens():
    lg = np.zeros(100, np.float32)  # uniform over 100 ids: 50 draws cannot repeat by chance

    def run(seed):
        s = sampler(seed=seed)
        return [s.sample(lg) for _ in range(50)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_top_k_keeps_the_k_largest():
    ids, probs = sampler(top_k=2).distribution(LOGITS)
    assert ids.tolist() == [0, 1]
    np.testing.assert_allclose(probs, [0.5 / 0.8, 0.3 / 0.8])


@pytest.mark.parametrize("top_p, kept", [(0.4, [0]), (0.75, [0, 1]), (0.85, [0, 1, 2]),
                                         (0.99, [0, 1, 2, 3])])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, kept):
    ids, probs = sampler(top_p=top_p).distribution(LOGITS)
    assert ids.tolist() == kept
    p = np.array([0.5, 0.3, 0.15, 0.05])[kept]
    np.testing.assert_allclose(probs, p / p.sum(), rtol=1e-6)


@pytest.mark.parametrize("min_p, kept", [(0.05, [0, 1, 2, 3]), (0.2, [0, 1, 2]),
                                         (0.5, [0, 1]), (0.9, [0])])
def test_min_p_keeps_tokens_above_a_fraction_of_the_top(min_p, kept):
    # thresholds: min_p * 0.5 = 0.025, 0.1, 0.25, 0.45
    ids, _ = sampler(min_p=min_p).distribution(LOGITS)
    assert ids.tolist() == kept


def test_cuts_happen_before_temperature():
    # at temperature 10 the survivors are nearly uniform, but min-p still judged them at T=1
    ids, probs = sampler(min_p=0.2, temperature=10.0).distribution(LOGITS)
    assert ids.tolist() == [0, 1, 2]
    want = np.array([0.5, 0.3, 0.15]) ** 0.1
    np.testing.assert_allclose(probs, want / want.sum(), rtol=1e-6)


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits():
    lg = np.array([2.0, -1.0, 1.5, 0.5], np.float32)
    s = Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0, repeat_last_n=3))
    np.testing.assert_allclose(s.penalized(lg, [0, 1, 1]), [1.0, -2.0, 1.5, 0.5])
    assert s.sample(lg, []) == 0
    assert s.sample(lg, [0, 1]) == 2  # 2.0 -> 1.0 falls below 1.5
    # id 0 is older than the last 3 ids, so it is not penalised
    assert s.sample(lg, [0, 3, 3, 3]) == 0
    off = Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0, repeat_last_n=0))
    assert off.sample(lg, [0]) == 0
    whole = Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0, repeat_last_n=-1))
    assert whole.sample(lg, [0] + [3] * 100) == 2


def test_presence_and_frequency_penalties_by_hand_and_as_the_device_reference():
    """llama.cpp's order: the repeat penalty, then - presence - frequency * count, over the
    same window; the device sampler's NumPy reference penalises the same way."""
    from nq.kernels.sampler import pack_params
    from nq.kernels.sampler.params import unpack_params
    from nq.kernels.sampler.reference import history_counts, penalize
    lg = np.array([2.0, -1.0, 1.5, 0.5], np.float32)
    kw = dict(temperature=0.0, repeat_penalty=2.0, repeat_last_n=4, presence_penalty=0.5,
              frequency_penalty=0.25)
    s = Sampler(SamplingParams(**kw))
    recent = [2, 0, 1, 1, 3, 3, 3]  # window: 1, 3, 3, 3 (ids 0 and 2 fell out)
    want = [2.0, -2.0 - 0.5 - 0.25, 1.5, 0.5 / 2.0 - 0.5 - 0.75]
    np.testing.assert_allclose(s.penalized(lg, recent), want)
    prm = unpack_params(pack_params(valid_vocab=4, max_top_k=4, **kw))
    np.testing.assert_allclose(penalize(lg, history_counts(recent, 4, 4), prm, 4), want,
                               rtol=1e-6)
    # without a repeat penalty the additive ones still apply
    s = Sampler(SamplingParams(temperature=0.0, repeat_penalty=1.0, repeat_last_n=-1,
                               frequency_penalty=1.0))
    np.testing.assert_allclose(s.penalized(lg, [0, 0, 0]), [-1.0, -1.0, 1.5, 0.5])


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_sampled_frequencies_follow_the_tempered_softmax(temperature):
    p = np.array([0.6, 0.3, 0.1])
    s = sampler(temperature=temperature, seed=123)
    n = 20000
    counts = np.bincount([s.sample(np.log(p)) for _ in range(n)], minlength=3)
    want = p ** (1 / temperature)
    want /= want.sum()
    # binomial standard deviation is at most sqrt(0.25 / 20000) = 0.0035; allow ~4 sigma
    np.testing.assert_allclose(counts / n, want, atol=0.015)


def test_bad_parameters_and_nan_logits_are_refused():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="repeat_penalty"):
        SamplingParams(repeat_penalty=0)
    with pytest.raises(ValueError, match="NaN"):
        Sampler(SamplingParams(temperature=0.0)).sample(np.array([0.0, np.nan]))
