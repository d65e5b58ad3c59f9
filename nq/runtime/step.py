"""The decode step's kernels in order, one (region, launch) pair each: what the engine captures
as its graph and what `nq bench` breaks the ITL into (the regions).  The per-layer order and
what each kernel fuses is nq/runtime/engine.py's module doc; the options below were chosen in
the whole step graph (scripts/step_variants.py), where a kernel's neighbours start beside it
under programmatic dependent launch."""
from __future__ import annotations


# attention.decode_launcher options of the step, chosen in the whole step graph by
# scripts/step_variants.py.  Measured in the step (docs/PERF.md): early copies -0.007 ms;
# min_pps 2 (at least two pages a split, so 16 splits at 512 tokens) -0.013 ms at 512, nothing
# at 8K; two rows a bulk copy (alone, 4 won) -0.008 / -0.029 / -0.017 ms at 512 / 8K / 32K.
# Four consumer warps, one for every two pages of a split (ppc 2: a 512-token context's
# two-page splits keep one consumer and no merge): -0.004 / -0.022 / -0.056 / -0.211 ms at
# 512 / 2K / 8K / 32K (H200, 2026-12-02; four consumers on every split: +0.048 at 512).
# Every page by tensor-map copies into swizzled slots (tma), four stages of four pages (128 KB
# of slots: one CTA an SM) and one wave of splits, `split_width`: 33 a kv head for the 7B, 132
# CTAs, where there were 66 (two CTAs an SM, three stages, tensor maps from 12 pages a split).
# At 8K only about half of the 66-wide grid's CTAs fit beside qkv_rope's blocks and copy their
# pages before qkv_rope ends; the 33-wide one all do, and with four stages a split's 16 pages
# are all in flight at once.  Against that default, ms a step at 512 / 1K / 2K / 4K / 8K / 16K /
# 32K (H200, 2026-12-03, scripts/step_variants.py "attn.max_splits=33 attn.nstage=4
# attn.tma_from=1"): -0.006 / +0.002 / +0.013 / -0.021 / **-0.104** / +0.007 / +0.011.  The
# bulk copies lose in this grid (one producer an SM issuing 16 copies a page): tma from 4 pages
# +0.018 / +0.013 at 1K / 2K, from 20 +0.108 at 8K; 22 splits -0.029 at 4K but +0.040 at 32K;
# three stages -0.059 at 8K; five or six stages as four; six consumers +0.03..0.04 at 16K / 32K
# (docs/PERF.md 0.19).  Before, tma from 12 pages had measured +0.011 / +0.005..0.009 / -0.044 /
# -0.155 ms at 512 / 8K / 16K / 32K against none (docs/PERF.md 0.10).
ATTN_OPTIONS = {"early": True, "min_pps": 2, "rows_per_copy": 2, "consumers": 4, "ppc": 2,
                "nstage": 4, "tma": True, "tma_from": 0}
# Retired after the H200 measured them (2026-12-02; a3fddf4 holds them): the attention asking
# L2 for gate_up's weight tiles (+0.033..+0.062 ms at 512) or o_proj's (+0.004 / -0.004),
# while its latency seemed to leave DRAM idle.  Retired after 342710b, which holds it: the merge
# in a thread block cluster ("attn.cluster=16", +0.022..+2.16 ms a step, and no attn_o_proj
# beside it; docs/KERNELS_ATTN.md, retired variants).
# Retired (2026-12-03; 9b8ae46 holds it): a second, short-context step graph up to 2048 tokens
# whose attention was one CTA a kv head writing o (`direct`), +0.166 / +0.278 ms at 512 / 1024
# (docs/KERNELS_ATTN.md, retired variants).
# True: the qkv_rope GEMV does rope_kv's job in its epilogue (one kernel less a layer): -0.05 ms
# a token at 512, -0.02 at 8K, +0.025 at 32K (step_variants, 2026-11-29, 946790c).
FUSE_ROPE = True

# The attention's merge and o_proj: 0, attn_combine then the o_proj GEMV; 1, one kernel,
# attn_o_proj (nq/kernels/attention/o_proj.py: a block a head and row chunk, its weights loaded
# before the wait, the heads' shares summed by the last block of a chunk); 2 (the default), the
# same kernel adding the shares as fixed-point int64 into xacc, which gate_up reads beside x and
# down folds into x (MmaTiling.xacc).  The split kernel launches attn_o_proj at its CTAs' start
# (`trigger`).  ms a step at 512 / 8K / 32K against 0 (H200, 2026-12-06, docs/PERF.md 0.23):
# 2 **-0.059 / -0.053 / -0.062** (the 14B -0.073 / -0.031 at 4 tiles a warp), 1 -0.011 / -0.003
# / -0.006, 1 without the early trigger +0.046 / +0.048 / +0.056.  Where o_proj, gate_up or
# down run on the CUDA cores (the 0.5B's widths) the step keeps 0.  Experiments: "attn.fuse_o=0",
# "attn.o_tpw=2" (tiles a warp), "attn.trigger=0", "attn.o_i8=0" (attn_o_proj's o in fp16; by
# default its digits on the int8 tensor cores, gemv_mma.py "i8": -0.012 / -0.005 / -0.008 ms a
# step, H100, 2026-12-07; off by default with NQ_I8=0).
FUSE_O = 2


def o_tiles_per_warp(cfg, sms: int | None = None) -> int:
    """attn_o_proj's tiles a warp: the fewest whose grid (K/128 groups x row chunks) is at most
    three blocks an SM, else 4 -- the 7B's 2 (392 blocks), the 14B's and 32B's 4 (400).  On
    the H200 the 7B's 1 / 2 / 3 / 4 measured +0.058 / 0 / -0.001 / +0.001 ms a step at 512
    against 2, the 14B's 4 -0.007 / -0.012 at 512 / 8K against 2 (docs/PERF.md 0.23)."""
    from nq.kernels.attention.o_proj import MAX_TPW, n_chunks
    from nq.kernels.common import sm_count
    sms = sms or sm_count()
    groups = cfg.num_heads * cfg.head_dim // 128
    for t in range(1, MAX_TPW + 1):
        if groups * n_chunks(cfg.hidden_size, t) <= 3 * sms:
            return t
    return MAX_TPW


# Retired (2026-12-03; 20358ec holds it): l2_pace, a kernel on a side stream forked after a
# layer's down and joined before its gate_up, asking L2 for the head of each of gate_up's tiles
# while the attention chain ran.  One warp: +1.0..+5.0 ms a step (one SM's bulk-prefetch unit
# moves ~0.3 TB/s and gate_up waited for it at the join); 16-64 CTAs: -0.001..+0.056 (docs/
# PERF.md 0.15).  A layer's own next weights asked of L2 from inside its GEMV won instead
# (MmaTiling.l2ahead, 0.16).
# Retired (2026-12-03; bc19524 holds it): a layer's MLP as one kernel (gemv_mlp.py, step_variants
# "mlp.slots=8"): gate_up, a grid barrier, then down through a ring of slots first filled beside
# gate_up's stream; +0.13..+0.32 ms a step, 40.1-44.3 us a layer alone against the two kernels'
# 35.9 (docs/PERF.md 0.18).
# Retired: stream-K down into xacc (docs/PERF.md 0.24; code at c922c89).


def fused_o(cfg, fuse_o: int, tilings: dict, asked: bool = False) -> int:
    """The FUSE_O form cfg's step runs: fuse_o, or 0 where o_proj (and for 2 gate_up or down)
    runs on the CUDA cores -- an error if an experiment asked for it (`asked`).  For 2 it puts
    gate_up's and down's tilings with xacc into `tilings` (kind -> tiling, the experiment's
    own or the default)."""
    if not fuse_o:
        return 0
    import dataclasses

    from nq.kernels.attention.o_proj import HEAD_DIMS
    from nq.kernels.int4.launch import gemv_tiling
    from nq.kernels.int4.tiling import MmaTiling
    kinds = ("o_proj", "gate_up", "down") if fuse_o == 2 else ("o_proj",)
    tl = {k: tilings.get(k) or gemv_tiling(k, cfg) for k in kinds}
    cores = [k for k in kinds if not isinstance(tl[k], MmaTiling)]
    if cores and asked:
        raise ValueError(f"attn.fuse_o={fuse_o}: {cores[0]}'s weights are in the CUDA-core "
                         f"layout ({tl[cores[0]].tag()}); it needs the tensor-core one "
                         f"(an MmaTiling)")
    if cores or cfg.head_dim not in HEAD_DIMS:
        return 0      # the default, where this width keeps those GEMVs on the CUDA cores
    if fuse_o == 2:   # gate_up and down with xacc (MmaTiling.xacc)
        tilings.update({k: dataclasses.replace(tl[k], xacc=1) for k in ("gate_up", "down")})
    return fuse_o


def split_width(cfg, opts=None) -> int:
    """The step's split kernel grid a kv head: one wave of as many CTAs an SM as their slots
    leave room for (at most two) -- one at head_dim 128, whose four stages of slots are 128 KB
    (ATTN_OPTIONS' figures), two at 64 (not measured apart: the two-CTA grid it had before).
    opts: decode_launcher's keywords (attention_options; the step's by default)."""
    from nq.kernels.attention.plan import cta_smem_bytes, ctas_an_sm, one_wave_splits
    from nq.kernels.common import sm_count
    o = opts or ATTN_OPTIONS
    smem = cta_smem_bytes(cfg.head_dim, o["consumers"], o["nstage"], o["rows_per_copy"],
                          o["tma"], o["tma_from"])
    return one_wave_splits(cfg.num_kv_heads, sm_count(), ctas_an_sm(smem))


def attention_options(attn=None) -> dict:
    """decode_launcher's keywords: the step's defaults with `attn` over them (an experiment's
    {keyword: value}, scripts/step_variants.py)."""
    return {**ATTN_OPTIONS, **(attn or {})}


def build_steps(eng, tilings=None, attn=None, check_layout: bool = True,
                fuse_rope: bool | None = None) -> list:
    """(region, launch) in step order; the regions are what `nq bench` breaks the ITL into.
    Shapes are checked here, once.  tilings / attn: see `Engine.variant`."""
    from nq.kernels import attention, embed, feed, lm_head, rope_kv
    from nq.kernels import sampling as argmax
    from nq.kernels.int4 import make_qkv_rope_gemv
    from nq.kernels.int4 import tiling as tiling_mod
    from nq.kernels.int4.launch import gemv_tiling
    from nq.runtime.weights import gemvs

    c, weights = eng.cfg, eng.w
    attn = dict(attn or {})
    opts = attention_options(attn)
    # the split kernel's grid width a kv head, `split_width`, or an experiment's
    # (step_variants "attn.max_splits=66"): the first rows of the engine's partial buffers,
    # which decode_workspace sized for plan.default_max_splits (two CTAs an SM)
    asked_o = "fuse_o" in opts     # an experiment's, refused where it cannot run (below)
    fuse_o = int(opts.pop("fuse_o", FUSE_O))
    if fuse_o not in (0, 1, 2):
        raise ValueError(f"attn.fuse_o={fuse_o}: 0 (attn_combine + o_proj), 1 (attn_o_proj) or "
                         f"2 (attn_o_proj into xacc)")
    o_tpw = int(opts.pop("o_tpw", 0) or o_tiles_per_warp(c))
    o_i8 = bool(opts.pop("o_i8", tiling_mod.O_I8))   # on unless NQ_I8=0
    ms = int(opts.pop("max_splits", None) or split_width(c, opts))
    if not 1 <= ms <= eng.part_acc.shape[0]:
        raise ValueError(f"attn max_splits={ms}: the engine's partials hold 1.."
                         f"{eng.part_acc.shape[0]} splits")
    part_acc, part_ml = eng.part_acc[:ms], eng.part_ml[:ms]
    tilings = dict(tilings or {})
    rope_tiling = tilings.pop("qkv_rope", None)
    o_fused = xacc = None
    fuse_o = fused_o(c, fuse_o, tilings, asked_o)
    use_rope = FUSE_ROPE if fuse_rope is None else fuse_rope
    # the launchers the step runs, and only those compiled: no qkv GEMV beside qkv_rope, no
    # o_proj GEMV beside attn_o_proj
    g = gemvs(c, tilings, check_layout, kinds=[k for k in ("qkv", "o_proj", "gate_up", "down")
                                               if not (k == "qkv" and use_rope)
                                               and not (k == "o_proj" and fuse_o)])
    if fuse_o:
        from nq.kernels.attention.o_proj import make_o_proj_launcher, xacc_workspace
        opts.setdefault("trigger", True)
        if fuse_o == 2:
            xacc = xacc_workspace(c.hidden_size)
        o_fused = make_o_proj_launcher(c, eng.state, part_acc, part_ml, eng.x,
                                       int(opts["min_pps"]), o_tpw, xacc, o_i8)
    qkv_rope = make_qkv_rope_gemv(c, rope_tiling) if use_rope else None
    qkv_t = tilings.get("qkv") or gemv_tiling("qkv", c)   # what the upload wrote
    if (qkv_rope is not None and check_layout
            and qkv_rope.tiling.layout() != qkv_t.layout()):
        raise ValueError(f"qkv_rope tiling {qkv_rope.tiling.tag()} reads another layout than "
                         f"the uploaded qkv weights ({qkv_t.tag()}); keep ks")
    acc = {"xacc": xacc} if xacc is not None else {}
    steps = [("embed", feed.feed_launcher(eng.prompt, eng.feed_meta, eng.state)),
             ("embed", embed.embed_launcher(weights.embed, eng.state, eng.x))]
    for i, L in enumerate(weights.layers):
        kv_i = eng.kv[i]
        if qkv_rope is not None:
            steps.append(("qkv_gemv", lambda st, L=L, kv_i=kv_i: qkv_rope(
                eng.x, L.input_norm, L.qkv_w, L.qkv_s, L.qkv_b, eng.state, eng.inv_freq,
                eng.d_table, kv_i, eng.q, st)))
        else:
            steps += [
                ("qkv_gemv", lambda st, L=L: g["qkv"](eng.x, L.input_norm, L.qkv_w, L.qkv_s,
                                                      L.qkv_b, eng.qkv, st)),
                ("rope_kv_append", rope_kv.rope_kv_launcher(
                    c, eng.qkv, eng.state, eng.inv_freq, eng.d_table, kv_i, eng.q))]
        steps.append(("paged_attention", attention.decode_launcher(
            c, eng.q, eng.state, eng.d_table, kv_i, eng.o, part_acc, part_ml,
            merge=not fuse_o, **opts)))
        if fuse_o:
            steps.append(("o_proj", lambda st, L=L: o_fused(L.o_w, L.o_s, st)))
        else:
            steps.append(("o_proj", lambda st, L=L: g["o_proj"](eng.o, L.o_w, L.o_s, eng.x, st)))
        steps += [
            ("gate_up_swiglu", lambda st, L=L: g["gate_up"](eng.x, L.post_norm, L.gu_w,
                                                            L.gu_s, eng.a, st, **acc)),
            ("down", lambda st, L=L: g["down"](eng.a, L.down_w, L.down_s, eng.x, st, **acc)),
        ]
    head = lm_head.make_lm_head(c, weights.lm_head)   # fp16, or int8 rows + scales
    steps.append(("lm_head", lambda st: head(eng.x, weights.norm, weights.lm_head,
                                             eng.logits, st)))
    steps.append(("sample", argmax.argmax_launcher(eng.logits, eng.state, eng.out_ids,
                                                   argmax.argmax_workspace())))
    return steps
