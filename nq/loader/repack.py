"""A .nanoqwen with another lm_head, made from the file itself: `nq pack OLD.nanoqwen NEW.nanoqwen
[--lm-head KIND]`.

Why: a file packed before int4+fp16 became `nq pack`'s default (nq/config.py DEFAULT_LM_HEAD),
and the packs `nq generate` made of a repo id into the cache, keep the fp16 head alone.  Packing
the HF snapshot again takes minutes and the snapshot, which may be pruned or offline; every
tensor but the head is already in the file, and the head's fp16 rows are too.  So this copies
the file tensor by tensor (checksums checked first: nothing unsound is copied) and makes the
new head from the fp16 rows: the file's `lm_head`, or a tied model's `embed_tokens`.

The one difference from a pack of the snapshot: the INT4 or int8 head is quantised from the
fp16 rows, where `nq pack SNAPSHOT` quantises from the checkpoint's own precision (bf16 for the
Qwen2.5 releases).  bf16 to fp16 is exact but for magnitudes under 2^-14 (fp16's subnormals),
so a group's scale (absmax / 7, absmax >> 2^-14 in any trained head) never moves and a code
moves only for a weight within fp16's spacing of a rounding boundary; from an fp16 checkpoint
the two files are byte for byte the same (tests/loader/test_repack.py).

Public API:
    repack(src, out, lm_head=DEFAULT_LM_HEAD, progress=True) -> Path
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from nq.config import DEFAULT_LM_HEAD, LM_HEADS
from nq.loader.format import CONFIG_TENSOR, NanoqwenFile, expected_tensors, write_nanoqwen
from nq.loader.hf import CONVERT_ROWS, LoadError, _check_space, quantise_rows

__all__ = ["fp16_rows_of", "repack"]


def fp16_rows_of(nf: NanoqwenFile) -> str | None:
    """The tensor of nf holding the lm_head's fp16 rows (what a new head is made from), or None:
    `embed_tokens` when tied, `lm_head` for an fp16 or int4+fp16 file; an untied int8 or int4
    file has none."""
    if nf.config.tie_word_embeddings:
        return "embed_tokens"
    return "lm_head" if nf.lm_head in ("fp16", "int4+fp16") else None


def repack(src, out, lm_head: str = DEFAULT_LM_HEAD, progress: bool = True) -> Path:
    """Write `out`: the .nanoqwen `src` with its lm_head as `lm_head` (LM_HEADS), every other
    tensor, meta file and the source revision as src has them.  Refused before anything is
    written: an unknown kind, a file whose head already is that kind, an untied int8 / int4
    file (no fp16 rows to make a head from), a corrupt src (checksums), too little space."""
    from tqdm import tqdm

    from nq.errors import signals_deferred

    if lm_head not in LM_HEADS:
        raise LoadError(f"lm_head={lm_head!r}: choose one of {', '.join(LM_HEADS)}")
    nf = NanoqwenFile(src)
    if nf.lm_head == lm_head:
        raise LoadError(f"{nf.path}: its lm_head is already {lm_head}; nothing to re-pack "
                        f"(another --lm-head: {', '.join(k for k in LM_HEADS if k != lm_head)})")
    rows = fp16_rows_of(nf)
    if rows is None:
        raise LoadError(f"{nf.path}: its lm_head is {nf.lm_head}, without the fp16 rows a new "
                        f"head is made from; pack the HF snapshot again (`nq pack SNAPSHOT OUT "
                        f"--lm-head {lm_head}`)")
    nf.verify()        # a mismatch raises FormatError naming the tensor: nothing is copied
    cfg = nf.config
    meta = {n[len("meta/"):]: nf.meta(n) for n in nf.names()
            if n.startswith("meta/") and n != CONFIG_TENSOR}
    out = Path(out)
    _check_space(out, cfg, meta, lm_head)
    want = expected_tensors(cfg, lm_head)
    head = nf.array(rows)              # fp16 (V, H), a view of the mapping

    def quantised():
        rows_at = ((r, head[r:r + CONVERT_ROWS].astype(np.float32))
                   for r in range(0, head.shape[0], CONVERT_ROWS))
        q, scales = quantise_rows(lm_head, rows_at, head.shape)
        return {"lm_head.qweight": q, "lm_head.scales": scales}

    def tensors():
        made = {}
        with signals_deferred():
            bar = tqdm(total=len(want), desc=f"re-pack {out.name}", unit="tensor",
                       file=sys.stderr, disable=not progress)
        with bar:
            for name in want:
                if name.startswith("lm_head."):
                    if not made:
                        made = quantised()
                    yield name, made.pop(name)
                else:   # `lm_head` (fp16) from the rows; the rest as the file has them
                    yield name, nf.array(rows if name == "lm_head" else name)
                bar.update(1)

    try:
        return write_nanoqwen(out, cfg, tensors(), meta, nf.header.source_revision,
                              lm_head=lm_head)
    finally:
        nf.close()
