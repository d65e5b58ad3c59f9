"""Host (fp32 NumPy) weights for the reference engine, and the fake-quantised HF weights tests use.

`load_host_weights` turns a .nanoqwen file into the dict the NumPy reference reads: every
projection dequantised from its INT4 ValueShuffle words to fp32 `layers.{i}.{proj}.weight`
(N, K), a quantised lm_head dequantised (int8: q * row scale; int4: as a projection), every
other tensor widened from fp16.  `fake_quantize` applies the same rounding to a dict of float
weights (HF or our names) without a file, so transformers, the reference and the GPU engine
can be compared on identical weights.
"""
from __future__ import annotations

import os
import re

import numpy as np

from nq.config import ModelConfig
from nq.loader.format import INT4_HEADS, NanoqwenFile
from nq.loader.hf import hf_name, host_names
from nq.loader.quant import (dequantize_int8_rows, dequantize_packed, fake_quantize_matrix,
                             row_bounds)

_PROJ_WEIGHT = re.compile(r"(^|\.)(q|k|v|o|gate|up|down)_proj\.weight$")


def host_tensor(nf: NanoqwenFile, name: str) -> np.ndarray:
    """One fp32 host weight by its host name: a projection or a quantised lm_head
    dequantised, anything else widened."""
    if name == "lm_head" and nf.lm_head == "int8":
        return dequantize_int8_rows(nf.array("lm_head.qweight"), nf.array("lm_head.scales"))
    if name == "lm_head" and nf.lm_head in INT4_HEADS:   # the projections' form: their dequantiser
        return dequantize_packed(nf.array("lm_head.qweight"), nf.array("lm_head.scales"))
    if name.endswith("_proj.weight"):
        base = name[:-len(".weight")]
        return dequantize_packed(nf.array(base + ".qweight"), nf.array(base + ".scales"))
    return nf.array(name).astype(np.float32)


def load_host_weights(nf: NanoqwenFile) -> dict[str, np.ndarray]:
    """fp32 host weights under our names (docs/ARCHITECTURE.md); `lm_head` is the same array
    as `embed_tokens` when the embeddings are tied, unless the file's lm_head is quantised
    (int8, int4): then it is that, dequantised (tied or not), so the reference computes what
    the file holds; an INT4 head that the GPU step rescores also gives `lm_head.exact` (the
    fp16 rows) and `lm_head.bound` (RefModel rescores as the step does)."""
    out = {name: host_tensor(nf, name) for name in host_names(nf.config)}
    if nf.lm_head != "fp16":
        out["lm_head"] = host_tensor(nf, "lm_head")
    elif nf.config.tie_word_embeddings:
        out["lm_head"] = out["embed_tokens"]
    rows = rescore_rows_of(nf)
    if rows is not None:    # the GPU step rescores the INT4 head's candidates with these
        # (out["lm_head"] is the dequantised INT4 head: the kept fp16 one comes from the file)
        out["lm_head.exact"] = (out["embed_tokens"] if rows == "embed_tokens" else
                                nf.array(rows).astype(np.float32))
        out["lm_head.bound"] = row_bounds(nf.array("lm_head.scales"))
    return out


def rescore_rows_of(nf: NanoqwenFile) -> str | None:
    """The file tensor holding the fp16 rows that rescore nf's INT4 head (nq/kernels/
    lm_head_rescore.py) -- "embed_tokens" (tied), or "lm_head", which an "int4+fp16" file
    keeps -- or None (no INT4 head, no fp16 rows beside it, or NQ_RESCORE=0)."""
    if nf.lm_head not in INT4_HEADS or not rescore_enabled():
        return None
    if nf.config.tie_word_embeddings:
        return "embed_tokens"
    return "lm_head" if nf.lm_head == "int4+fp16" else None


def fake_quantize(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What a .nanoqwen file would hold, back in fp32: the seven projections become
    dequantize(quantize(w)), every other float tensor is rounded through fp16 (as `pack`
    stores it).  Keys are kept, so this works on HF names and on ours."""
    out = {}
    for name, w in weights.items():
        w = np.asarray(w, np.float32)
        out[name] = fake_quantize_matrix(w) if _PROJ_WEIGHT.search(name) else \
            w.astype(np.float16).astype(np.float32)
    return out


def hf_to_host(cfg: ModelConfig, hf_weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rename HF-named weights to host names (fp32, no rounding); tied lm_head aliases the embedding."""
    out = {name: np.asarray(hf_weights[hf_name(name)], np.float32) for name in host_names(cfg)}
    if cfg.tie_word_embeddings:
        out["lm_head"] = out["embed_tokens"]
    return out


def rescore_enabled() -> bool:
    """NQ_RESCORE=0 loads an INT4 head without its fp16 rows (the INT4 head's logits alone,
    as `nq pack --lm-head int4` files of untied models always run)."""
    return os.environ.get("NQ_RESCORE", "1") != "0"
