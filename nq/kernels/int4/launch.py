"""The INT4 GEMV launchers: one object per projection, and the make_* functions that pick the
kernel (CUDA cores, gemv.py, or tensor cores, gemv_mma.py) from the tiling.

    g = make_qkv_gemv(cfg)     # make_qkv_rope_gemv / make_o_proj_gemv / make_gate_up_gemv / ...
    qw, sc = g.prepare([(q_qw, q_sc), (k_qw, k_sc), (v_qw, v_sc)])   # host numpy, once
    g(x, norm_w, qw, sc, bias, out, stream)      # qkv     (bias: the q,k,v biases concatenated)
    g(a, qw, sc, x, stream)                      # o_proj, down
    g(x, norm_w, qw, sc, out, stream)            # gate_up (prepare([(gate...), (up...)]))
    g(x, norm_w, qw, sc, bias, state, inv_freq, table, kv_layer, q_out, stream)  # qkv_rope

`prepare` takes the file's (N, K/8) ValueShuffle qweights and (N, K/128) fp16 scales,
concatenates the parts along N and lays the words out as the kernel reads them
(layout.tile_rows or layout.mma_layout; scales keep the file's layout).  Upload its outputs as
they are (nq/runtime/weights.py re-tiles on the GPU instead: retile.py).  A launcher compiles
its kernel once, at construction; a call checks its arguments, takes numba device arrays and
a numba stream, allocates nothing, touches no host memory and is safe to capture in a CUDA
graph.  No workspace: every reduction is inside a block, each output element has one writer.
"""
from __future__ import annotations

import numpy as np

from nq.config import GROUP_SIZE, ModelConfig
from nq.kernels.common import allow_smem, need, sm_count
from nq.kernels.int4.gemv import compile_gemv, gemv_name
from nq.kernels.int4.gemv_mma import check_tiling, compile_gemv_mma, gemv_mma_name, launch_smem
from nq.kernels.int4.layout import mma_layout, prepare_weights
from nq.kernels.int4.tiling import MMA_KINDS, MmaTiling, Tiling, default_tiling
from nq.paged import STATE_LEN, check_paged_args


class _Gemv:
    """One compiled CUDA-core GEMV: its shape, tiling, launch grid, weight preparation and
    argument checks."""

    kind = ""
    heads = None  # qkv_rope: (num_heads, num_kv_heads, head_dim)
    n_multiple = 8   # N must be a multiple of it (the lm_head's vocabulary: any)

    def __init__(self, cfg: ModelConfig, n_out: int, k: int, n_rows: int,
                 tiling: Tiling | None = None):
        if k % GROUP_SIZE or n_out % self.n_multiple:
            raise ValueError(f"{self.kind}: N={n_out}, K={k}; K must be a multiple of "
                             f"{GROUP_SIZE} and N of {self.n_multiple}")
        self.n_out, self.k, self.n_rows = n_out, k, n_rows  # n_rows: weight rows (gate_up: 2N)
        self.tiling = tiling or default_tiling(self.kind, n_out, k, mma=False)
        if isinstance(self.tiling, MmaTiling):
            raise ValueError(f"{self.kind}: {self.tiling.tag()} is a tensor-core tiling; the "
                             f"tensor-core kernel (gemv_mma.py) takes {', '.join(MMA_KINDS)}, "
                             f"each built by its make_<kind>_gemv")
        self.eps = float(cfg.rms_norm_eps)
        t = self.tiling
        self.kernel = compile_gemv(self.kind, n_out, k, t, self.eps, self.heads)
        self.grid = -(-n_out // t.rows_per_block())
        self.block = t.threads
        self.name = gemv_name(self.kind, n_out, k, t, self.eps, self.heads)

    def prepare(self, parts):
        """[(qweight, scales), ...] host arrays in file layout -> (qweight, scales) to upload."""
        qw, sc = prepare_weights(parts, self.tiling.ks)
        if qw.shape[0] != self.n_rows or qw.shape[1] * 8 != self.k:
            raise ValueError(f"{self.name}: prepared weights are {qw.shape}, expected "
                             f"({self.n_rows}, {self.k // 8})")
        return qw, sc

    def _check_weights(self, qw, sc):
        need(qw, f"{self.name} qweight", np.uint32, (self.n_rows, self.k // 8))
        need(sc, f"{self.name} scales", np.float16, (self.n_rows, self.k // GROUP_SIZE), 2)


class QkvGemv(_Gemv):
    kind = "qkv"

    def __call__(self, x, norm_w, qw, sc, bias, out, stream=0):
        """out fp32 (N,) = Wqkv . rmsnorm(x, norm_w) + bias; x fp32 (K,), norm_w/bias fp16."""
        self._check_weights(qw, sc)
        need(x, f"{self.name} x", np.float32, (self.k,))
        need(norm_w, f"{self.name} norm_w", np.float16, (self.k,), 8)
        need(bias, f"{self.name} bias", np.float16, (self.n_out,), 2)
        need(out, f"{self.name} out", np.float32, (self.n_out,), 4)
        self.kernel[self.grid, self.block, stream, 0](x, norm_w, qw, sc, bias, out)


class HeadGemv(_Gemv):
    """The INT4 lm_head (nq/kernels/lm_head_int4.py wraps it): qkv's body without the bias, on
    a persistent grid of `blocks_per_sm` blocks an SM (gemv.py's lm_head kind)."""

    kind = "lm_head"
    n_multiple = 1   # every row is bounds-checked: any vocabulary

    def __init__(self, cfg: ModelConfig, tiling: Tiling | None = None, blocks_per_sm: int = 0,
                 grid: int | None = None):
        super().__init__(cfg, cfg.vocab_size, cfg.hidden_size, cfg.vocab_size, tiling)
        if grid or blocks_per_sm:   # else every row block its own block, as the other kinds
            self.grid = min(self.grid, grid or sm_count() * blocks_per_sm)

    def __call__(self, x, norm_w, qw, sc, out, stream=0):
        """out fp32 (V,) = Wlm . rmsnorm(x, norm_w); x fp32 (K,), norm_w fp16."""
        self._check(x, norm_w, qw, sc, out)
        self.kernel[self.grid, self.block, stream, 0](x, norm_w, qw, sc, out)

    def _check(self, x, norm_w, qw, sc, out):
        self._check_weights(qw, sc)
        need(x, f"{self.name} x", np.float32, (self.k,))
        need(norm_w, f"{self.name} norm_w", np.float16, (self.k,), 8)
        need(out, f"{self.name} out", np.float32, (self.n_out,), 4)


class HeadBoundGemv(HeadGemv):
    """The INT4 lm_head that also bounds its rescoring (gemv.py's lm_head_bound kind,
    nq/kernels/lm_head_rescore.py): bmax fp32 (grid + 1,) gets each block's max of
    logit_i - bound_i * s and, last, s."""

    kind = "lm_head_bound"

    def __call__(self, x, norm_w, qw, sc, out, bound, bmax, stream=0):
        self._check(x, norm_w, qw, sc, out)
        need(bound, f"{self.name} bound", np.float32, (self.n_out,), 4)
        need(bmax, f"{self.name} bmax", np.float32, (self.grid + 1,), 4)
        self.kernel[self.grid, self.block, stream, 0](x, norm_w, qw, sc, out, bound, bmax)


class QkvRopeGemv(_Gemv):
    """qkv's GEMV with rope_kv's job as its epilogue; reads qkv's prepared weights as they are
    (the same `prepare`, and the default tiling keeps qkv's ks)."""

    kind = "qkv_rope"

    def __init__(self, cfg: ModelConfig, tiling: Tiling | None = None):
        self.cfg = cfg   # build_kernel refuses what the RoPE epilogue cannot do (odd head_dim)
        self.heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        super().__init__(cfg, cfg.qkv_size, cfg.hidden_size, cfg.qkv_size, tiling)

    def __call__(self, x, norm_w, qw, sc, bias, state, inv_freq, table, kv_layer, q_out,
                 stream=0):
        """q_out fp32 (Hq*D,) = rope(q), kv_layer[table[pos//16], :, 0/1, pos%16] = fp16 rope(k)
        / v, pos = state[STATE_POS], where [q|k|v] = Wqkv . rmsnorm(x, norm_w) + bias (fp32).
        x fp32 (K,), norm_w/bias fp16, inv_freq fp32 (D/2,) (rope_kv.rope_inv_freq), state and
        table int32, kv_layer (n_pages, Hkv, 2, 16, D) fp16 (nq/runtime/kv_cache.py)."""
        hq, _, d = self.heads
        self._check_weights(qw, sc)
        need(x, f"{self.name} x", np.float32, (self.k,))
        need(norm_w, f"{self.name} norm_w", np.float16, (self.k,), 8)
        need(bias, f"{self.name} bias", np.float16, (self.n_out,), 2)
        need(state, f"{self.name} state", np.int32, (STATE_LEN,), 4)
        need(inv_freq, f"{self.name} inv_freq", np.float32, (d // 2,), 4)
        need(q_out, f"{self.name} q_out", np.float32, (hq * d,), 4)
        check_paged_args(self.name, self.cfg, kv_layer, table, state)
        if len(table.shape) != 1:
            raise ValueError(f"{self.name}: table must be 1-D (max_pages,), got "
                             f"{tuple(table.shape)}")
        self.kernel[self.grid, self.block, stream, 0](x, norm_w, qw, sc, bias, state, inv_freq,
                                                      table, kv_layer, q_out)


class GateUpGemv(_Gemv):
    kind = "gate_up"

    def __call__(self, x, norm_w, qw, sc, out, stream=0):
        """out fp16 (I,) = silu(Wg . h) * (Wu . h), h = rmsnorm(x, norm_w); qw = [gate; up]."""
        self._check_weights(qw, sc)
        need(x, f"{self.name} x", np.float32, (self.k,))
        need(norm_w, f"{self.name} norm_w", np.float16, (self.k,), 8)
        need(out, f"{self.name} out", np.float16, (self.n_out,), 2)
        self.kernel[self.grid, self.block, stream, 0](x, norm_w, qw, sc, out)


class ResidualGemv(_Gemv):
    """o_proj and down on the CUDA cores: x fp32 (N,) += W . a, a fp16 (K,)."""

    def __init__(self, kind, *args, **kw):
        self.kind = kind
        super().__init__(*args, **kw)

    def __call__(self, a, qw, sc, x, stream=0):
        self._check_weights(qw, sc)
        need(a, f"{self.name} a", np.float16, (self.k,), 8)
        need(x, f"{self.name} x", np.float32, (self.n_out,), 4)
        self.kernel[self.grid, self.block, stream, 0](a, qw, sc, x)


class _MmaGemv:
    """One compiled tensor-core GEMV: its own weight layout (`mma_layout`; upload:
    `retile.retile_mma`), launch grid, weight preparation and checks."""

    def __init__(self, kind: str, n_out: int, k: int, n_rows: int, tiling: MmaTiling,
                 eps: float | None = None):
        check_tiling(kind, n_out, k, tiling)
        self.kind, self.n_out, self.k, self.tiling = kind, n_out, k, tiling
        self.n_rows = n_rows   # weight rows (gate_up: 2N, [gate; up])
        self.kernel = compile_gemv_mma(kind, n_out, k, tiling, eps)
        self.grid = -(-n_out // tiling.rows_per_block())
        self.block = tiling.threads
        self.name = gemv_mma_name(kind, n_out, k, tiling, eps)
        # 0 up to the 14B without early; the 32B's down stages 55 KB, early its slots
        self.smem = launch_smem(k, tiling)
        if self.smem:
            allow_smem(self.kernel, self.smem)

    def prepare(self, parts):
        """[(qweight (Ni, K/8) uint32, scales (Ni, K/128) fp16), ...] in file layout, stacked
        along the rows -> (qw, sc) to upload."""
        qs, ss = [np.asarray(q) for q, _ in parts], [np.asarray(s) for _, s in parts]
        for q, s in zip(qs, ss):
            if q.dtype != np.uint32 or q.ndim != 2 or q.shape[1] * 8 != self.k:
                raise ValueError(f"{self.name}: qweight must be uint32 (N, {self.k // 8}), got "
                                 f"{q.dtype} {q.shape}")
            if s.dtype != np.float16 or s.shape != (q.shape[0], self.k // GROUP_SIZE):
                raise ValueError(f"{self.name}: scales must be fp16 "
                                 f"{(q.shape[0], self.k // GROUP_SIZE)}, got {s.dtype} {s.shape}")
        q, s = np.concatenate(qs), np.concatenate(ss)
        if q.shape[0] != self.n_rows:
            raise ValueError(f"{self.name}: {q.shape[0]} weight rows, expected {self.n_rows}")
        return mma_layout(q), np.ascontiguousarray(s)

    def _weights(self, qw, sc):
        # the checked weights, flat (the kernel's signature)
        need(qw, f"{self.name} qweight", np.uint32, (self.n_rows, self.k // 8))
        need(sc, f"{self.name} scales", np.float16, (self.n_rows, self.k // GROUP_SIZE), 2)
        return qw.reshape(qw.size), sc.reshape(sc.size)


def _xacc_words(name, xacc, n):
    """xacc, n int64 as the kernels take them: 2n uint32 words (o_proj.xacc_workspace)."""
    if xacc is None:
        raise ValueError(f"{name}: its tiling reads xacc (attn_o_proj's int64 sums beside x); "
                         f"pass xacc=, or use a tiling without xacc")
    need(xacc, f"{name} xacc", np.uint32, (2 * n,), 16)
    return xacc


class ResidualMmaGemv(_MmaGemv):
    """o_proj and down on the tensor cores: `g(a, qw, sc, x, stream)`, x fp32 (N,) += W . a,
    a fp16 (K,)."""

    def __init__(self, kind: str, n_out: int, k: int, tiling: MmaTiling):
        super().__init__(kind, n_out, k, n_out, tiling)

    def __call__(self, a, qw, sc, x, stream=0, xacc=None):
        """xacc: with a tiling's xacc (down), attn_o_proj's int64 sums (N,) beside x, folded
        into x and zeroed here (o_proj.xacc_workspace)."""
        qw, sc = self._weights(qw, sc)
        need(a, f"{self.name} a", np.float16, (self.k,), 16)
        need(x, f"{self.name} x", np.float32, (self.n_out,), 4)
        if self.tiling.xacc:
            self.kernel[self.grid, self.block, stream, self.smem](
                a, qw, sc, x, _xacc_words(self.name, xacc, self.n_out))
        else:
            self.kernel[self.grid, self.block, stream, self.smem](a, qw, sc, x)


class GateUpMmaGemv(_MmaGemv):
    """gate_up on the tensor cores (the default; NQ_MMA_GATE_UP=0: GateUpGemv): its call, `g(x,
    norm_w, qw, sc, out, stream)`, out fp16 (I,) = silu(Wg . h) * (Wu . h), h = rmsnorm(x,
    norm_w); prepare([(gate_qw, gate_sc), (up_qw, up_sc)]) -> one (2I, K/8) matrix."""

    def __init__(self, cfg: ModelConfig, n_out: int, k: int, tiling: MmaTiling):
        super().__init__("gate_up", n_out, k, 2 * n_out, tiling, float(cfg.rms_norm_eps))

    def __call__(self, x, norm_w, qw, sc, out, stream=0, xacc=None):
        """xacc: with a tiling's xacc, attn_o_proj's int64 sums (K,) beside x: h is
        rmsnorm(x + xacc * 2^-32)."""
        qw, sc = self._weights(qw, sc)
        need(x, f"{self.name} x", np.float32, (self.k,))
        need(norm_w, f"{self.name} norm_w", np.float16, (self.k,), 8)
        need(out, f"{self.name} out", np.float16, (self.n_out,), 2)
        if self.tiling.xacc:
            self.kernel[self.grid, self.block, stream, self.smem](
                x, _xacc_words(self.name, xacc, self.k), norm_w, qw, sc, out)
        else:
            self.kernel[self.grid, self.block, stream, self.smem](x, norm_w, qw, sc, out)


def gemv_shape(kind: str, cfg: ModelConfig) -> tuple[int, int, int]:
    """(N outputs, K inputs, weight rows) of a projection GEMV of cfg (gate_up: 2N rows,
    [gate; up]); qkv_rope has qkv's."""
    c = cfg
    if kind in ("qkv", "qkv_rope"):
        return c.qkv_size, c.hidden_size, c.qkv_size
    if kind == "o_proj":
        return c.hidden_size, c.q_size, c.hidden_size
    if kind == "gate_up":
        return c.intermediate_size, c.hidden_size, 2 * c.intermediate_size
    if kind == "down":
        return c.hidden_size, c.intermediate_size, c.hidden_size
    raise ValueError(f"gemv_shape: {kind!r} is not qkv, qkv_rope, o_proj, gate_up or down")


def gemv_tiling(kind: str, cfg: ModelConfig) -> Tiling | MmaTiling:
    """The tiling make_<kind>_gemv(cfg) builds without one given: its `layout()` is what the
    upload writes (nq/runtime/weights.py asks here, compiling nothing)."""
    n, k, _ = gemv_shape(kind, cfg)
    return default_tiling(kind, n, k)


def make_qkv_gemv(cfg: ModelConfig, tiling: Tiling | None = None) -> QkvGemv:
    """qkv: prepare([(q_qw, q_sc), (k_qw, k_sc), (v_qw, v_sc)]); bias = concat(bq, bk, bv)."""
    return QkvGemv(cfg, *gemv_shape("qkv", cfg), tiling or gemv_tiling("qkv", cfg))


def make_qkv_rope_gemv(cfg: ModelConfig, tiling: Tiling | None = None) -> QkvRopeGemv:
    """qkv_rope: prepare as qkv's (the same uploaded weights serve both); call (x, norm_w, qw,
    sc, bias, state, inv_freq, table, kv_layer, q_out, stream)."""
    return QkvRopeGemv(cfg, tiling or gemv_tiling("qkv_rope", cfg))


def _residual(kind: str, cfg: ModelConfig, tiling):
    n_out, k, _ = gemv_shape(kind, cfg)
    tiling = tiling or gemv_tiling(kind, cfg)
    if isinstance(tiling, MmaTiling):
        return ResidualMmaGemv(kind, n_out, k, tiling)
    return ResidualGemv(kind, cfg, n_out, k, n_out, tiling)


def make_o_proj_gemv(cfg: ModelConfig, tiling: Tiling | MmaTiling | None = None):
    """o_proj: prepare([(o_qw, o_sc)]); call (attn_out fp16, qw, sc, x, stream).  The tensor
    cores' kernel where the tiling is an MmaTiling (the default where `mma_tiling` takes the
    shape)."""
    return _residual("o_proj", cfg, tiling)


def make_gate_up_gemv(cfg: ModelConfig, tiling: Tiling | MmaTiling | None = None):
    """gate_up: prepare([(gate_qw, gate_sc), (up_qw, up_sc)]) -> one (2I, K/8) matrix; call
    (x, norm_w, qw, sc, out, stream).  The tensor cores' kernel where the tiling is an
    MmaTiling (the default unless NQ_MMA_GATE_UP=0: tiling.MMA_GATE_UP)."""
    i, k, rows = gemv_shape("gate_up", cfg)
    tiling = tiling or gemv_tiling("gate_up", cfg)
    if isinstance(tiling, MmaTiling):
        return GateUpMmaGemv(cfg, i, k, tiling)
    return GateUpGemv(cfg, i, k, rows, tiling)


def make_down_gemv(cfg: ModelConfig, tiling: Tiling | MmaTiling | None = None):
    """down: prepare([(down_qw, down_sc)]); call (swiglu_out fp16, qw, sc, x, stream); the
    kernel as make_o_proj_gemv's."""
    return _residual("down", cfg, tiling)
