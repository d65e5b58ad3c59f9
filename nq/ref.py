"""NumPy reference engine: the Qwen2 forward pass in plain fp32.

This is the oracle every GPU kernel is tested against and the `--backend numpy` engine.
The building blocks (`rms_norm`, `rope_cos_sin`, `apply_rope`, `attention`, `swiglu`,
`linear`) are small free functions so kernel tests can call exactly the piece they replace.

Numerics follow Hugging Face's `Qwen2ForCausalLM` run in fp32, and the GPU's choices where
they are no less exact: the residual stream, norms, softmax and accumulations are fp32
throughout.  float64 appears in one place, `rope_cos_sin`'s inverse frequencies (see there).
The weights are the host weights of docs/ARCHITECTURE.md: projections already dequantised to
fp32 (N, K), so a linear layer is `x @ w.T (+ b)`.
"""
from __future__ import annotations

import numpy as np

from nq.config import ModelConfig

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BIASED = ("q_proj", "k_proj", "v_proj")  # Qwen2 has biases on q, k, v only


# ---- building blocks ------------------------------------------------------------------------

def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x (..., H) fp32, w (H,) -> (..., H) fp32: x / sqrt(mean(x^2) + eps) * w, as HF Qwen2RMSNorm."""
    x = np.asarray(x, dtype=np.float32)
    var = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    return (x * (np.float32(1.0) / np.sqrt(var + np.float32(eps)))) * np.asarray(w, np.float32)


def rope_cos_sin(positions, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin tables (T, head_dim/2) fp32 for integer positions (T,).

    The inverse frequencies theta^(-2i/D) are evaluated in float64 and rounded once to fp32:
    they are D/2 constants, and this makes them the correctly rounded fp32 values (torch's
    fp32 `pow` is within an ulp of them).  The angle pos*inv_freq is then formed in fp32, as
    HF does, so at long positions the reference carries the same angle rounding as HF.
    """
    pos = np.asarray(positions).reshape(-1).astype(np.float32)
    inv_freq = (1.0 / (float(theta) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
                ).astype(np.float32)
    ang = pos[:, None] * inv_freq[None, :]  # (T, D/2) fp32
    return np.cos(ang), np.sin(ang)


def apply_rope(x: np.ndarray, positions, theta: float) -> np.ndarray:
    """x (T, H, D) -> (T, H, D) rotated at `positions` (T,), HF's rotate_half convention.

    Dimension i pairs with i + D/2 (not with i+1 as in the original RoPE paper), because that
    is how the Qwen2 checkpoints were trained.
    """
    x = np.asarray(x, dtype=np.float32)
    t, _, d = x.shape
    cos, sin = rope_cos_sin(positions, d, theta)
    if cos.shape[0] != t:
        raise ValueError(f"apply_rope: {cos.shape[0]} positions for {t} rows")
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, D/2)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions) -> np.ndarray:
    """Causal grouped-query attention.

    q (T, Hq, D), k and v (S, Hkv, D) holding keys at positions 0..S-1, q_positions (T,):
    query t sees keys 0..q_positions[t].  Query head h reads kv head h // (Hq/Hkv), as HF's
    repeat_kv.  Scores and softmax in fp32, scale 1/sqrt(D).  Returns (T, Hq, D) fp32.
    """
    q = np.asarray(q, np.float32)
    k = np.asarray(k, np.float32)
    v = np.asarray(v, np.float32)
    t, hq, d = q.shape
    s, hkv, _ = k.shape
    if hq % hkv:
        raise ValueError(f"attention: {hq} query heads are not a multiple of {hkv} kv heads")
    g = hq // hkv
    pos = np.asarray(q_positions).reshape(-1)
    if pos.shape[0] != t:
        raise ValueError(f"attention: {pos.shape[0]} positions for {t} queries")
    if t and int(pos.max()) >= s:
        raise ValueError(f"attention: query position {int(pos.max())} but only {s} keys")
    qg = q.reshape(t, hkv, g, d).transpose(1, 2, 0, 3)         # (Hkv, G, T, D)
    kt = k.transpose(1, 2, 0)[:, None]                         # (Hkv, 1, D, S)
    scores = (qg @ kt) * np.float32(1.0 / np.sqrt(d))          # (Hkv, G, T, S)
    masked = np.arange(s)[None, :] > pos[:, None]              # (T, S)
    scores = np.where(masked, np.float32(-np.inf), scores)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = p @ v.transpose(1, 0, 2)[:, None]                    # (Hkv, G, T, D)
    return np.ascontiguousarray(out.transpose(2, 0, 1, 3).reshape(t, hq, d))


def silu(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    return x / (np.float32(1.0) + np.exp(-x))


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up, the Qwen2 MLP activation."""
    return silu(gate) * np.asarray(up, np.float32)


def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """x (..., K) @ w (N, K).T (+ b (N,)) -> (..., N) fp32."""
    y = np.asarray(x, np.float32) @ np.asarray(w, np.float32).T
    return y if b is None else y + np.asarray(b, np.float32)


# ---- KV cache -------------------------------------------------------------------------------

class KVCache:
    """Per-layer keys and values, each (capacity, Hkv, D) fp32, filled up to `length`.

    Keys are stored after RoPE, like the GPU's pages.  Storage starts at `capacity` rows and
    doubles when a forward call would overflow it, up to `max_len`, so a long prompt costs
    O(log n) copies rather than one per token.
    """

    def __init__(self, cfg: ModelConfig, max_len: int | None = None, capacity: int = 256):
        self.cfg = cfg
        self.max_len = int(max_len or cfg.max_position_embeddings)
        cap = max(1, min(capacity, self.max_len))
        shape = (cap, cfg.num_kv_heads, cfg.head_dim)
        self._k = [np.zeros(shape, np.float32) for _ in range(cfg.num_layers)]
        self._v = [np.zeros(shape, np.float32) for _ in range(cfg.num_layers)]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self._k[0].shape[0]

    def reserve(self, n: int) -> None:
        """Make room for `n` more tokens, or say why there is none."""
        need = self.length + n
        if need > self.max_len:
            raise ValueError(f"KV cache full: {self.length} cached + {n} new tokens exceeds "
                             f"max_len={self.max_len}; shorten the prompt or max_tokens")
        if need <= self.capacity:
            return
        cap = min(self.max_len, max(need, 2 * self.capacity))
        for lst in (self._k, self._v):
            for i, a in enumerate(lst):
                b = np.zeros((cap,) + a.shape[1:], np.float32)
                b[: self.length] = a[: self.length]
                lst[i] = b

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store (T, Hkv, D) keys/values at rows length..length+T-1 (call `advance` after all layers)."""
        t = k.shape[0]
        self._k[layer][self.length: self.length + t] = k
        self._v[layer][self.length: self.length + t] = v

    def keys(self, layer: int, upto: int) -> np.ndarray:
        return self._k[layer][:upto]

    def values(self, layer: int, upto: int) -> np.ndarray:
        return self._v[layer][:upto]

    def advance(self, n: int) -> None:
        self.length += n

    def reset(self) -> None:
        self.length = 0

    def snapshot(self) -> tuple:
        """A copy of the filled rows, for `restore` (the server's prompt-cache slots)."""
        n = self.length
        return n, [k[:n].copy() for k in self._k], [v[:n].copy() for v in self._v]

    def restore(self, state: tuple) -> None:
        n, ks, vs = state
        self.length = 0
        self.reserve(n)
        for dst, src in zip(self._k + self._v, ks + vs):
            dst[:n] = src
        self.length = n


# ---- model ----------------------------------------------------------------------------------

def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h = cfg.hidden_size
    shapes = {"embed_tokens": (cfg.vocab_size, h), "norm": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, h)
    proj = cfg.projection_shapes()
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes[p + "input_layernorm"] = (h,)
        shapes[p + "post_attention_layernorm"] = (h,)
        for name in PROJECTIONS:
            shapes[p + name + ".weight"] = proj[name]
        for name in BIASED:
            shapes[p + name + ".bias"] = (proj[name][0],)
    return shapes


class RefModel:
    """Qwen2 forward pass over host weights; `forward` continues from the cache's length.

    weights: names and shapes of docs/ARCHITECTURE.md "Host weights" (any float dtype; widened
    to fp32 once here).  A tied model may omit `lm_head`; `embed_tokens` is used for it (a
    tied model's file with a quantised lm_head gives its own, dequantised: load_host_weights).
    With `lm_head.exact` and `lm_head.bound` (an INT4 head with fp16 rows beside it) the
    logits are rescored as nq/kernels/lm_head_rescore.py says.
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, np.ndarray], max_len: int | None = None):
        self.cfg = cfg
        expected = _expected_shapes(cfg)
        missing = [n for n in expected if n not in weights]
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise KeyError(f"RefModel: host weights lack {missing[:5]}{more}; "
                           "were they loaded with nq.loader.weights.load_host_weights?")
        self.w = {}
        for name, shape in expected.items():
            a = np.asarray(weights[name], dtype=np.float32)
            if a.shape != shape:
                raise ValueError(f"RefModel: {name} has shape {a.shape}, config {cfg.name} "
                                 f"expects {shape}")
            self.w[name] = a
        if cfg.tie_word_embeddings:
            head = weights.get("lm_head")
            if head is not None and np.shape(head) != expected["embed_tokens"]:
                raise ValueError(f"RefModel: lm_head has shape {np.shape(head)}, config "
                                 f"{cfg.name} expects {expected['embed_tokens']}")
            self.w["lm_head"] = self.w["embed_tokens"] if head is None else np.asarray(head, np.float32)
        # an INT4 head rescored by fp16 rows (load_host_weights gives both for such a file)
        self.rescore = None
        if "lm_head.exact" in weights:
            self.rescore = (np.asarray(weights["lm_head.exact"], np.float32),
                            np.asarray(weights["lm_head.bound"], np.float32))
        self.cache = self.new_cache(max_len)

    def new_cache(self, max_len: int | None = None) -> KVCache:
        return KVCache(self.cfg, max_len)

    def reset(self) -> None:
        """Forget the conversation held in the model's own cache."""
        self.cache.reset()

    def stored(self, point: str, a: np.ndarray) -> np.ndarray:
        """Each activation the GPU engine keeps in fp16 passes here on its way on (point:
        h_qkv, kv, a, h_mlp or m; `layer` says which is which).  Identity: the reference is
        fp32 throughout.  scripts/rounding_model.py overrides it to round some of them."""
        return a

    def layer(self, i: int, x: np.ndarray, positions: np.ndarray, cache: KVCache) -> np.ndarray:
        """One decoder layer on the residual stream x (T, hidden) fp32; writes layer i's K/V."""
        cfg, w, p, st = self.cfg, self.w, f"layers.{i}.", self.stored
        t = x.shape[0]
        h = st("h_qkv", rms_norm(x, w[p + "input_layernorm"], cfg.rms_norm_eps))
        q = linear(h, w[p + "q_proj.weight"], w[p + "q_proj.bias"]).reshape(t, cfg.num_heads, cfg.head_dim)
        k = linear(h, w[p + "k_proj.weight"], w[p + "k_proj.bias"]).reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = linear(h, w[p + "v_proj.weight"], w[p + "v_proj.bias"]).reshape(t, cfg.num_kv_heads, cfg.head_dim)
        q = apply_rope(q, positions, cfg.rope_theta)
        k = apply_rope(k, positions, cfg.rope_theta)
        cache.write(i, st("kv", k), st("kv", v))
        s = cache.length + t
        a = st("a", attention(q, cache.keys(i, s), cache.values(i, s), positions))
        x = x + linear(a.reshape(t, cfg.q_size), w[p + "o_proj.weight"])
        h = st("h_mlp", rms_norm(x, w[p + "post_attention_layernorm"], cfg.rms_norm_eps))
        m = st("m", swiglu(linear(h, w[p + "gate_proj.weight"]),
                           linear(h, w[p + "up_proj.weight"])))
        return x + linear(m, w[p + "down_proj.weight"])

    def forward(self, ids, cache: KVCache | None = None, last_only: bool = False,
                alt_band: float | None = None):
        """Token ids (T,) at positions cache.length.. -> logits (T, vocab) fp32.

        T > 1 is a prefill, T == 1 a decode step; both are the same computation.  Uses the
        model's own cache when none is given.  `last_only` returns (1, vocab) for the last
        position, sparing a (T, vocab) matrix (2.5 GB for 4096 tokens of a 152k vocabulary).
        With `alt_band` (a fraction of each position's logit spread) it returns (logits, alt):
        a rescored INT4 head's alternatives (rescore_alternatives), or the logits twice.
        """
        cache = self.cache if cache is None else cache
        ids = np.asarray(ids).reshape(-1)
        if ids.size == 0:
            raise ValueError("RefModel.forward: no tokens")
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"RefModel.forward: token ids must be integers, got {ids.dtype}")
        if ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
            raise ValueError(f"RefModel.forward: token id out of range [0, {self.cfg.vocab_size})")
        t = ids.shape[0]
        cache.reserve(t)
        positions = np.arange(cache.length, cache.length + t)
        x = self.w["embed_tokens"][ids]  # (T, hidden) fp32 residual stream
        for i in range(self.cfg.num_layers):
            x = self.layer(i, x, positions, cache)
        cache.advance(t)
        if last_only:
            x = x[-1:]
        x = rms_norm(x, self.w["norm"], self.cfg.rms_norm_eps)
        logits = linear(x, self.w["lm_head"])
        if self.rescore is not None:      # an INT4 head's candidates, as the GPU step does
            exact, bound = self.rescore
            alts = []
            for t in range(logits.shape[0]):
                if alt_band is None:
                    logits[t] = rescore_rows(logits[t], bound, x[t], exact)[0]
                else:
                    spread = float(logits[t].max() - logits[t].min())
                    logits[t], alt = rescore_alternatives(logits[t], bound, x[t], exact,
                                                          alt_band * spread)
                    alts.append(alt)
            if alt_band is not None:
                return logits, np.stack(alts)
        if alt_band is not None:
            return logits, logits
        return logits


class NumpyBackend:
    """The generation loop's backend interface (nq/generate.py) over a RefModel.

    Prefill runs in chunks of `chunk` tokens: the attention scores of one chunk are
    (heads, chunk, context) fp32, which for a whole 4096-token prompt of the 7B would be
    1.9 GB; chunks keep it to a few hundred MB at no cost in exactness (the cache makes a
    chunked prefill the same computation).
    """

    def __init__(self, model: RefModel, chunk: int = 256):
        self.model = model
        self.chunk = int(chunk)

    @classmethod
    def from_file(cls, nf, max_len: int | None = None) -> "NumpyBackend":
        """From an open NanoqwenFile: dequantised fp32 host weights (4 bytes per parameter)."""
        from nq.loader.weights import load_host_weights
        return cls(RefModel(nf.config, load_host_weights(nf), max_len=max_len))

    def reset(self) -> None:
        self.model.reset()

    @property
    def length(self) -> int:
        """Tokens in the cache."""
        return self.model.cache.length

    def truncate(self, n: int) -> None:
        """Keep the first n cached tokens (later rows are overwritten by the next forward)."""
        self.model.cache.length = min(int(n), self.model.cache.length)

    def snapshot(self) -> tuple:
        """The cache's contents (a copy), to `restore` later."""
        return self.model.cache.snapshot()

    def restore(self, state: tuple) -> None:
        self.model.cache.restore(state)

    def prefill(self, ids) -> np.ndarray:
        """Append ids (T,) to the context -> logits (vocab,) fp32 of the last position."""
        ids = np.asarray(ids).reshape(-1)
        if ids.size == 0:
            raise ValueError("prefill: no tokens")
        self.model.cache.reserve(ids.size)  # all or nothing: no chunks cached before a refusal
        for s in range(0, ids.size, self.chunk):
            logits = self.model.forward(ids[s:s + self.chunk], last_only=True)
        return logits[0]

    def decode(self, token: int) -> np.ndarray:
        """Append one token -> logits (vocab,) fp32."""
        return self.model.forward(np.array([int(token)]))[0]


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random fp32 host weights for tests, scaled so activations stay O(1) through the layers.

    Projections ~ N(0, 1/K) keep each linear output at unit scale and give attention scores
    and logits a spread of order one, so greedy choices are not decided by rounding noise
    (HF's init std 0.02 makes tiny-model logits nearly flat).  Embeddings are N(0, 0.01): at
    unit scale they dominate the residual stream, and a tied model, whose logits are dot
    products with the same embeddings, then predicts its input token forever.  Not quantised;
    pass the projections through an INT4 round trip where a test needs packable weights.
    """
    rng = np.random.default_rng(seed)
    w: dict[str, np.ndarray] = {}
    for name, shape in _expected_shapes(cfg).items():
        if name.endswith(".weight") or name in ("embed_tokens", "lm_head"):
            fan_in = shape[1]
            scale = 0.1 if name == "embed_tokens" else 1.0 / np.sqrt(fan_in)
            a = rng.standard_normal(shape) * scale
        elif name.endswith(".bias"):
            a = 0.1 * rng.standard_normal(shape)
        else:  # norm gains near 1, as in trained checkpoints
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        w[name] = a.astype(np.float32)
    return w


# ---- the INT4 lm_head's rescoring (nq/kernels/lm_head_rescore.py has the why) -----------------
K_SIGMA = 6.0          # a candidate's bound in sigmas of its INT4 logit's rounding error


def _candidates(logits, bound, h, k_sigma):
    """The rule of nq/kernels/lm_head_rescore.py: (INT4 logits l, the margins l_i + b_i - M,
    h) with b_i = k_sigma * bound_i * |h| / sqrt 12 and M = max_j (l_j - b_j); an id is a
    candidate where its margin is >= 0."""
    h = np.asarray(h, np.float32)
    b = np.float32(k_sigma) * np.asarray(bound, np.float32) * np.float32(
        np.sqrt(np.dot(h.astype(np.float64), h) / 12.0))
    lo = np.asarray(logits, np.float32)
    return lo, lo + b - (lo - b).max(), h


def _exact_rows(exact, ids, h):
    # the fp16 rows' logits at ids (fp32 sums)
    return (np.asarray(exact[ids], np.float32) @ h).astype(np.float32)


def _rescored(lo, cand, h, exact):
    # the INT4 logits lo with the candidates' replaced by the fp16 rows' (one product over
    # exactly the candidates: rescore_rows and rescore_alternatives give the same bits)
    out = lo.copy()
    ids = np.flatnonzero(cand)
    out[ids] = _exact_rows(exact, ids, h)
    return out


def rescore_rows(logits, bound, h, exact, k_sigma: float = K_SIGMA):
    """ref_rescore from h = rmsnorm(x) * norm_w itself (the reference model's head)."""
    lo, margin, h = _candidates(logits, bound, h, k_sigma)
    cand = margin >= 0
    return _rescored(lo, cand, h, exact), cand


def rescore_alternatives(logits, bound, h, exact, band: float, k_sigma: float = K_SIGMA):
    """rescore_rows' logits, and beside them `alt`: the same, except that every id whose
    candidacy is decided by at most `band` (|l_i + b_i - M| <= band, an absolute logit
    margin) carries its other value (the INT4 logit where rescore_rows gave the fp16 one, and
    the other way round).  An engine whose INT4 logits, h or M differ from the reference's by
    rounding may choose either for those ids; `nq verify` accepts either."""
    lo, margin, h = _candidates(logits, bound, h, k_sigma)
    cand = margin >= 0
    out = _rescored(lo, cand, h, exact)
    edge = np.flatnonzero(np.abs(margin) <= band)
    alt = out.copy()
    alt[edge] = np.where(cand[edge], lo[edge], _exact_rows(exact, edge, h))
    return out, alt
