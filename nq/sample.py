"""Host sampler: llama.cpp's default sampling chain over one row of logits.

This is the sampler of the NumPy backend and the semantic oracle of the device sampler
(nq/kernels/sampler, which the GPU engine runs inside its decode graph).
Semantics and order follow llama.cpp's default chain (common/sampling), so that `--temp`,
`--top-k`, `--top-p`, `--min-p`, `--repeat-penalty` mean what llama.cpp users expect:

  1. penalties      every distinct token among the last `repeat_last_n` ids has its logit
                     divided by the repeat penalty when positive, multiplied when <= 0, then
                     lowered by presence + frequency * (its count in that window)
  2. top-k           keep the k largest logits (k <= 0: off)
  3. top-p           keep the smallest prefix, by descending probability, whose mass
                     reaches p (p >= 1: off); probabilities are softmax at temperature 1
  4. min-p           keep tokens whose probability is >= min_p * the largest (0: off)
  5. temperature     divide the logits by it; 0 means greedy: argmax after step 1
  6. sample          draw from the softmax of what is left with a seeded numpy Generator

Top-p and min-p therefore cut on the temperature-1 distribution, as llama.cpp does; a high
temperature flattens only the survivors.  Probabilities here are float64: this is host code,
not a kernel oracle, and a 152k-way cumulative sum in fp32 loses the tail's resolution.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8   # 0: greedy
    top_k: int = 40            # <= 0: off
    top_p: float = 0.95        # >= 1: off
    min_p: float = 0.05        # <= 0: off
    repeat_penalty: float = 1.0  # 1: off
    repeat_last_n: int = 64    # 0: off, -1: the whole history given to `sample`
    seed: int | None = None    # None: fresh OS entropy (not reproducible)
    presence_penalty: float = 0.0   # llama.cpp's (and the device sampler's): over the same
    frequency_penalty: float = 0.0  # window as the repeat penalty; 0: off

    def __post_init__(self):
        def need(cond, what):
            if not cond:
                raise ValueError(f"sampling parameters: {what}")
        need(np.isfinite(self.temperature) and self.temperature >= 0,
             f"temperature={self.temperature}; give 0 (greedy) or a positive value")
        need(self.top_p > 0, f"top_p={self.top_p}; give a value in (0, 1] (1 disables it)")
        need(0 <= self.min_p <= 1, f"min_p={self.min_p}; give a value in [0, 1] (0 disables it)")
        need(np.isfinite(self.repeat_penalty) and self.repeat_penalty > 0,
             f"repeat_penalty={self.repeat_penalty}; give a positive value (1 disables it)")
        need(self.repeat_last_n >= -1,
             f"repeat_last_n={self.repeat_last_n}; give >= 0, or -1 for the whole history")
        need(np.isfinite(self.presence_penalty) and np.isfinite(self.frequency_penalty),
             "presence_penalty and frequency_penalty must be finite numbers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Turns logits into token ids with `params`; one Generator, so a seed fixes the sequence."""

    def __init__(self, params: SamplingParams | None = None):
        self.params = params or SamplingParams()
        self.rng = np.random.default_rng(self.params.seed)

    def penalized(self, logits, recent_ids: Sequence[int] = ()) -> np.ndarray:
        """Step 1: a float64 copy of logits (vocab,) with the penalties applied."""
        p = self.params
        out = np.array(logits, dtype=np.float64).reshape(-1)
        if np.isnan(out).any():
            raise ValueError(f"logits contain NaN at ids {np.flatnonzero(np.isnan(out))[:5].tolist()}; "
                             "the forward pass is broken (compare it with --backend numpy)")
        n = len(recent_ids) if p.repeat_last_n == -1 else p.repeat_last_n
        additive = p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        if (p.repeat_penalty != 1.0 or additive) and n > 0 and len(recent_ids):
            ids, counts = np.unique(np.asarray(recent_ids[-n:], dtype=np.int64),
                                    return_counts=True)
            keep = (ids >= 0) & (ids < out.size)
            ids, counts = ids[keep], counts[keep]
            v = out[ids]
            if p.repeat_penalty != 1.0:
                v = np.where(v <= 0, v * p.repeat_penalty, v / p.repeat_penalty)
            out[ids] = v - (p.frequency_penalty * counts + p.presence_penalty)
        return out

    def distribution(self, logits, recent_ids: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """Steps 1-5: (token ids, probabilities) that step 6 draws from, by descending probability.

        Greedy (temperature 0) gives the single argmax with probability 1.
        """
        p = self.params
        lg = self.penalized(logits, recent_ids)
        if p.greedy:
            return np.array([int(np.argmax(lg))]), np.ones(1)
        ids = np.arange(lg.size)
        if 0 < p.top_k < lg.size:
            ids = np.argpartition(-lg, p.top_k - 1)[: p.top_k]
        ids = ids[np.argsort(-lg[ids], kind="stable")]
        lg = lg[ids]
        if p.top_p < 1.0:
            n = _first_reaching(np.cumsum(_softmax(lg)), p.top_p) + 1
            ids, lg = ids[:n], lg[:n]
        if p.min_p > 0.0:
            keep = lg >= lg[0] + np.log(p.min_p)  # prob >= min_p * max prob, without the softmax
            ids, lg = ids[keep], lg[keep]
        return ids, _softmax(lg / p.temperature)

    def sample(self, logits, recent_ids: Sequence[int] = ()) -> int:
        """One token id from logits (vocab,); `recent_ids` are the ids so far, oldest first."""
        ids, probs = self.distribution(logits, recent_ids)
        if ids.size == 1:
            return int(ids[0])
        cum = np.cumsum(probs)
        i = int(np.searchsorted(cum, self.rng.random() * cum[-1], side="right"))
        return int(ids[min(i, ids.size - 1)])


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _first_reaching(cum: np.ndarray, p: float) -> int:
    """Index of the first cumulative probability >= p (the last index if rounding never gets there)."""
    return min(int(np.searchsorted(cum, p, side="left")), cum.size - 1)
