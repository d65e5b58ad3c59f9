"""Per-kernel timeline of decode steps inside the captured graph, from CUPTI (torch.profiler).

`nq bench` times each region alone and `step_variants.py --leave-out` times the step without
one; neither shows where, inside one replay, the time goes when the kernels overlap under
programmatic dependent launch.  CUPTI's kernel activity records every kernel of a graph
replay with its start and end (numba and torch share the device's primary context, and CUPTI
traces the whole process), so this script replays the 7B-shaped step under torch.profiler and
reads the trace back:

    python3 scripts/step_timeline.py --ctx 512 --steps 8 --trace $OUT/step.json

For each kernel of a step: its start and end (us from the step's first kernel start) and its
*critical increment* -- how far its end moves the step's latest end so far.  The increments of
a step add up to the step's span, and their sum by region is what each region costs inside the
step (a kernel that finishes under another one's shadow costs nothing).  The medians over the
steps are printed; the Chrome trace (--trace) opens in chrome://tracing or Perfetto.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# kernel-name fragment -> region (the engine's region names; first match wins)
# (attn_o_proj, the merge and o_proj in one kernel, counts as o_proj, as `nq bench` times it)
REGIONS = [("feed", "embed"), ("embed", "embed"), ("qkv_rope", "qkv_gemv"),
           ("gemv_int4_qkv", "qkv_gemv"), ("rope_kv", "rope_kv_append"),
           ("attn_split", "paged_attention"), ("attn_combine", "paged_attention"),
           ("attn_o_proj", "o_proj"), ("gemv_int4_o_proj", "o_proj"),
           ("gemv_mma_o_proj", "o_proj"),
           ("gemv_int4_gate_up", "gate_up_swiglu"), ("gemv_mma_gate_up", "gate_up_swiglu"),
           ("gemv_int4_down", "down"),
           ("gemv_mma_down", "down"),
           ("lm_head", "lm_head"), ("argmax", "sample"), ("sampler_", "sample")]


def region_of(name: str) -> str:
    for frag, region in REGIONS:
        if frag in name:
            return region
    return "other"


def kernels_from_trace(trace: dict) -> list[dict]:
    """The trace's GPU kernel events, sorted by start: [{name, ts, dur}] (us)."""
    evs = [e for e in trace.get("traceEvents", [])
           if e.get("cat") == "kernel" and e.get("ph") == "X"]
    return sorted(({"name": e["name"], "ts": float(e["ts"]), "dur": float(e["dur"])} for e in evs),
                  key=lambda e: e["ts"])


def split_steps(kernels: list[dict], first: str = "feed") -> list[list[dict]]:
    """Group kernels into steps, each starting at a kernel whose name contains `first` (the
    step graph's first kernel); kernels before the first such one are dropped."""
    steps: list[list[dict]] = []
    for k in kernels:
        if first in k["name"]:
            steps.append([])
        if steps:
            steps[-1].append(k)
    return steps


def critical_increments(step: list[dict]) -> list[dict]:
    """Per kernel: start/end from the step's first start, and how far it pushes the latest end."""
    t0 = step[0]["ts"]
    latest = t0
    out = []
    for k in step:
        end = k["ts"] + k["dur"]
        inc = max(0.0, end - latest)
        latest = max(latest, end)
        out.append({"name": k["name"], "region": region_of(k["name"]), "start": k["ts"] - t0,
                    "end": end - t0, "dur": k["dur"], "increment": inc})
    return out


def summarize(steps: list[list[dict]]) -> dict:
    """Medians over steps: span, and per region the summed durations and increments (us)."""
    spans, by_region = [], {}
    for st in steps:
        rows = critical_increments(st)
        spans.append(rows[-1]["end"] if rows else 0.0)
        acc: dict = {}
        for r in rows:
            a = acc.setdefault(r["region"], [0.0, 0.0, 0])
            a[0] += r["dur"]
            a[1] += r["increment"]
            a[2] += 1
        for region, (dur, inc, n) in acc.items():
            by_region.setdefault(region, []).append((dur, inc, n))
    return {"steps": len(steps), "span_us": statistics.median(spans) if spans else 0.0,
            "regions": {r: {"kernels": v[0][2],
                            "busy_us": statistics.median(x[0] for x in v),
                            "critical_us": statistics.median(x[1] for x in v)}
                        for r, v in by_region.items()}}


def format_summary(s: dict) -> str:
    lines = [f"{s['steps']} steps, median span {s['span_us']:.1f} us (first kernel start to last end)",
             "| region | kernels | busy us (sum of durations) | critical us (sum of increments) |",
             "| --- | ---: | ---: | ---: |"]
    for r, v in sorted(s["regions"].items(), key=lambda kv: -kv[1]["critical_us"]):
        lines.append(f"| {r} | {v['kernels']} | {v['busy_us']:.1f} | {v['critical_us']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--random", default="7b")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--trace", help="write the Chrome trace here")
    ap.add_argument("--layer", type=int, default=1, help="print every kernel of this layer of "
                    "the middle step (-1: none)")
    a = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from nq.tools.bench import at_context
    from nq.config import PRESETS
    from nq.runtime.engine import Engine

    eng = Engine.random(PRESETS[a.random], max_len=a.ctx + a.steps + 64)
    at_context(eng, a.ctx, ahead=a.steps + 16)
    eng.time_steps(4)  # warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            eng.step()
        eng.stream.synchronize()
    path = Path(a.trace or "/tmp/nq_step_trace.json")
    prof.export_chrome_trace(str(path))
    steps = split_steps(kernels_from_trace(json.loads(path.read_text())))
    if not steps:
        print("step_timeline: no kernel events in the trace (CUPTI saw nothing?)")
        return 1
    print(format_summary(summarize(steps)))
    if a.layer >= 0:
        rows = critical_increments(steps[len(steps) // 2])
        per_layer = 6 if any("rope_kv" in r["name"] for r in rows) else 5
        lo = 2 + a.layer * (per_layer + 1)  # feed, embed; attention is two kernels
        print(f"\nlayer {a.layer} of the middle step (us from the step's start):")
        for r in rows[lo:lo + per_layer + 1]:
            print(f"  {r['region']:16s} start {r['start']:8.2f}  end {r['end']:8.2f}  "
                  f"dur {r['dur']:6.2f}  increment {r['increment']:5.2f}  {r['name'][:60]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
