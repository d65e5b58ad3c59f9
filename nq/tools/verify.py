"""`nq verify -m MODEL`: check this GPU's results against the references, in five tiers.

    unit     each kernel on the model's real shapes (layer 0's weights) against its NumPy
             reference: the four INT4 GEMVs, lm_head, rope_kv, paged attention, embed, argmax
    layer    decoder layer 0 through the engine's own launches against nq.ref's layer
    prefill  the batched tensor-core prefill: the last position's logits of prompts of
             several lengths (one token, odd lengths, more than one 2,048-token chunk) and of
             a prompt that continues a cached context, against the reference engine's
    decode   teacher-forced decode: each prompt's reference greedy continuation fed to the
             engine one decode step at a time, every step's logits against the reference's at
             the same position (max |logit - reference| over the spread; the median and the
             worst step are reported: the precision figure of the bandwidth issue, whose target
             at the 7B width is DECODE_TARGET)
    graph  N prompts x T greedy tokens from the captured decode graph against a reference
           engine: transformers' Qwen2ForCausalLM in fp32 (batched on the GPU when torch is
           importable; the fast path for a 7B), else the NumPy engine.  For every prompt that
           differs, the first divergence is examined: if the reference's top-2 logits there
           are within rounding of each other (gap below TIE_TOL of the logits' spread), the
           choice was a coin toss for any fp16 engine and the prompt counts as explained.

Tolerances are the kernel tests' (tests/test_*_gpu.py say why): INT4 GEMVs 5e-3 and lm_head
1e-5 of the output norm, attention rtol 2e-3 / atol 1e-3, rope q 1e-5, a layer 5e-3.
The tiers print a pass/fail table; the exit code is 0 only when all pass.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import time

import numpy as np

from nq.tools.references import Greedy, top2, make_reference

TOL_INT4, TOL_HEAD, TOL_LAYER = 5e-3, 1e-5, 5e-3
TIE_TOL = 2e-3  # reference top-2 gap, as a fraction of max - min logit, that rounding can flip
# prefill tier: max |logit - reference| over the reference's spread (max - min).  The decode
# graph measures 2.5e-3 (median; max 3.5e-3) of the spread on a 2-layer 7B-width model: fp16
# activations and INT4 GEMVs that accumulate 32-128 weights in fp16.  The prefill GEMM folds
# the group scale into fp16 (+~2e-4 relative a weight) and accumulates in fp32, so it should
# sit no higher; 1e-2 leaves room for long prompts without hiding a wrong row or position
# (those move logits by a large fraction of the spread).
TOL_PREFILL = 1e-2
# decode tier: the same measure at every teacher-forced decode step.  The target for the fp32-
# accumulating projections is 5e-4 of the spread at the 7B width.  Measured on the H200
# (2026-12-02, tests/runtime/test_engine_gpu.py's 2-layer 7B-width model of nq.ref's init):
# median 8.5e-4, max 1.2e-3 with qkv's fp16 partials; since docs/PERF.md 0.30 the default step
# is fp32-accurate (H100, 2026-12-07: 3.56e-4 / 4.78e-4; qkv's digits summed by dp4a, gate_up's
# and o_proj's on the int8 mma), as NQ_MMA_QKV=1 had been before it was retired (qkv on the
# tensor cores, h staged as fp16 hi + lo: 3.6e-4 / 4.8e-4).  The pass line is the prefill
# tier's, which catches a wrong position or row without failing an engine that is merely
# short of the target.
TOL_DECODE, DECODE_TARGET = 1e-2, 5e-4
# A rescored INT4 head (nq/kernels/lm_head_rescore.py): an id whose candidacy is decided by a
# margin the engine's rounding can move (twice the tier's tolerance of the spread: its INT4
# logit and M each within it) may carry either its fp16 or its INT4 logit; the prefill and
# decode tiers accept either there (nq.ref.rescore_alternatives).  Without the rule a 7B-width
# head puts a few ids a step on that edge, each off by its INT4 error (~1e-2 of the spread).
ALT_BAND = 2 * TOL_DECODE


@dataclasses.dataclass
class Row:
    tier: str
    name: str
    error: float
    tol: float
    detail: str = ""

    @property
    def passed(self) -> bool:
        return bool(np.isfinite(self.error)) and self.error <= self.tol


def rel(got, ref) -> float:
    """||got - ref|| / ||ref|| in float64; inf for any non-finite output."""
    got = np.asarray(got, np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


@functools.lru_cache(maxsize=1)  # the unit and layer tiers both read layer 0
def layer_weights(nf, i: int) -> dict:
    """Host fp32 weights of layer i (ARCHITECTURE.md names), projections dequantised."""
    from nq.loader.hf import host_names
    from nq.loader.weights import host_tensor
    p = f"layers.{i}."
    return {n: host_tensor(nf, n) for n in host_names(nf.config) if n.startswith(p)}


# ---- unit tier --------------------------------------------------------------------------------
def unit_tier(eng, nf, seed: int = 0) -> list[Row]:
    from numba import cuda

    from nq.kernels import embed, lm_head, rope_kv
    from nq.kernels import sampling as argmax
    from nq.kernels import attention
    from nq.kernels.int4.reference import ref_gate_up, ref_o_proj, ref_qkv
    from nq.loader.format import INT4_HEADS
    from nq.loader.weights import host_tensor
    from nq.paged import PAGE, gather_kv, pool_shape
    from nq.runtime.kv_cache import make_state
    from nq.runtime.weights import gemvs

    cfg, L, g, rng = nf.config, eng.w.layers[0], gemvs(nf.config), np.random.default_rng(seed)
    w, p, eps = layer_weights(nf, 0), "layers.0.", cfg.rms_norm_eps
    s = eng.stream
    rows = []

    x = rng.standard_normal(cfg.hidden_size).astype(np.float32)
    out = cuda.device_array(cfg.qkv_size, np.float32)
    g["qkv"](cuda.to_device(x), L.input_norm, L.qkv_w, L.qkv_s, L.qkv_b, out, s)
    ref = ref_qkv(x, w[p + "input_layernorm"], eps,
                  np.vstack([w[p + f"{n}_proj.weight"] for n in "qkv"]),
                  np.concatenate([w[p + f"{n}_proj.bias"] for n in "qkv"]))
    rows.append(Row("unit", f"qkv GEMV {cfg.qkv_size}x{cfg.hidden_size}", rel(out.copy_to_host(stream=s), ref), TOL_INT4))

    for kind, k, wname in (("o_proj", cfg.q_size, "o_proj"), ("down", cfg.intermediate_size, "down_proj")):
        a = rng.standard_normal(k).astype(np.float16)
        dx = cuda.to_device(x)
        g[kind](cuda.to_device(a), getattr(L, "o_w" if kind == "o_proj" else "down_w"),
                getattr(L, "o_s" if kind == "o_proj" else "down_s"), dx, s)
        ref = ref_o_proj(a, w[p + f"{wname}.weight"], x)
        rows.append(Row("unit", f"{kind} GEMV {cfg.hidden_size}x{k} (+residual)",
                        rel(dx.copy_to_host(stream=s) - x, ref - x), TOL_INT4))

    out = cuda.device_array(cfg.intermediate_size, np.float16)
    g["gate_up"](cuda.to_device(x), L.post_norm, L.gu_w, L.gu_s, out, s)
    ref = ref_gate_up(x, w[p + "post_attention_layernorm"], eps, w[p + "gate_proj.weight"],
                      w[p + "up_proj.weight"])
    rows.append(Row("unit", f"gate_up GEMV + SwiGLU 2x{cfg.intermediate_size}x{cfg.hidden_size}",
                    rel(out.copy_to_host(stream=s), ref), TOL_INT4))

    logits = cuda.device_array(cfg.vocab_size, np.float32)
    hw = eng.w.lm_head
    if nf.lm_head in INT4_HEADS:   # the INT4 kernel's own logits (the step rescores near the top)
        hw = hw._replace(exact=None, bound=None)
    head = lm_head.make_lm_head(cfg, hw)
    head(cuda.to_device(x), eng.w.norm, hw, logits, s)
    # exact sums but an INT4 head too wide for its digits (fp16 partials, as the GEMVs')
    tol = TOL_INT4 if nf.lm_head in INT4_HEADS and not head.tiling.i8 else TOL_HEAD
    # the file's lm_head as the reference engine reads it (int8 / int4: dequantised)
    ref = lm_head.ref_lm_head(x, np.asarray(nf.array("norm"), np.float32), eps,
                              host_tensor(nf, "lm_head"))
    host_logits = logits.copy_to_host(stream=s)
    rows.append(Row("unit", f"lm_head {nf.lm_head} {cfg.vocab_size}x{cfg.hidden_size}",
                    rel(host_logits, ref), tol))

    state, ring, ws = make_state(), cuda.device_array(4, np.int32), argmax.argmax_workspace()
    argmax.argmax_launcher(logits, state, ring, ws)(s)
    tok = int(state.copy_to_host(stream=s)[0])
    rows.append(Row("unit", "argmax", float(tok != int(np.argmax(host_logits))), 0.0,
                    f"token {tok}"))

    xe = cuda.device_array(cfg.hidden_size, np.float32)
    embed.embed_launcher(eng.w.embed, make_state(token=tok), xe)(s)
    rows.append(Row("unit", "embed", rel(xe.copy_to_host(stream=s), np.asarray(nf.array("embed_tokens")[tok], np.float32)), 0.0))

    for pos in (0, 17, min(4095, eng.max_len - 1)):
        n_pages = pos // PAGE + 2
        table = rng.permutation(n_pages).astype(np.int32)
        pool = cuda.to_device(np.zeros(pool_shape(cfg, n_pages)[1:], np.float16))
        qkv = rng.standard_normal(cfg.qkv_size).astype(np.float32)
        dq = cuda.device_array(cfg.q_size, np.float32)
        inv = cuda.to_device(rope_kv.rope_inv_freq(cfg.head_dim, cfg.rope_theta))
        rope_kv.rope_kv_launcher(cfg, cuda.to_device(qkv), make_state(pos=pos), inv,
                                 cuda.to_device(table), pool, dq)(s)
        q_ref, _, _ = rope_kv.rope_kv_reference(cfg, qkv, pos)
        rows.append(Row("unit", f"rope_kv at position {pos}", rel(dq.copy_to_host(stream=s), q_ref.reshape(-1)), 1e-5))

    for length in (1, 17, min(1000, eng.max_len)):
        need = -(-length // PAGE)
        pool_h = rng.standard_normal(pool_shape(cfg, need + 3)[1:]).astype(np.float16)
        table = np.zeros(need + 1, np.int32)
        table[:need] = rng.permutation(need + 3)[:need]
        q = (2.0 * rng.standard_normal(cfg.q_size)).astype(np.float32)
        o = cuda.device_array(cfg.q_size, np.float16)
        pa, pm = attention.decode_workspace(cfg)  # the engine's kernel
        attention.decode_launcher(cfg, cuda.to_device(q), make_state(pos=length - 1),
                                  cuda.to_device(table), cuda.to_device(pool_h), o, pa, pm)(s)
        k, v = gather_kv(pool_h, table, length)
        ref = attention.attention_reference(q.reshape(cfg.num_heads, cfg.head_dim), k, v)
        got = o.copy_to_host(stream=s).astype(np.float64).reshape(ref.shape)
        # the tests' rtol 2e-3 / atol 1e-3, as one number: the worst |err| / (atol + rtol |ref|)
        err = float(np.max(np.abs(got - ref) / (1e-3 + 2e-3 * np.abs(ref))))
        rows.append(Row("unit", f"paged attention, {length} tokens", err, 1.0, "max |err|/(atol+rtol|ref|)"))
    return rows


# ---- layer tier -------------------------------------------------------------------------------
def layer_tier(eng, nf, token: int = 7) -> Row:
    """Layer 0 at position 0: feed + embed + the layer's launches, eagerly, against nq.ref."""
    from nq.ref import KVCache, RefModel

    cfg = nf.config
    eng.reset()
    eng._start_prompt([token], batched=False)
    # feed, embed, then layer 0's launches: everything up to and including its first `down`
    # (counted from the step list, so fusing or splitting a layer's kernels cannot shift it)
    n = next(i for i, (region, _) in enumerate(eng.steps) if region == "down") + 1
    for _, launch in eng.steps[:n]:
        launch(eng.stream)
    got = eng.x.copy_to_host(stream=eng.stream)
    eng.reset()
    one = cfg.replace(num_layers=1)
    w = layer_weights(nf, 0)
    w.update(embed_tokens=np.asarray(nf.array("embed_tokens"), np.float32),
             norm=np.asarray(nf.array("norm"), np.float32))
    if not cfg.tie_word_embeddings:
        w["lm_head"] = w["embed_tokens"]  # unused by .layer; keeps RefModel's name check happy
    model = RefModel(one, w)
    x0 = w["embed_tokens"][token][None]
    ref = model.layer(0, x0, np.array([0]), KVCache(one, max_len=4))[0]
    return Row("layer", "decoder layer 0 (residual stream after it)", rel(got, ref), TOL_LAYER)


# ---- graph tier -------------------------------------------------------------------------------
def engine_greedy(backend, prompt, n) -> list[int]:
    """Greedy ids from any nq backend (the GPU engine decodes them on the device)."""
    from nq.generate import generate
    from nq.sample import SamplingParams
    ids, _ = generate(backend, list(prompt), n, SamplingParams(temperature=0.0, repeat_penalty=1.0))
    return ids


def compare(got: list[list[int]], ref: list[Greedy]) -> dict:
    """Agreement, and for each differing prompt the first divergence and whether the
    reference's top-2 logits there were within rounding (gap <= TIE_TOL * spread)."""
    mismatches = []
    for i, (g, r) in enumerate(zip(got, ref)):
        if list(g) == r.ids:
            continue
        k = next((j for j, (a, b) in enumerate(zip(g, r.ids)) if a != b), min(len(g), len(r.ids)))
        gap = r.gaps[k] if k < len(r.gaps) else float("nan")
        rel_gap = gap / r.spreads[k] if k < len(r.spreads) and r.spreads[k] > 0 else float("nan")
        mismatches.append({"prompt": i, "step": k, "engine": g[k] if k < len(g) else None,
                           "reference": r.ids[k] if k < len(r.ids) else None,
                           "ref_top2_gap": gap, "gap_over_spread": rel_gap,
                           "within_rounding": bool(rel_gap <= TIE_TOL)})
    return {"prompts": len(got), "identical": len(got) - len(mismatches),
            "mismatches": mismatches,
            "unexplained": sum(not m["within_rounding"] for m in mismatches)}


def graph_tier(backend, reference, prompts, n) -> tuple[Row, dict]:
    ref = reference.greedy(prompts, n)
    got = [engine_greedy(backend, p, n) for p in prompts]
    res = compare(got, ref)
    detail = (f"{res['identical']}/{res['prompts']} identical; "
              f"{len(res['mismatches']) - res['unexplained']} near-tie divergences; "
              f"reference: {reference.name}")
    name = f"{len(prompts)} prompts x {n} greedy tokens"
    return Row("graph", name, float(res["unexplained"]), 0.0, detail), res


# ---- prefill tier ---------------------------------------------------------------------------
def logit_error(got, ref, alt=None) -> float:
    """max |got - ref| / (max(ref) - min(ref)); inf for any non-finite logit.  With alt (the
    reference's alternatives, ALT_BAND), each id's nearer of ref and alt."""
    got = np.asarray(got, np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    d = np.abs(got - ref)
    if alt is not None:
        d = np.minimum(d, np.abs(got - alt))
    return float(d.max() / max(float(ref.max() - ref.min()), 1e-30))


def decode_tier(backend, reference, prompts, n) -> Row:
    """Teacher-forced decode: the reference's n greedy tokens after each prompt are fed to the
    engine's decode step one at a time (its own choices never enter), and the logits of every
    step are compared with the reference's at the same position, from one forward over prompt
    + continuation.  The row's error is the worst step's max |logit - reference| / spread."""
    errs = []
    for prompt, run in zip(prompts, reference.greedy(prompts, n)):
        fed = run.ids[:-1]
        ref, alt = reference.all_logits_pair(list(prompt) + fed, ALT_BAND)
        ref = ref[len(prompt):]
        alt = alt[len(prompt):]
        backend.reset()
        backend.prefill(prompt)
        errs += [logit_error(backend.decode(tok), r, a) for tok, r, a in zip(fed, ref, alt)]
    backend.reset()
    if not errs:
        return Row("decode", "teacher-forced decode steps", float("nan"), TOL_DECODE,
                   "no steps: give --tokens 2 or more")
    e = np.asarray(errs)
    detail = (f"median {np.median(e):.2e}, max {e.max():.2e} of the spread over {e.size} steps; "
              f"target {DECODE_TARGET:g} (met at the 7B width by default; NQ_I8=0 gives "
              f"back qkv's fp16 partials)")
    return Row("decode", f"{len(prompts)} prompts x {n - 1} teacher-forced decode steps, logits",
               float(e.max()), TOL_DECODE, detail)


def prefill_tier(backend, reference, lengths, seed: int = 0, vocab: int = 32000) -> list[Row]:
    """Last-position logits after a prompt of each length (and after a prompt that continues a
    cached one: the second half of the longest, on top of its first half), engine against the
    reference.  The engine runs its own prefill: batched on the GPU engine."""
    rng = np.random.default_rng(seed)
    hi = min(vocab, 32000)
    rows = []

    def check(name, parts):
        backend.reset()
        for part in parts:
            got = backend.prefill(part)
        ref, alt = reference.last_logits_pair([t for part in parts for t in part], ALT_BAND)
        err = logit_error(got, ref, alt)
        top = int(np.argmax(got)) == int(np.argmax(ref))
        _, gap, spread = top2(ref)
        detail = ("top-1 agrees" if top else
                  f"top-1 differs (reference top-2 gap {gap / max(spread, 1e-30):.1e} of the spread)")
        rows.append(Row("prefill", name, err, TOL_PREFILL, detail))

    for n in lengths:
        check(f"{n}-token prompt, last logits", [rng.integers(0, hi, n).tolist()])
    n = max(lengths)
    if n >= 2:
        ids = rng.integers(0, hi, n).tolist()
        check(f"{n - n // 2} tokens after {n // 2} cached", [ids[: n // 2], ids[n // 2:]])
    backend.reset()
    return rows


# ---- the command ------------------------------------------------------------------------------
def table(rows: list[Row]) -> str:
    lines = ["| tier | check | error | tolerance | result | detail |",
             "| --- | --- | ---: | ---: | --- | --- |"]
    for r in rows:
        lines.append(f"| {r.tier} | {r.name} | {r.error:.3g} | {r.tol:.3g} | "
                     f"{'pass' if r.passed else 'FAIL'} | {r.detail} |")
    return "\n".join(lines)


def run(args) -> int:
    import json

    from numba import cuda

    from nq.loader.resolve import resolve_model
    from nq.loader.format import NanoqwenFile

    tiers = {t.strip() for t in args.tiers.split(",") if t.strip()}
    if not tiers or tiers - {"unit", "layer", "prefill", "decode", "graph"}:
        print(f"nq verify: --tiers {args.tiers!r}: choose from unit, layer, prefill, decode, "
              "graph (comma-separated)", file=sys.stderr)
        return 2
    try:
        lengths = sorted({int(x) for x in args.prefill_lengths.split(",") if x.strip()})
    except ValueError:
        lengths = []
    if not lengths or lengths[0] < 1:
        print(f"nq verify: --prefill-lengths {args.prefill_lengths!r}: give positive token "
              "counts, comma-separated (e.g. 1,17,300,2100)", file=sys.stderr)
        return 2
    if not cuda.is_available():
        print("nq verify needs an NVIDIA GPU (numba.cuda.is_available() is False); it checks "
              "this GPU's kernels against the references", file=sys.stderr)
        return 2
    from nq.runtime.engine import Engine

    t0 = time.perf_counter()
    nf = NanoqwenFile(resolve_model(args.model))
    cfg = nf.config
    lengths = [n for n in lengths if n < cfg.max_position_embeddings]
    eng = Engine.from_file(nf, max_len=max(4096, args.prompt_len + args.tokens + 8,
                                           max(lengths, default=0) + 8))
    rows, report = [], {"model": str(nf.path), "config": cfg.to_json()}
    secs = {"load": time.perf_counter() - t0}  # upload + kernel compilation

    def timed(name, fn):
        t = time.perf_counter()
        out = fn()
        secs[name] = time.perf_counter() - t
        return out

    if "unit" in tiers:
        rows += timed("unit", lambda: unit_tier(eng, nf))
    if "layer" in tiers:
        rows.append(timed("layer", lambda: layer_tier(eng, nf)))
    ref = None
    if tiers & {"prefill", "decode", "graph"}:
        ref = timed("reference load", lambda: make_reference(nf, args.reference))
    if "prefill" in tiers and lengths:
        rows += timed("prefill", lambda: prefill_tier(eng, ref, lengths, args.seed, cfg.vocab_size))
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(0, min(cfg.vocab_size, 32000), (args.prompts, args.prompt_len)).tolist()
    if "decode" in tiers:
        rows.append(timed("decode", lambda: decode_tier(eng, ref, prompts[:args.decode_prompts],
                                                        args.tokens)))
    if "graph" in tiers:
        row, report["graph"] = timed("graph", lambda: graph_tier(eng, ref, prompts, args.tokens))
        rows.append(row)
    seconds = time.perf_counter() - t0
    report["seconds_by_part"] = secs
    print(table(rows))
    print("nq verify: " + ", ".join(f"{k} {v:.1f} s" for k, v in secs.items()), file=sys.stderr)
    ok = bool(rows) and all(r.passed for r in rows)
    gpu = cuda.get_current_device().name
    gpu = gpu.decode() if isinstance(gpu, bytes) else gpu  # bytes or str across numba-cuda versions
    print(f"nq verify: {'PASS' if ok else 'FAIL'} in {seconds:.0f} s ({gpu}, {cfg.name})",
          file=sys.stderr)
    if args.json:
        report.update(rows=[dataclasses.asdict(r) | {"passed": r.passed} for r in rows],
                      seconds=seconds, passed=ok)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if ok else 1
