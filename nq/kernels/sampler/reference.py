"""NumPy reference of the device sampler: the same chain, the same order, the same Philox noise.

    counts = history_counts(context, window, vocab)       what the device count table holds
    pen    = penalize(logits, counts, prm, valid)         step 1 (fp32, as the kernel)
    ids    = survivors(pen, prm)                          steps 2-4, by (logit desc, id asc)
    token, info = sample_reference(logits, context, params, step, valid)

`context` is every token the model has been fed, the step's input token last (its position is
`len(context) - 1`, the decode state's STATE_POS when the sampler runs).

Where it may differ from the kernel, and why the tests allow it:
* expf / logf: the kernel calls libdevice, NumPy its own fp32 routines; both are within ~1 ulp
  but not bit-equal.  That moves a token's quantised mass (below) by ~2^-24 of itself and a
  Gumbel score by ~1 ulp.  Penalties, keys, top-k and the min-p threshold are exact fp32
  arithmetic (same IEEE operations in the same order), so those survivor sets are identical.
* top-p sums integer masses q = floor(exp(l - max) * 2^40) (int64; the kernel adds them with
  integer atomics, so its sum is exact and order-free); only the per-token exp can differ, so a
  cut can move only when the cumulative mass is within ~1e-6 of p * Z.  `info["p_margin"]`
  says how far this step was from that.
* the draw is an argmax of fp32 scores: the kernel and this can pick different ids only when
  the two best scores are within a few ulps (`info["margin"]`, probability ~1e-6 a step).
nq/sample.py (float64, no presence/frequency, no padded ids) is the semantic oracle; the CPU
tests check that this reference keeps its survivor sets on logits away from every cut.
"""
from __future__ import annotations

import numpy as np

from nq.kernels.philox import philox4x32_10_np, uniform_open01_np
from nq.kernels.sampler.params import unpack_params

MASS_BITS = 40  # q = floor(p_rel * 2^40): 152,064 tokens sum below 2^58, exact in int64


def idx_bits(vocab: int) -> int:
    """Bits of a token id inside the composite key (18 for 152,064)."""
    return max(1, (int(vocab) - 1).bit_length())


def keys_of(x) -> np.ndarray:
    """fp32 -> order-preserving uint32 key (as int64): larger float, larger key.  -0.0 is
    read as +0.0 (argmax calls them equal); NaN must already be gone (penalize maps it)."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.int64)
    b = np.where(b == 0x80000000, 0, b)
    return np.where(b >= 0x80000000, 0xFFFFFFFF - b, b + 0x80000000)


def values_of(keys) -> np.ndarray:
    k = np.asarray(keys, np.int64)
    b = np.where(k >= 0x80000000, k - 0x80000000, 0xFFFFFFFF - k)
    return b.astype(np.uint32).view(np.float32)


def composites(pen: np.ndarray, vocab: int) -> np.ndarray:
    """(key << idx_bits) | (idmask - id): one int64 per id, unique, ordered as the sampler
    ranks (logit descending, then id ascending)."""
    ib = idx_bits(vocab)
    ids = np.arange(pen.size, dtype=np.int64)
    return (keys_of(pen) << ib) | (((1 << ib) - 1) - ids)


def history_counts(context, window: int, vocab: int) -> np.ndarray:
    """int32 (vocab,): occurrences of each id among the last `window` context tokens (-1: all,
    0: none), the step's input token included."""
    ctx = np.asarray(context, np.int64).reshape(-1)
    if window == 0:
        ctx = ctx[:0]
    elif window > 0:
        ctx = ctx[-window:]
    return np.bincount(ctx[(ctx >= 0) & (ctx < vocab)], minlength=vocab).astype(np.int32)


def penalize(logits, counts, prm: dict, valid: int) -> np.ndarray:
    """fp32 (valid,): repetition penalty then presence/frequency (llama.cpp's order), on ids with
    a count; NaN becomes -inf (never drawn unless nothing else is left)."""
    lg = np.asarray(logits, np.float32)[:valid].copy()
    c = np.asarray(counts, np.int32)[:valid]
    hit = c > 0
    one = np.float32(1)
    rp = np.float32(prm["repeat"])
    v = lg[hit]
    v = np.where(v <= 0, v * rp, v / rp).astype(np.float32) if rp != one else v
    v = v - (c[hit].astype(np.float32) * np.float32(prm["frequency"]) + np.float32(prm["presence"]))
    lg[hit] = v
    lg[np.isnan(lg)] = -np.inf
    return lg


def masses(values, top: np.float32) -> np.ndarray:
    """int64 quantised exp(value - top), as the kernel computes it."""
    e = np.exp((np.asarray(values, np.float32) - np.float32(top)).astype(np.float32))
    return (e * np.float32(2.0 ** MASS_BITS)).astype(np.int64)


def survivors(pen: np.ndarray, prm: dict, vocab: int | None = None) -> tuple[np.ndarray, dict]:
    """Steps 2-4 on penalised logits (valid,): (ids by rank, {"p_margin": ...}).

    top-k keeps the k first by (logit desc, id asc); top-p the shortest prefix whose mass
    (over the top-k survivors, or every id with top-k off) reaches p; min-p the ids whose logit
    is >= max + log(min_p) in fp32."""
    comp = composites(pen, vocab or pen.size)
    order = np.argsort(-comp, kind="stable")
    vals = pen[order]
    top = vals[0]
    q = masses(vals, top)
    n = order.size
    k = prm["top_k"]
    if k > 0:
        n = min(k, n)
    info = {"p_margin": np.inf}
    if prm["top_p"] < 1:
        z = q[:n].sum() if k > 0 else q.sum()
        target = np.float64(prm["top_p"]) * np.float64(z)
        cum = np.cumsum(q[:n]).astype(np.float64)
        j = int(np.searchsorted(cum, target, side="left"))
        n = min(j + 1, n)
        info["p_margin"] = float(np.min(np.abs(cum - target)) / max(z, 1))
    if prm["log_min_p"] > -np.inf:
        th = np.float32(top + np.float32(prm["log_min_p"]))
        n = min(n, int(np.count_nonzero(vals[:n] >= th)))
    return order[: max(n, 1)], info


def gumbel_scores(ids, pen, prm: dict, step: int, pos: int) -> np.ndarray:
    """fp32 pen[id] / T + Gumbel(Philox(seed; id // 4, step, pos, 0)[id % 4])."""
    ids = np.asarray(ids, np.int64)
    ctr = np.stack([ids >> 2, np.full_like(ids, step & 0xFFFFFFFF),
                    np.full_like(ids, pos & 0xFFFFFFFF), np.zeros_like(ids)], axis=-1)
    key = np.broadcast_to(np.array([prm["seed_lo"], prm["seed_hi"]], np.uint64), (ids.size, 2))
    words = philox4x32_10_np(ctr, key)[np.arange(ids.size), ids & 3]
    u = uniform_open01_np(words)
    g = -np.log(-np.log(u))
    return (pen[ids] / np.float32(prm["temperature"])).astype(np.float32) + g.astype(np.float32)


def sample_reference(logits, context, params, step: int, valid: int) -> tuple[int, dict]:
    """The token the device sampler draws at this step, and what the tests need to judge it:
    survivors (ids by rank), scores (their Gumbel scores), margin (best - second best score),
    p_margin (relative distance of the top-p cut from rounding)."""
    prm = unpack_params(params)
    logits = np.asarray(logits, np.float32)
    counts = history_counts(context, prm["window"], logits.size)
    pen = penalize(logits, counts, prm, valid)
    ids, info = survivors(pen, prm, logits.size)
    scores = gumbel_scores(ids, pen, prm, step, len(context) - 1)
    keyed = (keys_of(scores) << idx_bits(logits.size)) - ids   # ties: the lower id
    best = int(np.argmax(keyed))
    s = np.sort(scores.astype(np.float64))
    info.update(survivors=ids, scores=scores, pen=pen,
                margin=float(s[-1] - s[-2]) if s.size > 1 else np.inf)
    return int(ids[best]), info


def filtered_distribution(logits, context, params, valid: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, probabilities) the draw samples from: softmax(pen / T) over the survivors, fp64."""
    prm = unpack_params(params)
    logits = np.asarray(logits, np.float32)
    counts = history_counts(context, prm["window"], logits.size)
    pen = penalize(logits, counts, prm, valid)
    ids, _ = survivors(pen, prm, logits.size)
    z = pen[ids].astype(np.float64) / np.float64(prm["temperature"])
    p = np.exp(z - z.max())
    return ids, p / p.sum()
