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
ATTN_OPTIONS = {"early": True, "min_pps": 2, "rows_per_copy": 2}
# gate_up_l2 / o_proj_l2 (0: off; opt-ins, waiting for the H200: docs/PERF.md): attn_split asks
# L2 for this fraction of every 16-row tile of the same layer's gate_up (or o_proj) weights
# while the attention's latency leaves DRAM idle (nq/kernels/attention/decode.py,
# "l2_prefetch"); whole 1 KB groups, at least one.  One of the two at a time: the kernel takes
# one weight array.  o_proj's 6.4 MB (7B) fit L2 whole; gate_up's 68 MB do not.
ATTN_STEP_OPTIONS = {"gate_up_l2": 0.0, "o_proj_l2": 0.0}
L2_TARGETS = ("gate_up", "o_proj")   # the GEMVs an attention may prefetch, by ATTN_STEP_OPTIONS key
# True: the qkv_rope GEMV does rope_kv's job in its epilogue (one kernel less a layer): -0.05 ms
# a token at 512, -0.02 at 8K, +0.025 at 32K (step_variants, 2026-11-29, 946790c).
FUSE_ROPE = True


def attention_options(attn=None) -> tuple[dict, tuple[str, float] | None]:
    """(decode_launcher keywords, (GEMV, fraction) its L2 prefetch targets, or None): the
    step's defaults with `attn` over them (an experiment's {keyword: value},
    scripts/step_variants.py).  ValueError when both gate_up_l2 and o_proj_l2 are set."""
    opts = {**ATTN_OPTIONS, **ATTN_STEP_OPTIONS, **(attn or {})}
    wanted = [(t, float(opts.pop(f"{t}_l2"))) for t in L2_TARGETS]
    wanted = [(t, f) for t, f in wanted if f != 0.0]
    if len(wanted) > 1:
        raise ValueError(f"attention L2 prefetch: {' and '.join(f'{t}_l2' for t, _ in wanted)} "
                         "are both set; the kernel prefetches one weight array, pick one")
    return opts, (wanted[0] if wanted else None)


def weight_prefetch(gemv, w, in_features: int, fraction: float, name: str = "gate_up"):
    """decode_launcher's l2_prefetch for a GEMV's weights in the tensor-core layout: the first
    `fraction` of each 16-row tile (whole 1 KB groups, at least one); None when fraction is 0.
    ValueError for a fraction outside [0, 1] or a GEMV on the CUDA-core layout."""
    from nq.config import GROUP_SIZE
    from nq.kernels.int4.layout import TILE
    from nq.kernels.int4.tiling import MmaTiling
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"{name}_l2={fraction}: a fraction of each weight tile, 0..1")
    if fraction == 0.0:
        return None
    if not isinstance(gemv.tiling, MmaTiling):
        hint = " (NQ_MMA_GATE_UP=0)" if name == "gate_up" else ""
        raise ValueError(f"{name}_l2 prefetches {name}'s tensor-core layout (16-row tiles); "
                         f"this engine runs the CUDA-core {name}{hint}")
    group = TILE * GROUP_SIZE // 2                    # a 16-row tile's 128 columns: 1 KB
    run = in_features // GROUP_SIZE * group           # a tile: every group of its 16 rows
    head = max(group, int(fraction * run) // group * group)
    return (w.reshape(-1), run, head)


def gate_up_prefetch(cfg, gemv, gu_w, fraction: float):
    """weight_prefetch for a layer's gate_up (its input is the hidden state)."""
    return weight_prefetch(gemv, gu_w, cfg.hidden_size, fraction, "gate_up")


def layer_prefetch(cfg, g: dict, L, target) -> tuple | None:
    """The l2_prefetch of layer L's attention: `target` is attention_options' (GEMV, fraction)
    or None; g the step's GEMVs by kind."""
    if target is None:
        return None
    kind, fraction = target
    if kind == "gate_up":
        return gate_up_prefetch(cfg, g["gate_up"], L.gu_w, fraction)
    return weight_prefetch(g["o_proj"], L.o_w, cfg.q_size,
                           fraction, "o_proj")


def build_steps(eng, tilings=None, attn=None, check_layout: bool = True,
                fuse_rope: bool | None = None) -> list:
    """(region, launch) in step order; the regions are what `nq bench` breaks the ITL into.
    Shapes are checked here, once.  tilings / attn: see `Engine.variant`."""
    from nq.kernels import attention, embed, feed, lm_head, rope_kv
    from nq.kernels import sampling as argmax
    from nq.kernels.int4 import make_qkv_rope_gemv
    from nq.runtime.weights import gemvs

    c, weights = eng.cfg, eng.w
    opts, l2_target = attention_options(attn)
    tilings = dict(tilings or {})
    rope_tiling = tilings.pop("qkv_rope", None)
    g = gemvs(c, tilings, check_layout)
    qkv_rope = make_qkv_rope_gemv(c, rope_tiling) if (
        FUSE_ROPE if fuse_rope is None else fuse_rope) else None
    if (qkv_rope is not None and check_layout
            and qkv_rope.tiling.layout() != g["qkv"].tiling.layout()):
        raise ValueError(f"qkv_rope tiling {qkv_rope.tiling.tag()} reads another layout than "
                         f"the uploaded qkv weights ({g['qkv'].tiling.tag()}); keep ks")
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
        steps += [
            ("paged_attention", attention.decode_launcher(
                c, eng.q, eng.state, eng.d_table, kv_i, eng.o, eng.part_acc,
                eng.part_ml, **opts,
                l2_prefetch=layer_prefetch(c, g, L, l2_target))),
            ("o_proj", lambda st, L=L: g["o_proj"](eng.o, L.o_w, L.o_s, eng.x, st)),
            ("gate_up_swiglu", lambda st, L=L: g["gate_up"](eng.x, L.post_norm, L.gu_w,
                                                            L.gu_s, eng.a, st)),
            ("down", lambda st, L=L: g["down"](eng.a, L.down_w, L.down_s, eng.x, st)),
        ]
    head = lm_head.make_lm_head(c, weights.lm_head)   # fp16, or int8 rows + scales
    steps.append(("lm_head", lambda st: head(eng.x, weights.norm, weights.lm_head,
                                             eng.logits, st)))
    steps.append(("sample", argmax.argmax_launcher(eng.logits, eng.state, eng.out_ids,
                                                   argmax.argmax_workspace())))
    return steps
