"""Time the fp16, int8 and INT4 lm_heads alone on the GPU, each launch inside a captured CUDA graph.

    source scripts/h200_env.sh && python3 scripts/bench_lm_head.py [--size 7b] [--json out.json]
    python3 scripts/bench_lm_head.py --int8 "rows=2,unroll=4" "rows=1,unroll=7" "rows=2,unroll=2"
    python3 scripts/bench_lm_head.py --int4 "" "ks=4,min_blocks=1,blocks_per_sm=1"

The fp16 head (nq/kernels/lm_head.py, its default tiling), the int8 head
(nq/kernels/lm_head_int8.py) and the INT4 head (nq/kernels/lm_head_int4.py: its default
tiling with the given Tiling fields replaced, and blocks_per_sm) at each tiling given, on
random weights made on the device
(nq/kernels/fill.py): one graph of one launch with programmatic edges off, replayed after a
warm-up, timed with events.  The 7B's heads are 1.09 GB and 0.55 GB, many times the 60 MB L2,
so one copy of the weights does not flatter.  Per head: us, bytes (weights + scales + x +
logits), GB/s and the fraction of a device-to-device copy's read rate (its read+write bytes
over its time, measured here), as `nq bench` counts it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from numba import cuda  # noqa: E402

from nq.config import PRESETS  # noqa: E402
import dataclasses  # noqa: E402

from nq.kernels import lm_head, lm_head_int4, lm_head_int8  # noqa: E402
from nq.kernels.fill import fill_f16, fill_u32  # noqa: E402
from nq.tools.bench import copy_ceiling_gbs, graph_ms  # noqa: E402


def time_us(stream, launch, replays: int) -> float:
    launch(stream)             # compiled and run once outside the graph
    stream.synchronize()
    return 1e3 * graph_ms(stream, lambda: launch(stream), replays, warmup=5, name="lm_head")


def tiling(text: str) -> dict:
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(",") if kv)}


def int4_tiling(cfg, text: str) -> dict:
    """"ks=4,blocks_per_sm=1" -> LmHeadInt4 keywords: the default tiling with those fields."""
    kw = tiling(text)
    bps = kw.pop("blocks_per_sm", lm_head_int4.BLOCKS_PER_SM)
    return {"tiling": dataclasses.replace(lm_head_int4.head_tiling(cfg), **kw),
            "blocks_per_sm": bps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="7b", choices=sorted(PRESETS))
    ap.add_argument("--int8", nargs="*", default=["rows=2,unroll=2", "rows=1,unroll=7",
                                                  "rows=2,unroll=4", "rows=2,unroll=2,blocks_per_sm=3"],
                    help="int8 tilings, LmHeadInt8 keywords (the default first)")
    ap.add_argument("--int4", nargs="*", default=[""],
                    help="INT4 tilings: Tiling fields over the default's, and blocks_per_sm "
                         '("" the default)')
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    cfg = PRESETS[args.size]
    v, h = cfg.vocab_size, cfg.hidden_size
    s = cuda.stream()
    rng = np.random.default_rng(0)
    x = cuda.to_device((2 * rng.standard_normal(h)).astype(np.float32), stream=s)
    nw = cuda.to_device((1 + 0.1 * rng.standard_normal(h)).astype(np.float16), stream=s)
    logits = cuda.device_array(v, np.float32)
    w16 = cuda.device_array((v, h), np.float16)
    fill_f16(w16, 3, 0.0, 1.7 / np.sqrt(h), s)
    q = cuda.device_array((v, h), np.int8)
    fill_u32(q.view(np.uint32), 4, s)
    w8 = lm_head_int8.Int8Rows(q, cuda.to_device(np.full(v, 1.0 / (74 * np.sqrt(h)), np.float32)))
    w4 = lm_head_int4.Int4Rows(cuda.device_array((v, h // 8), np.uint32),
                               cuda.device_array((v, h // 128), np.float16))
    fill_u32(w4.qweight, 5, s)     # nibbles uniform in [-8, 7]: std ~4.6
    fill_f16(w4.scales, 6, 1.7 / (4.6 * np.sqrt(h)), 0.4 / (4.6 * np.sqrt(h)), s)
    ceiling = copy_ceiling_gbs()   # nq bench's copy ceiling (read + write GB/s)
    print(f"{cfg.name} lm_head {v} x {h}; copy {ceiling:.0f} GB/s (read + write)", flush=True)
    rows = []
    cases = ([("fp16", {}, w16, w16.nbytes)]
             + [("int8", tiling(t), w8, w8.nbytes) for t in args.int8]
             + [("int4", int4_tiling(cfg, t), w4, w4.nbytes) for t in args.int4])
    for kind, kw, w, wbytes in cases:
        try:
            head = lm_head.make_lm_head(cfg, w, **kw)
            us = time_us(s, lambda st: head(x, nw, w, logits, st), args.replays)
        except Exception as e:  # noqa: BLE001 -- a tiling that does not build: say so, go on
            print(f"{kind} {kw}: FAILED {type(e).__name__}: {e}", flush=True)
            continue
        nbytes = wbytes + 6 * h + 4 * v
        kern = head.kernel
        shown = kw if kind != "int4" else f"{kw['tiling'].tag()} bps{kw['blocks_per_sm']}"
        row = {"kind": kind, "tiling": shown, "us": us, "bytes": nbytes, "GBps": nbytes / us * 1e-3,
               "pct_copy": 100 * nbytes / us * 1e-3 / ceiling, "grid": head.grid,
               "regs": kern.get_regs_per_thread(), "local": kern.get_local_mem_per_thread()}
        rows.append(row)
        print(f"{kind} {str(shown):40s} {us:8.1f} us {row['GBps']:7.0f} GB/s "
              f"{row['pct_copy']:5.1f} % of copy  grid {head.grid}  regs {row['regs']} "
              f"local {row['local']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_GBs": ceiling, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
