"""The decode attention's launch: the split kernel's name and compiled form for one set of
baked-in constants, and `decode_launcher`, which checks its arguments once and returns the
launch of attn_split (decode.py) then attn_combine (combine.py).  The options' measured
values are plan.py's defaults and the step's (nq/runtime/step.py ATTN_OPTIONS)."""
from __future__ import annotations

import functools

from nq.kernels.attention import combine
from nq.kernels.attention.decode import SPLIT_SIG, SPLIT_SIG_TMA, split_body
from nq.kernels.attention.plan import (CONSUMERS, MIN_PPS, NSTAGE, ROWS_PER_COPY,
                                       check_attention_args, cta_smem_bytes, smem_bytes, tma_spec)
from nq.kernels.build import compile_kernel, kernel_name
from nq.kernels.common import STATIC_SMEM_LIMIT, allow_smem


def split_name(gqa, head_dim, num_kv, consumers, nstage, rows_per_copy, max_splits, min_pps,
               early, ppc=0, tma=False, tma_from=0, trigger=False) -> str:
    """e.g. attn_split_gqa7_d128_kv4_c1_st3_rpc2_splits66_minpps2_early1: consumers (c),
    stages (st), rows per copy (rpc); ppc the pages a consumer, tma the tensor-map copies and
    tfrom the pages a split they start at (`decode_launcher`)."""
    extra = {}
    if ppc:
        extra["ppc"] = ppc
    if tma:
        extra["tma"] = True
    if tma and tma_from:
        extra["tfrom"] = tma_from
    if trigger:
        extra["trig"] = True
    return kernel_name("attn_split", gqa=gqa, d=head_dim, kv=num_kv, c=consumers, st=nstage,
                       rpc=rows_per_copy, splits=max_splits, minpps=min_pps, early=bool(early),
                       **extra)


@functools.cache
def split_kernel(gqa: int, head_dim: int, num_kv: int, consumers: int, nstage: int,
                 rows_per_copy: int, max_splits: int, min_pps: int, early: bool,
                 ppc: int = 0, tma: bool = False, tma_from: int = 0,
                 trigger: bool = False):
    """attn_split compiled for sm_90, launched as [(max_splits, num_kv), (consumers + 1) * 32,
    stream, smem_bytes(...)]."""
    key = (gqa, head_dim, num_kv, consumers, nstage, rows_per_copy, max_splits, min_pps,
           bool(early), int(ppc), bool(tma), int(tma_from) if tma else 0, bool(trigger))
    sig = SPLIT_SIG_TMA if tma else SPLIT_SIG
    return compile_kernel(split_body(*key), sig, split_name(*key), fastmath=True)


def decode_launcher(cfg, q, state, table, kv_layer, o, part_acc, part_ml, *,
                    consumers: int = CONSUMERS, nstage: int = NSTAGE,
                    rows_per_copy: int = ROWS_PER_COPY, min_pps: int = MIN_PPS,
                    early: bool = False, ppc: int = 0,
                    tma: bool = False, tma_from: int = 0, merge: bool = True,
                    trigger: bool = False):
    """Check the arguments once; return `launch(stream=0)` running attn_split then attn_combine.

    q (num_heads*head_dim,) f32 (rope_kv's output), state int32 (STATE_LEN,), table int32
    (max_pages,), kv_layer (n_pages, num_kv_heads, 2, 16, head_dim) f16 (nq/paged.py),
    o (num_heads*head_dim,) f16, part_acc / part_ml from decode_workspace (max_splits is
    part_acc.shape[0]).  The context length is state[STATE_POS] + 1 at run time; the caller
    guarantees table covers it.  part_acc and part_ml must not be shared by two launches that
    can run at the same time.

    consumers: warps = pages a stage; nstage: stages; rows_per_copy: token rows a bulk copy
    (1, 2, 4, 8, 16 or 32); min_pps: fewest pages a split (plan.py); early: read the split plan
    and copy every page but the last before griddepcontrol.wait -- only a launch with a
    programmatic (PDL) edge can start early, so elsewhere it changes nothing; in the step graph
    it saved 0.007..0.009 ms (docs/PERF.md 0.3) and the engine turns it on (nq/runtime/step.py
    ATTN_OPTIONS).
    ppc: 0 -- every split's pages over all `consumers`; k > 0 -- over min(consumers, pps // k)
    of them, pps the plan's pages a split (plan.split_plan), so that one kernel serves short
    contexts with one consumer and no merge and long ones with all of them.
    tma: a page comes as one tensor-map copy a 64-dim half (nq/ptx/tensormap.py) into a
    128-byte swizzled slot with no padding (plan.py), instead of 2*16/rows_per_copy bulk copies
    into padded rows; the launcher encodes kv_layer's tensor map once, here.  tma_from: k > 0
    -- the tensor-map copies only for splits of k pages or more (long contexts), the bulk copies
    below, chosen in the kernel from the plan as ppc is.
    merge: False -- attn_split alone, its partials left for attn_o_proj (o_proj.py), which
    merges them itself; o is then not written.  trigger: the split kernel launches its
    dependents at each CTA's start (for attn_o_proj, whose weights then load before it waits).
    (`fresh`, the last page copied before the wait too and its new row patched from loads
    beside q's, tied in the step on the H100 three times and on the H200: retired after
    83f4990, which holds it.)
    """
    gqa, d, hq, hkv = cfg.gqa_ratio, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    check_attention_args(cfg, q, state, table, kv_layer, o, part_acc, part_ml)
    if not 1 <= consumers <= 8 or not 1 <= nstage <= 8 or rows_per_copy not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"attention: unsupported consumers={consumers} (1..8), nstage={nstage} "
                         f"(1..8), rows_per_copy={rows_per_copy} (1, 2, 4, 8, 16 or 32)")
    if int(tma_from) < 0:
        raise ValueError(f"attention: tma_from={tma_from} must be 0 (always) or the fewest "
                         f"pages a split takes the tensor-map copies at (>= 1)")
    if int(ppc) < 0:
        raise ValueError(f"attention: ppc={ppc} must be 0 (every consumer) or the pages a "
                         f"consumer takes (>= 1)")
    ms = part_acc.shape[0]
    split = split_kernel(gqa, d, hkv, consumers, nstage, rows_per_copy, ms, min_pps, bool(early),
                         ppc=int(ppc), tma=bool(tma), tma_from=int(tma_from),
                         trigger=bool(trigger))
    combiner = combine.combine_kernel(d, ms, min_pps) if merge else None
    merge_threads = combine.combine_threads(d)
    acc_flat, ml_flat = combine.flat_partials(part_acc, part_ml)
    tfrom = int(tma_from) if tma else 0
    nbytes = smem_bytes(d, consumers, nstage, rows_per_copy, tma=bool(tma), tma_from=tfrom)
    if cta_smem_bytes(d, consumers, nstage, rows_per_copy, bool(tma), tfrom) > STATIC_SMEM_LIMIT:
        allow_smem(split, nbytes)
    threads = (consumers + 1) * 32
    if tma:
        from nq.ptx.tensormap import encode
        tmap = encode(kv_layer, tma_spec(kv_layer.shape))
        args = (q, state, table, kv_layer, part_acc, part_ml, tmap)
    else:
        args = (q, state, table, kv_layer, part_acc, part_ml)

    def launch(stream=0):
        split[(ms, hkv), threads, stream, nbytes](*args)
        if merge:
            combiner[hq, merge_threads, stream](state, acc_flat, ml_flat, o)

    return launch
