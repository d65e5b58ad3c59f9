"""The INT4 lm_head GEMV, final RMSNorm fused: logits fp32 (V,) = Wlm . rmsnorm(x, w_norm).

Public API (the fp16 head's, nq/kernels/lm_head.py, with the weight an `Int4Rows` pair;
`lm_head.make_lm_head(cfg, weight)` picks this launcher for one, rescoring when the weight
carries the fp16 rows):

    head = make_lm_head_int4(cfg)              # LmHeadInt4; its GEMV in .gemv (tiling, grid)
    qw, sc = head.prepare(file_qweight, file_scales)    # host numpy, once (or the GPU re-tile)
    head(x, norm_w, weight, logits, stream)    # x fp32 (H,), norm_w fp16 (H,),
                                               # weight Int4Rows(qweight uint32 (V, H/8),
                                               #                 scales fp16 (V, H/128)),
                                               # logits fp32 (V,)
    ref_lm_head_int4(x, norm_w, eps, qweight, scales)   # NumPy reference (file layout)

Why: the fp16 head is 1.09 GB of the 7B's ~4.49 GB a decode step reads, 0.26 ms of the H200's
1.65 ms token at 512 context; `nq pack --lm-head int4` stores it as the projections are (INT4
g128, ValueShuffle nibbles, fp16 group scales: nq/loader/quant.py), 0.28 GB, so a step reads
~0.8 GB less.  It costs accuracy the int8 head (one scale a row, 8 bits) does not:
scripts/lm_head_quality.py measures both against the fp16 head.  Where the fp16 rows are at
hand too (a tied model's embedding), each step's candidates -- the ids whose INT4 logit lies
within its rounding bound of the top -- are rescored by them (nq/kernels/lm_head_rescore.py):
the fp16 head's greedy token, for the INT4 head's bytes and a few rows.

The kernel is the CUDA-core GEMV's (nq/kernels/int4/gemv.py, kind lm_head): qkv's body
without the bias -- every block stages rmsnorm(x) * w_norm as digits and sums a group's
products exactly with dp4a (gemv_digits.py), so the logits are the fp32 reference's over the
dequantised weights to ~1e-6 of their norm.  A vocabulary of rows is ~1,200 of qkv's row
blocks, so the grid is persistent (`blocks_per_sm` blocks an SM, each staging once and
walking row blocks), where one block a row block would stage rmsnorm(x) ~1,200 times.  The
weights are re-tiled for the kernel at upload (`prepare`; the GPU's re-tile in
nq/runtime/weights.py), as the projections' are.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from nq.config import ModelConfig
from nq.kernels.int4.launch import HeadBoundGemv, HeadGemv
from nq.kernels.int4 import tiling as tilings
from nq.kernels.int4.tiling import Tiling
from nq.kernels.lm_head_rescore import make_rescore
from nq.loader.quant import dequantize_packed
from nq.ref import linear, rms_norm

BLOCKS_PER_SM = 2     # the persistent grid (head_tiling's min_blocks keeps two resident)


class Int4Rows(NamedTuple):
    """An INT4 lm_head on the device, as its GEMV reads it: qweight uint32 (V, H/8) re-tiled
    (`LmHeadInt4.prepare`), scales fp16 (V, H/128); with `exact`, the fp16 head (V, H) (the
    tied embedding, or a file's kept fp16 lm_head) and `bound`, fp32 (V,) each row's largest
    scale (nq.loader.quant.row_bounds): the candidates of each step are rescored by it."""
    qweight: object
    scales: object
    exact: object = None
    bound: object = None

    @property
    def nbytes(self) -> int:
        """Bytes a step reads (the rescored rows are ~0.1 % of `exact`: not counted)."""
        return self.qweight.nbytes + self.scales.nbytes

    @property
    def shape(self) -> tuple:
        return (self.qweight.shape[0], self.qweight.shape[1] * 8)


def ref_lm_head_int4(x, norm_w, eps, qweight, scales):
    """x fp32 (H,), norm_w (H,), qweight uint32 (V, H/8) and scales fp16 (V, H/128) in the
    file's layout -> logits fp32 (V,)."""
    return linear(rms_norm(x, norm_w, eps), dequantize_packed(qweight, scales))


def head_tiling(cfg: ModelConfig) -> Tiling:
    """The tiling the head runs (and the upload re-tiles for): tiling.head_tiling's."""
    return tilings.head_tiling(cfg.hidden_size)


class LmHeadInt4:
    """logits fp32 (V,) = dequant(weight) . rmsnorm(x, norm_w); see the module doc."""

    def __init__(self, cfg: ModelConfig, tiling: Tiling | None = None,
                 blocks_per_sm: int = BLOCKS_PER_SM, grid: int | None = None,
                 rescore: bool = False, rescore_grid: int | None = None):
        self.vocab, self.k = cfg.vocab_size, cfg.hidden_size
        # rescore: a weight's `exact` rows rescore each step's candidates (lm_head_rescore.py),
        # and the GEMV bounds them as it writes the logits
        gemv = HeadBoundGemv if rescore else HeadGemv
        self.gemv = gemv(cfg, tiling or head_tiling(cfg), blocks_per_sm, grid)
        g = self.gemv
        self.tiling, self.grid, self.name, self.kernel = g.tiling, g.grid, g.name, g.kernel
        self.rescore = make_rescore(cfg, g.grid, grid=rescore_grid) if rescore else None

    def prepare(self, qweight, scales) -> tuple[np.ndarray, np.ndarray]:
        """The file's (V, H/8) words and (V, H/128) scales -> what to upload (host NumPy)."""
        return self.gemv.prepare([(qweight, scales)])

    def __call__(self, x, norm_w, weight: Int4Rows, logits, stream=0):
        if self.rescore is None:
            self.gemv(x, norm_w, weight.qweight, weight.scales, logits, stream)
            return
        if weight.exact is None or weight.bound is None:
            raise ValueError(f"{self.name}: built to rescore with the fp16 head, but the "
                             "weight has no `exact` rows or `bound`")
        self.gemv(x, norm_w, weight.qweight, weight.scales, logits, weight.bound,
                  self.rescore.bmax, stream)
        self.rescore(x, norm_w, weight.exact, logits, weight.bound, stream)


def make_lm_head_int4(cfg: ModelConfig, **tiling) -> LmHeadInt4:
    """The INT4 head's launcher (tiling=, blocks_per_sm= or grid= to override the defaults;
    rescore=True: bounding the rescoring as it writes, and lm_head_rescore's kernel after it;
    rescore_grid= that kernel's grid)."""
    return LmHeadInt4(cfg, **tiling)
