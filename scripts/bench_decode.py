"""Decode ITL of the GPU engine on random weights of a real shape, graph against eager.

`nq bench` is its successor (llama-bench table, ITL breakdown, torch peers); this script stays
for what nq bench does not time: the same decode step as eager launches, without the graph.

    python3 scripts/bench_decode.py --random 7b -p 512 -n 128 -r 5 --ctx 8192,32768

Weights are made on the GPU (no download).  Per run: reset, prefill `-p` tokens through the
graph, then `-n` decode steps, each timed with CUDA events; the figure is the median step.
`--ctx` also times decode steps at longer contexts (the cache made that long without
computing it: attention cost depends on the length, not on the values).  The copy ceiling is
measured in the same run with a device-to-device copy, and bytes per token are counted from
the engine's own buffers.  Eager launches (no graph) are timed for comparison.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nq.tools.bench import bytes_per_token, copy_ceiling_gbs  # shared with nq bench
from nq.config import PRESETS  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--random", default="7b", choices=sorted(PRESETS))
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=5)
    ap.add_argument("--ctx", default="", help="extra decode contexts, e.g. 8192,32768")
    ap.add_argument("--no-eager", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    from nq.runtime.engine import Engine

    cfg = PRESETS[args.random]
    ctxs = [int(c) for c in args.ctx.split(",") if c]
    max_len = max([args.p + args.n + 1] + [c + 2 for c in ctxs])
    t0 = time.perf_counter()
    eng = Engine.random(cfg, max_len=max_len)
    build_s = time.perf_counter() - t0
    ceiling = copy_ceiling_gbs()
    out = {"model": cfg.name, "build_s": build_s, "copy_ceiling_GBs": ceiling, "runs": []}
    print(f"# {cfg.name}: engine built in {build_s:.1f} s; copy ceiling {ceiling:.0f} GB/s",
          flush=True)

    prompt = list(np.random.default_rng(0).integers(0, 1000, args.p))
    itl, ttft = [], []
    for r in range(args.r):
        eng.reset()
        t = time.perf_counter()
        eng.prefill(prompt)
        ttft.append((time.perf_counter() - t) * 1e3)
        steps = eng.time_steps(args.n, warmup=0)
        itl.append(statistics.median(steps))
    ctx0 = args.p + args.n // 2
    rows = [("tg%d @ %d" % (args.n, args.p), ctx0, statistics.median(itl))]
    for c in ctxs:
        eng.reset()
        eng.fake_context(c)
        rows.append((f"decode @ {c}", c, statistics.median(eng.time_steps(max(args.n // 4, 16)))))
    print("| test | ITL ms | tok/s | bytes/token | GB/s | % of copy ceiling |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, ctx, ms in rows:
        b = bytes_per_token(eng, ctx)
        gbs = b / (ms * 1e-3) / 1e9
        print(f"| {name} | {ms:.3f} | {1e3 / ms:.1f} | {b / 1e9:.3f} GB | {gbs:.0f} | {100 * gbs / ceiling:.1f} % |")
        out["runs"].append({"test": name, "ctx": ctx, "itl_ms": ms, "bytes": b, "GBs": gbs})
    print(f"prefill {args.p} tokens as decode replays: median {statistics.median(ttft):.1f} ms")
    out["ttft_ms_median"] = statistics.median(ttft)
    out["itl_ms_per_run"] = itl

    if not args.no_eager:
        graph, eng.graph = eng.graph, None
        eng.reset()
        eng.fake_context(args.p)
        eager = statistics.median(eng.time_steps(8))
        eng.graph = graph
        print(f"eager launches (no graph) at {args.p}: {eager:.2f} ms/token "
              f"vs graph {rows[0][2]:.3f} ms/token")
        out["eager_itl_ms"] = eager
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
