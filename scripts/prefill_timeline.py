"""Where a prompt's time goes on the GPU: the batched prefill's kernels, from CUPTI.

`nq bench`'s pp rows give the TTFT and `bench_gemm.py` the GEMMs alone; this script runs
`Engine.prefill` on a random-weight engine under torch.profiler (CUPTI traces every kernel of
the process, numba's included) and sums the kernels by family, so the TTFT can be read as
GEMMs + attention + row kernels + head + the gaps where the GPU waited for the host:

    python3 scripts/prefill_timeline.py --random 7b -p 512,8192 [--start 30000]

For each prompt length, after a warm-up prefill: the wall time of `eng.prefill(ids)` (ids on
the host to logits on the host), the GPU span (first kernel start to last end), the busy time
by family (sum of durations; prefill kernels do not overlap: one stream, no PDL), and the idle
time inside the span (host-bound launches show up there).  --start puts the prompt after a
fake context of that many tokens (a chat turn deep in a conversation: attention dominates).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FAMILIES = [("gemm_wgmma_kindqkv", "gemm qkv"), ("gemm_wgmma_kindo_proj", "gemm o_proj"),
            ("gemm_wgmma_kindgate_up", "gemm gate_up"), ("gemm_wgmma_kinddown", "gemm down"),
            ("gemm_kindqkv", "gemm qkv (mma.sync)"), ("gemm_kindo_proj", "gemm o_proj (mma.sync)"),
            ("gemm_kindgate_up", "gemm gate_up (mma.sync)"),
            ("gemm_kinddown", "gemm down (mma.sync)"),
            ("prefill_attn", "attention"), ("rmsnorm", "rmsnorm rows"),
            ("rope_kv_rows", "rope/KV rows"), ("embed_rows", "embed rows"),
            ("last_row", "head"), ("lm_head", "head"), ("argmax", "head"), ("sampler", "head"),
            ("attn_", "decode step"), ("gemv", "decode step"), ("qkv_rope", "decode step"),
            ("feed", "decode step"), ("embed", "decode step")]


def family(name: str) -> str:
    for frag, fam in FAMILIES:
        if frag in name:
            return fam
    return "other: " + name[:40]


def kernels(trace: dict) -> list[dict]:
    evs = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and e.get("ph") == "X"]
    return sorted(({"name": e["name"], "ts": float(e["ts"]), "dur": float(e["dur"])} for e in evs),
                  key=lambda e: e["ts"])


def summarize(ks: list[dict]) -> dict:
    """GPU span, busy time by family, and the idle time inside the span (us)."""
    if not ks:
        return {"span_us": 0.0, "idle_us": 0.0, "families": {}}
    t0, busy_end, idle = ks[0]["ts"], ks[0]["ts"], 0.0
    fams: dict = {}
    for k in ks:
        idle += max(0.0, k["ts"] - busy_end)
        busy_end = max(busy_end, k["ts"] + k["dur"])
        f = fams.setdefault(family(k["name"]), [0, 0.0])
        f[0] += 1
        f[1] += k["dur"]
    return {"span_us": busy_end - t0, "idle_us": idle,
            "families": {f: {"kernels": n, "us": us} for f, (n, us) in fams.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--random", default="7b")
    ap.add_argument("-p", default="512,8192", help="prompt lengths")
    ap.add_argument("--start", type=int, default=0, help="a fake context before the prompt")
    ap.add_argument("--json", help="write the summaries here")
    a = ap.parse_args(argv)
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    from nq.config import PRESETS
    from nq.runtime.engine import Engine

    lengths = [int(v) for v in a.p.split(",")]
    eng = Engine.random(PRESETS[a.random], max_len=a.start + max(lengths) + 64)
    out = {}
    for n in lengths:
        ids = np.random.default_rng(n).integers(0, eng.cfg.vocab_size, n)
        walls = []
        for _ in range(3):                      # the first compiles/loads the tiles of n
            eng.reset()
            if a.start:
                eng.fake_context(a.start)
                eng._pos = a.start
            t = time.perf_counter()
            eng.prefill(ids)
            walls.append(1e3 * (time.perf_counter() - t))
        eng.reset()
        if a.start:
            eng.fake_context(a.start)
            eng._pos = a.start
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eng.prefill(ids)
            eng.stream.synchronize()
        path = Path(f"/tmp/nq_prefill_{n}.json")
        prof.export_chrome_trace(str(path))
        s = summarize(kernels(json.loads(path.read_text())))
        s["wall_ms"] = statistics.median(walls[1:])
        out[str(n)] = s
        print(f"\nprompt {n} at {a.start}: wall {s['wall_ms']:.2f} ms (median of 2 after one), "
              f"GPU span {s['span_us'] / 1e3:.2f} ms, idle in the span {s['idle_us'] / 1e3:.2f} ms")
        print("| family | kernels | ms | of span |\n| --- | ---: | ---: | ---: |")
        for f, v in sorted(s["families"].items(), key=lambda kv: -kv[1]["us"]):
            print(f"| {f} | {v['kernels']} | {v['us'] / 1e3:.3f} | "
                  f"{100 * v['us'] / max(s['span_us'], 1e-9):.1f} % |")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
