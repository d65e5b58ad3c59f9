"""`nq bench`: prefill and decode speed of the GPU engine as a llama-bench table, with the
ITL broken down by region, the copy ceiling and torch peers measured in the same run.

    nq bench --random 7b -p 512 -n 128 -r 5 --ctx 512,2048,8192,32768 --json out/7b.json

Why one command: a figure is only comparable with the ceiling, clocks and peers of the same
run, so all of them are measured here, side by side, and written to one JSON file, with the
name of every kernel the run built ("kernels": each name spells its tiling and variants).

What is timed (all on eng.stream, CUDA events, clocks never locked):
  pp<p>        a p-token prompt from ids on the host to the first token's logits on the host
               (batched prefill on the tensor cores, then the decode step for the last token);
               TTFT wall clock, prompt tok/s and the prefill's TFLOP/s, for each p of -p
  tg<n>        n decode steps after the prompt, one event per step
  tg<n> sampled  the same with --sampling's settings: the device sampler's graph in place of
               argmax (`default`: Qwen2.5-Instruct's generation_config, T 0.7, top-k 20,
               top-p 0.8, repetition penalty 1.05 over the whole context)
  tg<n> @ d<c> n decode steps with the cache made c tokens long by eng.fake_context
               (attention cost depends on the length, not the values)
  breakdown    per region of eng.regions: a graph of only that region's launches, replayed
               many times; kernel_gap = ITL - sum(regions)
The statistics helpers and the table formatter are plain Python (tests/test_bench_cpu.py);
the torch peers live in nq/tools/peers.py.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from nq.config import DEFAULT_LM_HEAD, PRESETS
from nq.tools.environment import gpu_clocks, versions
from nq.tools.flags import SAMPLING  # its flags live in flags.py, for the parser's sake
from nq.tools.tables import cell, md_table

NO_GPU = ("nq bench needs an NVIDIA GPU with a working CUDA driver (numba.cuda.is_available() "
          "is False{why}); run it on the H100/H200, or use `nq generate --backend numpy` here")


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


# ---- statistics -----------------------------------------------------------------------------
def mean_sd(xs) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1; 0 for a single value)."""
    xs = [float(x) for x in xs]
    if not xs:
        raise ValueError("mean_sd of no values")
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd


def percentile(xs, q: float) -> float:
    """The q-th percentile with linear interpolation between order statistics (numpy's default)."""
    xs = sorted(float(x) for x in xs)
    if not xs:
        raise ValueError("percentile of no values")
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def breakdown(itl_ms: float, regions_ms: dict) -> dict:
    """The ITL split into regions (step order kept) plus kernel_gap = ITL - sum(regions): launch
    latency and the tails where one kernel waits for the previous one.  RMSNorm has no region:
    it is fused into the qkv, gate_up and lm_head GEMVs."""
    return {"itl_ms": float(itl_ms), "regions_ms": {r: float(v) for r, v in regions_ms.items()},
            "norms": "fused", "kernel_gap_ms": float(itl_ms) - sum(regions_ms.values())}


def region_bytes(w, ctx: float) -> dict:
    """Bytes each region of a decode step must read at context ctx (its floor at the copy
    ceiling): the GEMVs their weights, scales, biases and the norm they fuse; attention the K/V
    of ctx tokens; lm_head its rows (+ int8 / INT4 scales) and the final norm; embed one row; sample
    the fp32 logits.  w: the engine's DeviceWeights (shapes and dtypes only: nothing is read)."""
    cfg = w.cfg

    def nb(*arrays):
        return sum(int(a.nbytes) for a in arrays)

    head = w.lm_head
    head_b = nb(head.qweight, head.scales) if hasattr(head, "qweight") else nb(head)
    by = {"embed": cfg.hidden_size * 2,
          "qkv_gemv": sum(nb(L.input_norm, L.qkv_w, L.qkv_s, L.qkv_b) for L in w.layers),
          "paged_attention": kv_bytes(cfg, ctx),
          "o_proj": sum(nb(L.o_w, L.o_s) for L in w.layers),
          "gate_up_swiglu": sum(nb(L.post_norm, L.gu_w, L.gu_s) for L in w.layers),
          "down": sum(nb(L.down_w, L.down_s) for L in w.layers),
          "lm_head": head_b + nb(w.norm),
          "sample": cfg.vocab_size * 4}
    by["rope_kv_append"] = 0     # its K/V row write and q: bytes of the order of a KB
    return by


def with_floors(b: dict, by: dict, ceiling_gbs: float) -> dict:
    """breakdown b plus each region's byte floor (bytes / the copy ceiling) in ms."""
    b = dict(b)
    b["floor_ms"] = {r: by.get(r, 0) / (ceiling_gbs * 1e9) * 1e3 for r in b["regions_ms"]}
    return b


def kv_bytes(cfg, ctx: float) -> float:
    """KV cache bytes attention reads at context ctx: K and V, fp16, every layer."""
    return cfg.num_layers * 2 * ctx * cfg.num_kv_heads * cfg.head_dim * 2


def prefill_flops(cfg, p: int, start: int = 0) -> float:
    """FLOPs of a p-token prefill after `start` cached tokens: the projections (2 per weight a
    token), causal attention (QK^T and PV: 4 * head_dim * heads per (query, key) pair) and
    lm_head at the last position."""
    h = cfg.hidden_size
    per_token = cfg.num_layers * (cfg.qkv_size * h + h * cfg.q_size + 3 * cfg.intermediate_size * h)
    pairs = p * start + p * (p + 1) / 2
    attn = cfg.num_layers * 4 * cfg.head_dim * cfg.num_heads * pairs
    return 2.0 * per_token * p + attn + 2.0 * cfg.vocab_size * h


def make_row(test: str, ctx: float, weights_bytes: int, cfg, ceiling_gbs: float,
             tok_s: list, itl_ms: list | None = None, ttft_ms: list | None = None) -> dict:
    """One table row from raw per-run tok/s (and pooled per-step ITLs / per-run TTFTs).

    A prompt (ttft_ms given) is compute-bound and reads the weights once a chunk, not once a
    token, so bytes/token, GB/s and % of the copy ceiling are left empty for it."""
    m, sd = mean_sd(tok_s)
    b = weights_bytes + kv_bytes(cfg, ctx)
    gbs = None if ttft_ms else b * m / 1e9
    row = {"test": test, "ctx": ctx, "tok_s_mean": m, "tok_s_sd": sd, "tok_s_runs": list(tok_s),
           "bytes_per_token": None if ttft_ms else b, "GBs": gbs,
           "pct_ceiling": None if gbs is None else 100 * gbs / ceiling_gbs,
           "ttft_ms": None, "itl_p50_ms": None, "itl_p90_ms": None}
    if ttft_ms:
        row["ttft_ms"], row["ttft_ms_sd"] = mean_sd(ttft_ms)
        row["ttft_ms_p50"] = percentile(ttft_ms, 50)
        row["ttft_ms_runs"] = list(ttft_ms)
    if itl_ms:
        row["itl_p50_ms"], row["itl_p90_ms"] = percentile(itl_ms, 50), percentile(itl_ms, 90)
        row["itl_ms_all"] = list(itl_ms)
    return row


# ---- formatting -----------------------------------------------------------------------------
def format_table(model: str, rows: list[dict]) -> str:
    """llama-bench's table: one row per test, t/s as mean ± sd."""
    header = ["model", "test", "t/s", "TTFT ms", "ITL p50 ms", "ITL p90 ms", "bytes/token",
              "GB/s", "% of ceiling"]
    body = [[model, r["test"], f"{r['tok_s_mean']:.2f} ± {r['tok_s_sd']:.2f}",
             cell(r["ttft_ms"], ".1f"), cell(r["itl_p50_ms"], ".3f"), cell(r["itl_p90_ms"], ".3f"),
             "-" if r["bytes_per_token"] is None else f"{r['bytes_per_token'] / 1e9:.3f} GB",
             cell(r["GBs"], ".0f"), "-" if r["pct_ceiling"] is None else f"{r['pct_ceiling']:.1f} %"]
            for r in rows]
    return md_table(header, body, right=set(range(2, len(header))))


def format_breakdown(bds: list[dict]) -> str:
    """Regions down; per context the region's ms, its % of the ITL and, where the breakdown
    carries floors (with_floors), the byte floor in ms and the region's % of it (floor / time:
    100 % is the copy ceiling)."""
    header = ["region"]
    for b in bds:
        header += [f"ms @ {b['ctx']}", "% of ITL"]
        if "floor_ms" in b:
            header += ["floor ms", "% of floor"]
    regions = list(bds[0]["regions_ms"]) if bds else []

    def floor_cells(b, f, v):
        if "floor_ms" not in b:
            return []
        return [f"{f:.4f}", f"{100 * f / v:.0f}" if f > 0 and v > 0 else "-"]

    body = []
    for r in regions:
        row = [r]
        for b in bds:
            v = b["regions_ms"][r]
            row += [f"{v:.4f}", f"{100 * v / b['itl_ms']:.1f}"]
            row += floor_cells(b, b.get("floor_ms", {}).get(r, 0.0), v)
        body.append(row)
    body.append(["norms"] + [x for b in bds for x in
                             ["fused", "-"] + (["-", "-"] if "floor_ms" in b else [])])
    body.append(["kernel_gap"] + [x for b in bds for x in
                                  [f"{b['kernel_gap_ms']:.4f}",
                                   f"{100 * b['kernel_gap_ms'] / b['itl_ms']:.1f}"]
                                  + (["-", "-"] if "floor_ms" in b else [])])
    body.append(["ITL"] + [x for b in bds for x in
                           [f"{b['itl_ms']:.4f}", "100.0"]
                           + floor_cells(b, sum(b.get("floor_ms", {}).values()), b["itl_ms"])])
    return md_table(header, body, right=set(range(1, len(header))))


def format_prefill(rows: list[dict]) -> str:
    """The pp rows as a prefill table: TTFT, prompt tok/s and TFLOP/s."""
    body = [[r["test"], f"{r['ttft_ms_p50']:.1f}", f"{r['ttft_ms']:.1f} ± {r['ttft_ms_sd']:.1f}",
             f"{r['tok_s_mean']:.0f}", f"{r['tflops']:.1f}"] for r in rows if "tflops" in r]
    return md_table(["test", "TTFT p50 ms", "TTFT mean ± sd", "prompt tok/s", "TFLOP/s"], body,
               {1, 2, 3, 4})


def footnotes(args, ceiling_gbs: float) -> str:
    p, n = args.p[0], args.n
    return "\n".join([
        ("- ppP: a P-token prompt, ids on the host to the first token's logits on the host "
         "(batched prefill, chunks of up to 2048 tokens, then the decode step for the last "
         "token); t/s = P / TTFT; TFLOP/s = prefill FLOPs / TTFT; bytes/token at context P/2."),
        (f"- tg{n}: {n} decode steps after the {p}-token prompt (CUDA graph, one event per "
         f"step); t/s mean ± sd over {args.r} runs, ITL percentiles over all steps."
         + (f" tg{n} sampled: the same steps with the device sampler in place of argmax "
            f"({args.sampling}: {SAMPLING[args.sampling]})." if getattr(args, "sampling", None)
            else "")),
        ("- tgN @ dC: decode steps with the cache made C tokens long by eng.fake_context; the "
         "pages hold zeros (attention cost depends on the length, not the values)."),
        (f"- bytes/token: weights read once per token + KV read at the step's context; ceiling: "
         f"device-to-device copy in this run, {ceiling_gbs:.0f} GB/s (read + write); clocks "
         "not locked."),
    ])


# ---- measurements (GPU) ---------------------------------------------------------------------
def kernels_built() -> list[str]:
    """The names of the kernels this process built (compiled or loaded), sorted: each spells
    every constant baked in (nq/kernels/build.kernel_name), so a figure in the JSON says which
    tilings and variants made it."""
    from nq.kernels.build import STATS
    return sorted(set(STATS.names))


def copy_ceiling_gbs(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth (read + write bytes / s), numba only."""
    from numba import cuda
    a = cuda.device_array(nbytes // 4, np.float32)
    b = cuda.device_array(nbytes // 4, np.float32)
    s = cuda.stream()
    for _ in range(3):
        b.copy_to_device(a, stream=s)
    e0, e1 = cuda.event(), cuda.event()
    e0.record(s)
    for _ in range(reps):
        b.copy_to_device(a, stream=s)
    e1.record(s)
    e1.synchronize()
    ms = cuda.event_elapsed_time(e0, e1) / reps
    return 2 * nbytes / (ms * 1e-3) / 1e9


def bytes_per_token(eng, ctx: int) -> int:
    """Weights read once per token plus the KV cache read by attention at context ctx."""
    return int(eng.w.nbytes_per_token + kv_bytes(eng.cfg, ctx))


def at_context(eng, ctx: int, ahead: int) -> None:
    """Cache ctx tokens long (zeros), with pages reserved for `ahead` more steps: each timed
    step advances state.pos, and an unreserved table entry would alias page 0."""
    eng.fake_context(ctx)
    eng.reserve_ahead(ahead + 1)


def graph_ms(stream, fn, replays: int, warmup: int = 3, name: str = "graph",
             programmatic: bool = False) -> float:
    """ms per replay of a CUDA graph of fn()'s launches on stream: captured, replayed `warmup`
    times, then `replays` times between two events."""
    from numba import cuda

    from nq.runtime.graphs import CapturedGraph
    g = CapturedGraph(stream, fn, name=name, programmatic=programmatic)
    for _ in range(warmup):
        g.replay()
    e0, e1 = cuda.event(), cuda.event()
    e0.record(stream)
    for _ in range(replays):
        g.replay()
    e1.record(stream)
    e1.synchronize()
    return cuda.event_elapsed_time(e0, e1) / replays


def region_ms(eng, region: str, replays: int) -> float:
    """GPU time per step of one region alone: a graph of only its launches, replayed."""
    eng.stream.synchronize()
    return graph_ms(eng.stream, lambda: eng.run_eager(regions={region}), replays, name=region,
                    programmatic=eng.pdl)


def measure_breakdown(eng, ctx: int, replays: int = 100, steps: int = 32) -> dict:
    """ITL at ctx (median of `steps` graph replays) split into eng.regions + kernel_gap.
    'sample' (argmax) advances state.pos on every replay, so it is timed last and the state
    is put back at ctx afterwards; the other regions leave the state as it was (rope_kv only
    rewrites the KV slot of pos)."""
    at_context(eng, ctx, ahead=steps + 8)
    itl = statistics.median(eng.time_steps(steps))
    at_context(eng, ctx, ahead=8)
    order = [r for r in eng.regions if r != "sample"] + [r for r in eng.regions if r == "sample"]
    ms = {r: region_ms(eng, r, replays) for r in order}
    at_context(eng, ctx, ahead=8)
    b = breakdown(itl, {r: ms[r] for r in eng.regions})
    b["ctx"] = ctx
    return b


def measure_prompt(eng, p: int, runs: int, seed: int, n_after: int = 0):
    """(TTFT ms of each run, per-step ms of n_after decode steps after each run's prompt)."""
    prompt = np.random.default_rng(seed).integers(0, eng.cfg.vocab_size, p)
    ttft, steps = [], []
    for r in range(runs + 1):  # run 0 warms up (clocks, caches) and is dropped
        eng.reset()
        eng.reserve_ahead(p + n_after + 8)  # see at_context
        t0 = time.perf_counter()
        eng.prefill(prompt)  # returns once the logits are on the host
        t = (time.perf_counter() - t0) * 1e3
        s = eng.time_steps(n_after, warmup=0) if n_after else []
        if r:
            ttft.append(t)
            steps.append(s)
    return ttft, steps


def measure_sampled(eng, p: int, n: int, runs: int, seed: int, params) -> list[list[float]]:
    """Per-step ms of n sampled decode steps after a p-token prompt, each run (run 0, which
    also captures the sampled graph, is dropped)."""
    prompt = np.random.default_rng(seed).integers(0, eng.cfg.vocab_size, p)
    steps = []
    for r in range(runs + 1):
        eng.reset()
        eng.reserve_ahead(p + n + 8)
        eng.prefill(prompt)
        eng.set_sampling(params)
        s = eng.time_steps(n, warmup=0, sampled=True)
        if r:
            steps.append(s)
    return steps


def measure_tests(eng, args, ctxs: list, ceiling: float) -> list[dict]:
    """The pp (one per -p), tg and tg @ depth rows (raw figures kept in each row)."""
    cfg, wbytes = eng.cfg, eng.w.nbytes_per_token
    rows = []
    for i, p in enumerate(args.p):
        ttft, steps = measure_prompt(eng, p, args.r, args.seed, args.n if i == 0 else 0)
        row = make_row(f"pp{p}", p / 2, wbytes, cfg, ceiling, [1e3 * p / t for t in ttft],
                       ttft_ms=ttft)
        row["tflops"] = prefill_flops(cfg, p) / (row["ttft_ms_p50"] * 1e-3) / 1e12
        rows.append(row)
        log(f"nq bench: pp{p}: TTFT {row['ttft_ms_p50']:.1f} ms, {row['tok_s_mean']:.0f} tok/s, "
            f"{row['tflops']:.1f} TFLOP/s")
        if i == 0:
            tg_itl = [x for s in steps for x in s]
            tg_tok_s = [1e3 * len(s) / sum(s) for s in steps]
            tg_row = make_row(f"tg{args.n}", p + args.n / 2, wbytes, cfg, ceiling, tg_tok_s,
                              tg_itl)
    rows.insert(1, tg_row)
    if getattr(args, "sampling", None):
        from nq.sample import SamplingParams
        steps = measure_sampled(eng, args.p[0], args.n, args.r, args.seed,
                                SamplingParams(**SAMPLING[args.sampling]))
        row = make_row(f"tg{args.n} sampled", args.p[0] + args.n / 2, wbytes, cfg, ceiling,
                       [1e3 * len(s) / sum(s) for s in steps], [x for s in steps for x in s])
        row["sampling"] = SAMPLING[args.sampling]
        rows.insert(2, row)
        log(f"nq bench: tg{args.n} sampled ({args.sampling}): ITL p50 {row['itl_p50_ms']:.3f} ms "
            f"vs greedy {tg_row['itl_p50_ms']:.3f} ms "
            f"(+{row['itl_p50_ms'] - tg_row['itl_p50_ms']:.3f} ms; target <= +0.050)")
    for c in ctxs:
        tok_s, itl = [], []
        for _ in range(args.r):
            at_context(eng, c, ahead=args.n + 8)
            steps = eng.time_steps(args.n, warmup=3)
            tok_s.append(1e3 * len(steps) / sum(steps))
            itl += steps
        rows.append(make_row(f"tg{args.n} @ d{c}", c + args.n / 2, wbytes, cfg, ceiling, tok_s, itl))
        log(f"nq bench: tg{args.n} @ d{c}: {rows[-1]['tok_s_mean']:.1f} tok/s")
    return rows


def run(args) -> int:
    """`nq bench`: returns the exit code (2 without a GPU)."""
    if args.lm_head and not args.random:
        print("nq: error: --lm-head makes random weights (--random); a file's lm_head is the "
              "one it was packed with (`nq pack --lm-head int8`)", file=sys.stderr)
        return 2
    try:
        from numba import cuda
        ok, why = cuda.is_available(), ""
    except Exception as e:  # noqa: BLE001 -- numba-cuda missing or broken
        ok, why = False, f": {e}"
    if not ok:
        print("nq: error: " + NO_GPU.format(why=why), file=sys.stderr)
        return 2
    from nq.runtime.engine import Engine

    env = {"start": gpu_clocks(), "versions": versions()}
    dev = cuda.get_current_device()
    env["gpu"] = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    ctxs = list(args.ctx)
    p0 = args.p[0]
    max_len = max(list(args.p) + ctxs) + max(args.n, 32) + 16
    t0 = time.perf_counter()
    if args.random:   # the lm_head as `nq pack` writes it unless told
        eng = Engine.random(PRESETS[args.random], max_len=max_len, seed=args.seed,
                            lm_head=args.lm_head or DEFAULT_LM_HEAD)
        source = f"random {args.random}"
    else:
        from nq.loader.resolve import resolve_model
        from nq.loader.format import NanoqwenFile
        path = resolve_model(args.model)
        eng, source = Engine.from_file(NanoqwenFile(path), max_len=max_len), str(path)
    build_s = time.perf_counter() - t0
    cfg = eng.cfg
    head = getattr(eng.w, "lm_head", None)     # an Int8Rows or Int4Rows pair, or fp16 rows
    head_kind = ("" if not hasattr(head, "scales") else
                 ", lm_head int8" if head.qweight.dtype == np.int8 else
                 ", lm_head int4 rescored" if getattr(head, "exact", None) is not None else
                 ", lm_head int4")
    from nq.kernels.int4 import tiling
    env["i8"] = tiling.I8                         # NQ_I8: "1" (default) or "0"
    i8 = {"0": ", no i8", "1": ""}[tiling.I8]     # a departure from NQ_I8=1
    model = (f"{cfg.name} INT4 g128" + head_kind + i8
             + (" (random)" if args.random else ""))
    ceiling = copy_ceiling_gbs()
    log(f"nq bench: {model}: engine built in {build_s:.1f} s (weights {eng.w.load_s:.1f} s), "
        f"{eng.w.nbytes_per_token / 1e9:.3f} GB/token of weights; copy ceiling {ceiling:.0f} GB/s")

    rows = measure_tests(eng, args, ctxs, ceiling)
    bds = []
    for c in dict.fromkeys([p0] + ctxs):
        bds.append(with_floors(measure_breakdown(eng, c, replays=args.replays),
                               region_bytes(eng.w, c), ceiling))
        log(f"nq bench: breakdown @ {c}: ITL {bds[-1]['itl_ms']:.3f} ms, "
            f"kernel_gap {bds[-1]['kernel_gap_ms']:.3f} ms")
    # The same step without programmatic dependent launch: what PDL buys (docs/PERF.md).
    at_context(eng, p0, ahead=40)  # time_steps(32) runs 36 steps; max_len allows p + 48
    eng.capture(pdl=False)
    no_pdl = statistics.median(eng.time_steps(32))
    eng.capture(pdl=True)
    log(f"nq bench: ITL @ {p0} without programmatic dependent launch: {no_pdl:.3f} ms "
        f"(with: {bds[0]['itl_ms']:.3f} ms)")
    peers = {}
    if not args.no_peers:
        from nq.tools.peers import run_peers
        peers = run_peers(cfg, p0, log)
    gemms = []
    if not args.no_gemm and getattr(eng, "prefiller", None) is not None:
        from nq.tools.gemm_table import measure
        gemms = measure(eng, args.gemm, log)
    env["end"] = gpu_clocks()

    print(format_table(model, rows))
    print()
    print("Prefill (TTFT from prompt ids on the host to the first token on the host):")
    print(format_prefill(rows))
    print()
    print(footnotes(args, ceiling))
    print()
    print("ITL breakdown (each region alone in its own graph; kernel_gap = ITL - sum of regions; "
          "floor = the bytes a region reads at this run's copy ceiling, % of floor = floor / time):")
    print(format_breakdown(bds))
    print(f"\nITL @ {p0} with programmatic dependent launch {bds[0]['itl_ms']:.3f} ms, "
          f"without {no_pdl:.3f} ms (same graph, plain kernel edges)")
    if peers:
        from nq.tools.peers import format_peers
        print()
        print(format_peers(peers, rows, bds[0]))
    if gemms:
        print("\nPrefill GEMM per projection (INT4 weights x fp16 activations, each layer's "
              "weights in turn; cuBLAS: fp16 weights, same shapes, same run):")
        from nq.tools.gemm_table import format_gemms
        print(format_gemms(gemms))
    v = env["versions"]
    print(f"\n{env['gpu']}, driver {env['start'].get('driver_version', '?')} (CUDA "
          f"{v['cuda_driver'] or '?'}); nq {v['nq']}, numba {v['numba']}, numba-cuda {v['numba-cuda']}, "
          f"numpy {v['numpy']}, python {v['python']}, torch {v['torch']}")
    print(f"clocks (MHz) at start: SM {env['start'].get('clocks.sm', '?')}, memory "
          f"{env['start'].get('clocks.mem', '?')}; at end: SM {env['end'].get('clocks.sm', '?')}, "
          f"memory {env['end'].get('clocks.mem', '?')}")

    if args.json:
        out = {"nq_bench": 1, "model": model, "source": source, "config": json.loads(cfg.to_json()),
               "args": {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "func"},
               "env": env, "build_s": build_s, "load_s": eng.w.load_s,
               "weights_bytes_per_token": eng.w.nbytes_per_token, "copy_ceiling_GBs": ceiling,
               "tests": rows, "breakdown": bds, "peers": peers, "itl_no_pdl_ms": no_pdl,
               "gemm": gemms, "kernels": kernels_built()}
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        from nq.tools.plots import write_plots
        out["plots"] = write_plots(path.with_suffix(""), rows, bds)
        path.write_text(json.dumps(out, indent=1))
        log(f"nq bench: wrote {path}" + "".join(f", {p}" for p in out["plots"]))
    return 0
