"""Benchmark: causal prefill attention (nq/kernels/attention/prefill.py) for the 7B shape
(28 q heads, 4 kv heads, d 128), one layer's chunk at a time, timed with CUDA events.

Cases are m:start (a chunk of m query tokens after start cached ones); the defaults are a 512
and a 2048 prompt, 2048-token chunks at 6144 and 30000 (the 8K and 32K prompts' last
chunks), and a 16-token chat turn at 30000 (the known gap: a grid of 4 CTAs).  Each case is launched `--warmup` times, then `--reps` times each between its own
pair of events; the median is reported with TFLOP/s of the causal work, 4 D Hq sum(start+i+1)
(the masked half of the diagonal tiles not counted), and the 28-layer time.  The kernel is
compute-bound (~18 KB of K/V per 126 rows of a CTA a tile), so L2 reuse across repetitions
flatters nothing much; pages are scattered as a real cache's are.

    python3 scripts/bench_prefill_attn.py [--cases 512:0,2048:0,2048:6144,2048:30000,16:30000]
        [--variants 8:3,8:2,4:2] [--wgmma [--wgmma-variants 2:128:3,2:128:3:ov]] [--reps 10]
        [--json]

--variants is a sweep of warps:nstage of the mma.sync kernel (prefill.py); --wgmma also times
the wgmma kernel (prefill_wgmma.py, sm_90a) at the same cases, over --wgmma-variants
(warpgroups:bn:nstage, and a 4th field `ov` for overlap=True), and checks each case's output against the first mma.sync variant's
(max |difference| printed; the two round differently, so ~1e-3 is agreement).  Results go to
stderr; --json adds one JSON line on stdout.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def causal_flops(cfg, m: int, start: int) -> float:
    """4 D Hq sum over the chunk's queries of their context lengths (QK^T and PV, 2 each)."""
    ctx = m * start + m * (m + 1) // 2
    return 4.0 * cfg.head_dim * cfg.num_heads * ctx


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="512:0,2048:0,2048:6144,2048:30000,16:30000")
    ap.add_argument("--variants", default="8:3,8:2,4:2", help="warps:nstage, comma-separated")
    ap.add_argument("--wgmma", action="store_true",
                    help="also time nq/kernels/attention/prefill_wgmma.py (sm_90a)")
    ap.add_argument("--wgmma-variants", default="2:128:3,2:128:3:ov",
                    help="warpgroups:bn:nstage[:ov] of the wgmma kernel, comma-separated "
                         "(ov: overlap=True)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="one JSON line on stdout")
    args = ap.parse_args()

    from numba import cuda

    from nq.config import PRESETS
    from nq.kernels.attention import prefill
    from nq.paged import pages_for, pool_shape

    cfg = PRESETS["7b"]
    cases = [tuple(int(v) for v in c.split(":")) for c in args.cases.split(",")]
    variants = [tuple(int(v) for v in c.split(":")) for c in args.variants.split(",")]
    m_max = max(m for m, _ in cases)
    n_pages = pages_for(max(m + s for m, s in cases))
    rng = np.random.default_rng(0)
    stream = cuda.stream()
    # One layer's pool (n_pages, 4, 2, 16, 128), filled by device copies of one random block
    # (uploading it whole from the host is slow at 32K).
    pool = cuda.device_array(pool_shape(cfg, n_pages)[1:], np.float16)
    block = cuda.to_device((rng.standard_normal(pool_shape(cfg, 64)[1:]) * 0.5)
                           .astype(np.float16))
    for p0 in range(0, n_pages, 64):
        n = min(64, n_pages - p0)
        pool[p0:p0 + n].copy_to_device(block[:n], stream=stream)
    table = cuda.to_device(rng.permutation(n_pages).astype(np.int32))
    q = cuda.to_device(rng.standard_normal((m_max, cfg.num_heads, cfg.head_dim))
                       .astype(np.float32))
    o = cuda.device_array((m_max, cfg.q_size), np.float16)
    stream.synchronize()

    def timed(launch, m, start):
        for _ in range(args.warmup):
            launch(m, start, stream)
        times = []
        for _ in range(args.reps):
            e0, e1 = cuda.event(), cuda.event()
            e0.record(stream)
            launch(m, start, stream)
            e1.record(stream)
            e1.synchronize()
            times.append(cuda.event_elapsed_time(e0, e1))
        return statistics.median(times), min(times)

    def report(label, m, start, ms, ms_min, **key):
        tflops = causal_flops(cfg, m, start) / (ms * 1e-3) / 1e12
        log(f"{label}  m {m:5d} start {start:6d}: {ms:8.3f} ms/layer (min {ms_min:.3f}), "
            f"{tflops:6.1f} TFLOP/s, x{cfg.num_layers} layers {ms * cfg.num_layers:8.1f} ms")
        results["cases"].append(dict(key, m=m, start=start, ms=ms, ms_min=ms_min, tflops=tflops,
                                     ms_all_layers=ms * cfg.num_layers))

    results = {"shape": "7b", "cases": []}
    baseline = {}                  # (m, start) -> o[:m] of the first mma.sync variant
    for warps, nstage in variants:
        launch = prefill.prefill_attention_launcher(cfg, q, pool, table, o, warps=warps,
                                                    nstage=nstage)
        for m, start in cases:
            ms, ms_min = timed(launch, m, start)
            report(f"warps {warps} stages {nstage}", m, start, ms, ms_min, warps=warps,
                   nstage=nstage)
            if args.wgmma and (m, start) not in baseline:
                baseline[m, start] = o[:m].copy_to_host().astype(np.float32)
    if args.wgmma:
        from nq.kernels.attention import prefill_wgmma
        for spec in args.wgmma_variants.split(","):
            fields = spec.split(":")
            wg, bn, nstage = (int(v) for v in fields[:3])
            overlap = fields[3:] == ["ov"]
            launch = prefill_wgmma.prefill_attention_launcher(cfg, q, pool, table, o,
                                                              warpgroups=wg, bn=bn,
                                                              nstage=nstage, overlap=overlap)
            for m, start in cases:
                ms, ms_min = timed(launch, m, start)
                report(f"wgmma wg {wg} bn {bn} st {nstage}{' ov' if overlap else ''}", m, start,
                       ms, ms_min, kernel="wgmma", warpgroups=wg, bn=bn, nstage=nstage,
                       overlap=overlap)
                if (m, start) in baseline:
                    diff = np.abs(o[:m].copy_to_host().astype(np.float32) - baseline[m, start])
                    log(f"    max |o - o(mma.sync)| = {float(np.nanmax(diff)):.3g}"
                        + ("  NaN!" if np.isnan(diff).any() else ""))
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
