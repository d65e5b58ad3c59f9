"""The sampler's parameter block: one int32 device array the kernels read on every replay.

Changing a parameter is a 64-byte upload (`Sampler.set_params`), never a recapture.  Floats
are stored as their fp32 bit patterns (read on the device with `mov.b32`, nq/ptx/permute.py).

    word  name           type  meaning (llama.cpp / transformers / OpenAI names in brackets)
    0     P_TOP_K        int   keep the k most likely ids, 1 <= k <= cap (0: off)  [top_k]
    1     P_TOP_P        f32   keep the shortest prefix reaching this mass (1: off) [top_p]
    2     P_LOG_MIN_P    f32   log(min_p): keep logit >= max + this (-inf: off)     [min_p]
    3     P_TEMPERATURE  f32   divide the survivors' logits by it (greedy: 1, with top_k 1)
    4     P_REPEAT       f32   repetition penalty: /p if logit > 0 else *p (1: off) [repeat_penalty]
    5     P_PRESENCE     f32   logit -= presence * [count > 0]                     [presence_penalty]
    6     P_FREQUENCY    f32   logit -= frequency * count                           [frequency_penalty]
    7     P_WINDOW       int   penalty history: the last N tokens; -1 every token in the
                               context (transformers); 0 none               [repeat_last_n]
    8, 9  P_SEED_LO/HI   u32   Philox key: the low and high 32 bits of the seed
    10-15                      reserved, zero

Temperature 0 is packed as top_k 1 (min-p/top-p off, temperature 1): the one survivor is the
largest penalised logit, lowest id first, which is argmax bit for bit.  top_p and log(min_p)
are rounded to fp32 here, once; the NumPy reference reads the same words, so both cut at the
same thresholds (nq/sample.py compares in fp64: the survivor sets can differ only for an id
whose probability sits within fp32 rounding of a cut).
"""
from __future__ import annotations

import math

import numpy as np

P_TOP_K, P_TOP_P, P_LOG_MIN_P, P_TEMPERATURE = 0, 1, 2, 3
P_REPEAT, P_PRESENCE, P_FREQUENCY, P_WINDOW = 4, 5, 6, 7
P_SEED_LO, P_SEED_HI = 8, 9
PARAMS_LEN = 16


def f32_bits(x: float) -> int:
    """The fp32 bit pattern of x as a signed int32 (what the int32 word holds)."""
    return int(np.array([x], np.float32).view(np.int32)[0])


def bits_f32(word) -> np.float32:
    return np.array([word], np.int64).astype(np.uint32).view(np.float32)[0]


def pack_params(*, temperature: float = 0.7, top_k: int = 20, top_p: float = 0.8,
                min_p: float = 0.0, repeat_penalty: float = 1.0, repeat_last_n: int = -1,
                presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                seed: int = 0, valid_vocab: int, max_top_k: int,
                history_cap: int | None = None) -> np.ndarray:
    """int32 (PARAMS_LEN,) in the layout of the module doc; defaults are Qwen2.5-Instruct's
    generation_config except the penalty (1.05 there; 1 here so 'no arguments' means none).

    valid_vocab: the tokenizer's size (ids at or above it are never drawn), which also caps
    top_k; max_top_k: the sampler's candidate capacity; history_cap: its token ring's length
    (a window longer than it cannot be kept)."""
    def need(cond, what):
        if not cond:
            raise ValueError(f"sampling parameters: {what}")
    need(math.isfinite(temperature) and temperature >= 0,
         f"temperature={temperature}; give 0 (greedy) or a positive value")
    need(int(top_k) == top_k and 0 <= top_k, f"top_k={top_k}; give 0 (off) or a positive count")
    need(top_k <= max_top_k or top_k >= valid_vocab,
         f"top_k={top_k} exceeds this sampler's candidate capacity {max_top_k}; give at most "
         f"{max_top_k}, or 0 to turn top-k off")
    need(0 < top_p <= 1, f"top_p={top_p}; give a value in (0, 1] (1 disables it)")
    need(0 <= min_p <= 1, f"min_p={min_p}; give a value in [0, 1] (0 disables it)")
    need(math.isfinite(repeat_penalty) and repeat_penalty > 0,
         f"repeat_penalty={repeat_penalty}; give a positive value (1 disables it)")
    need(math.isfinite(presence_penalty) and math.isfinite(frequency_penalty),
         "presence/frequency penalties must be finite")
    need(int(repeat_last_n) == repeat_last_n and repeat_last_n >= -1,
         f"repeat_last_n={repeat_last_n}; give >= 0, or -1 for the whole context")
    need(history_cap is None or repeat_last_n <= history_cap,
         f"repeat_last_n={repeat_last_n} is longer than the sampler's history ring "
         f"({history_cap}); make the sampler with a larger max_len or use -1")
    need(0 <= seed < 2**64, f"seed={seed}; give an integer in [0, 2**64)")
    w = np.zeros(PARAMS_LEN, np.int32)
    greedy = temperature == 0
    k = 1 if greedy else int(top_k)
    w[P_TOP_K] = 0 if k >= valid_vocab else k
    w[P_TOP_P] = f32_bits(1.0 if greedy or top_p >= 1 else top_p)
    w[P_LOG_MIN_P] = f32_bits(-np.inf if greedy or min_p <= 0 else math.log(min_p))
    w[P_TEMPERATURE] = f32_bits(1.0 if greedy else temperature)
    w[P_REPEAT] = f32_bits(repeat_penalty)
    w[P_PRESENCE] = f32_bits(presence_penalty)
    w[P_FREQUENCY] = f32_bits(frequency_penalty)
    w[P_WINDOW] = int(repeat_last_n)
    w[P_SEED_LO] = np.uint32(seed & 0xFFFFFFFF).view(np.int32)
    w[P_SEED_HI] = np.uint32(seed >> 32).view(np.int32)
    return w


def unpack_params(w) -> dict:
    """The packed words back as a dict of Python numbers (the reference reads this)."""
    w = np.asarray(w, np.int32)
    return dict(top_k=int(w[P_TOP_K]), top_p=bits_f32(w[P_TOP_P]),
                log_min_p=bits_f32(w[P_LOG_MIN_P]), temperature=bits_f32(w[P_TEMPERATURE]),
                repeat=bits_f32(w[P_REPEAT]), presence=bits_f32(w[P_PRESENCE]),
                frequency=bits_f32(w[P_FREQUENCY]), window=int(w[P_WINDOW]),
                seed_lo=int(np.uint32(w[P_SEED_LO].view(np.uint32))),
                seed_hi=int(np.uint32(w[P_SEED_HI].view(np.uint32))))


def from_sampling_params(p, **extra) -> np.ndarray:
    """pack_params from nq.sample.SamplingParams; seed None draws a fresh 64-bit key from the
    OS (as the host sampler does); extra: presence/frequency penalties, valid_vocab, caps."""
    import secrets
    seed = secrets.randbits(64) if p.seed is None else int(p.seed) % 2**64
    return pack_params(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                       repeat_penalty=p.repeat_penalty, repeat_last_n=p.repeat_last_n,
                       **{"seed": seed, **extra})
