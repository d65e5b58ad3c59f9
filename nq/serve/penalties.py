"""OpenAI's presence and frequency penalties, as a backend wrapper.

OpenAI defines them on the logits of every step, over the tokens generated so far:

    logit[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0)

nq's sampler (nq/sample.py) implements llama.cpp's multiplicative repeat penalty only, and
the generation loop builds its own Sampler; so rather than a second sampler, the penalties sit
between the loop and the backend: `decode(token)` is called with each generated token but the
last, which is exactly the history the formula counts.  The wrapper has no `generate_ids`, so
the loop samples on the host (the GPU engine already does whenever temperature > 0).
"""
from __future__ import annotations

import numpy as np


class PenalizedBackend:
    """prefill/decode of `backend` with the additive penalties applied to the logits."""

    def __init__(self, backend, presence: float, frequency: float):
        self.backend, self.presence, self.frequency = backend, presence, frequency
        self.counts: dict[int, int] = {}

    def _apply(self, logits) -> np.ndarray:
        if not self.counts:
            return logits
        out = np.array(logits, dtype=np.float32)
        ids = np.fromiter(self.counts.keys(), dtype=np.int64)
        c = np.fromiter(self.counts.values(), dtype=np.float32)
        out[ids] -= self.frequency * c + self.presence
        return out

    def prefill(self, ids) -> np.ndarray:
        return self._apply(self.backend.prefill(ids))

    def decode(self, token: int) -> np.ndarray:
        self.counts[int(token)] = self.counts.get(int(token), 0) + 1
        return self._apply(self.backend.decode(token))
