"""Time the prefill GEMM (nq/kernels/int4/gemm.py) on the GPU: every 7B projection at M = 16,
512, 2048, 8192 tokens, each candidate tile configuration, and cuBLAS fp16 as the peer.

    source scripts/h200_env.sh && python3 scripts/bench_gemm.py --json $OUT/bench_gemm.json
    ... --quick --wgmma      # + the wgmma kernel (gemm_wgmma.py, sm_90a) beside mma.sync

--wgmma adds, for M > gemm_wgmma.WGMMA_MIN_M, the wgmma kernel's candidate tiles (rows
"wgmma:<tag>", its default marked "wgmma_default") and a "wgmma" layer line; with --quick only
its default tiles (--wg-all: all of them, with mma.sync's default only).

Per (projection, M, tiles): a batch of C launches, each on its own copy of the weights (C
copies >= 240 MB, four times the 60 MB L2, so L2 does not hold the next launch's weights),
captured in a CUDA graph when torch is importable (else launched eagerly: host launch costs
~20-50 us, which flatters nothing but swamps M = 16), replayed >= 10 times after a warm-up and
timed with CUDA events; the median replay / C is the time of one launch.  TFLOP/s = 2*M*N*K / t
(gate_up: N = 2I, both halves).  The default tiles (gemm.DEFAULT_CONFIGS' pick for M) give the
layer figure: the four projections' sum x 28 layers.  cuBLAS: torch fp16 `x @ w.T` (one weight
copy, 4x the bytes of INT4) at the same shapes.  Random weights: the time does not depend on
the values or the layout's chunk order.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

from nq.config import PRESETS  # noqa: E402
from nq.kernels.int4 import gemm as M  # noqa: E402
from nq.kernels.int4 import gemm_wgmma as W  # noqa: E402
from nq.kernels.int4 import wg_tiles as T  # noqa: E402

try:
    import torch
except ImportError:          # eager launches, and no cuBLAS peer
    torch = None

CFG = PRESETS["7b"]
H, I, QKV = CFG.hidden_size, CFG.intermediate_size, CFG.qkv_size
PROJECTIONS = {  # kind: (N out, K, layout as decode uploads it, weight rows)
    "qkv": (QKV, H, ("rows", 14), QKV),
    "o_proj": (H, CFG.q_size, "mma", H),
    "gate_up": (I, H, "mma", 2 * I),           # the tensor-core GEMV's layout since d292fd2
    "down": (H, I, "mma", H),
}
CANDIDATES = [M.SMALL, M.MEDIUM, M.LARGE,
              M.Tiles(2, 8, 4, 2, 1, 4),     # LARGE with a fourth stage (160 KB)
              M.Tiles(2, 8, 4, 1, 1, 4),     # 128 x 64 with 4 warps: two blocks an SM
              M.Tiles(2, 8, 2, 2, 1, 4)]     # 64 x 128 with 4 warps: two blocks an SM
WG_CANDIDATES = [T.WG_WIDE, T.WG_TALL, T.WG_SHORT,
                 T.WgTiles(1, 2, 128, 4),      # WG_TALL with one chunk in flight
                 T.WgTiles(1, 2, 64, 4),       # WG_SHORT with one chunk in flight
                 T.WgTiles(2, 2, 128, 4, 2),   # WG_WIDE with two chunks in flight
                 T.WgTiles(1, 4, 64, 3, 2)]    # four warpgroups, 256 rows x 64 tokens
ROTATE_BYTES = 240 << 20


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def median_time(launch_batch, reps):
    """Median seconds of one launch_batch(stream) call (a graph replay when torch is here)."""
    if torch is None:
        stream = cuda.stream()
        launch_batch(stream)
        stream.synchronize()
        times = []
        for _ in range(reps):
            e0, e1 = cuda.event(), cuda.event()
            e0.record(stream)
            launch_batch(stream)
            e1.record(stream)
            e1.synchronize()
            times.append(e0.elapsed_time(e1) * 1e-3)
        return float(np.median(times))
    s = torch.cuda.Stream()
    ns = cuda.external_stream(s.cuda_stream)
    with torch.cuda.stream(s):
        launch_batch(ns)                     # warm: module loads, first-touch
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
        launch_batch(ns)
    times = []
    with torch.cuda.stream(s):
        for _ in range(3):
            g.replay()
        for _ in range(reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(s)
            g.replay()
            e1.record(s)
            e1.synchronize()
            times.append(e0.elapsed_time(e1) * 1e-3)
    return float(np.median(times))


def random_device(shape, dtype, rng):
    if dtype == np.uint32:
        return cuda.to_device(rng.integers(0, 2**32, shape, dtype=np.uint32))
    return cuda.to_device((rng.standard_normal(shape, dtype=np.float32) * 0.5).astype(dtype))


def precompile(ms, plan):
    """Compile (or load) every kernel the sweep will launch, in parallel processes (each wgmma
    tiling costs ~5-10 s of NVVM + ptxas; the sweep has dozens)."""
    from nq.kernels.build import parallel_compiles
    with parallel_compiles():
        for kind, candidates, wg_candidates in plan:
            n, k, layout, _ = PROJECTIONS[kind]
            for m in ms:
                for tiles in candidates:
                    M.make_gemm(kind, n, k, layout, configs=((None, tiles),)).pick(m)
                for tiles in wg_candidates:
                    if m > W.WGMMA_MIN_M:
                        try:
                            W.WgmmaGemm(kind, n, k, layout, tiles).pick(m)
                        except ValueError:
                            pass


def bench_projection(kind, ms, candidates, reps, rng, wg_candidates=()):
    n, k, layout, rows = PROJECTIONS[kind]
    wbytes = rows * k // 2 + rows * (k // 128) * 2
    copies = max(1, min(40, -(-ROTATE_BYTES // wbytes)))
    weights = [(random_device((rows, k // 8), np.uint32, rng),
                cuda.to_device(rng.uniform(0.002, 0.02, (rows, k // 128)).astype(np.float16)))
               for _ in range(copies)]
    bias = random_device((n,), np.float16, rng)
    default = M.make_gemm(kind, n, k, layout)
    rows_out = []
    for m in ms:
        x = random_device((m, k), np.float16, rng)
        out = cuda.device_array((m, n), np.float16 if kind == "gate_up" else np.float32)
        flop = 2.0 * m * rows * k
        picked = default.pick(m)[0]
        for tiles in candidates:
            if m > 2048 and tiles.tokens < 64:
                continue                       # tiles for small M, hopeless at 8K tokens
            g = M.make_gemm(kind, n, k, layout, configs=((None, tiles),))
            extra = (bias,) if kind == "qkv" else ()

            def batch(stream, g=g, m=m, x=x, out=out, extra=extra):
                for qw, sc in weights:
                    g(x, qw, sc, *extra, out, m, stream=stream)
            t = median_time(batch, reps) / copies
            row = {"kind": kind, "m": m, "n": rows, "k": k, "tiles": tiles.tag(),
                   "default": tiles == picked, "ms": t * 1e3, "tflops": flop / t * 1e-12,
                   "weight_copies": copies}
            rows_out.append(row)
            log(f"{kind:8s} M={m:5d} {tiles.tag():16s}{' *' if row['default'] else '  '} "
                f"{row['ms']:8.3f} ms {row['tflops']:6.1f} TFLOP/s")
        for tiles in wg_candidates:
            if m <= W.WGMMA_MIN_M:
                continue                       # the launcher runs mma.sync there
            try:
                T.check(kind, n, k, layout, tiles)
            except ValueError:
                continue                       # e.g. gate_up needs ta = 2
            g = W.WgmmaGemm(kind, n, k, layout, tiles)
            extra = (bias,) if kind == "qkv" else ()

            def batch(stream, g=g, m=m, x=x, out=out, extra=extra):
                for qw, sc in weights:
                    g(x, qw, sc, *extra, out, m, stream=stream)
            t = median_time(batch, reps) / copies
            wdef = tiles == T.default_tiles(kind, m)
            row = {"kind": kind, "m": m, "n": rows, "k": k, "tiles": "wgmma:" + tiles.tag(),
                   "default": False, "wgmma_default": wdef, "ms": t * 1e3,
                   "tflops": flop / t * 1e-12, "weight_copies": copies}
            rows_out.append(row)
            log(f"{kind:8s} M={m:5d} {'wgmma:' + tiles.tag():16s}{' *' if wdef else '  '} "
                f"{row['ms']:8.3f} ms {row['tflops']:6.1f} TFLOP/s")
        if torch is not None:
            xt = torch.randn(m, k, device="cuda", dtype=torch.float16)
            wt = torch.randn(rows, k, device="cuda", dtype=torch.float16) * 0.02
            t = median_time(lambda stream: [torch.matmul(xt, wt.t()) for _ in range(4)], reps) / 4
            row = {"kind": kind, "m": m, "n": rows, "k": k, "tiles": "cublas_fp16",
                   "default": False, "ms": t * 1e3, "tflops": flop / t * 1e-12}
            rows_out.append(row)
            log(f"{kind:8s} M={m:5d} {'cuBLAS fp16':16s}   {row['ms']:8.3f} ms "
                f"{row['tflops']:6.1f} TFLOP/s")
            del xt, wt
    return rows_out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--ms", default="16,512,2048,8192", help="token counts")
    ap.add_argument("--kinds", default=",".join(PROJECTIONS), help="projections to time")
    ap.add_argument("--layout", default="",
                    help="KIND=LAYOUT,...: time a kind's weights in another upload layout "
                         "('mma' or rows:KS), e.g. gate_up=mma: what a decode upload change "
                         "would buy the prefill")
    ap.add_argument("--quick", action="store_true", help="the default tiles only")
    ap.add_argument("--reps", type=int, default=12, help="timed replays (>= 10)")
    ap.add_argument("--wgmma", action="store_true",
                    help="also time the wgmma kernel (sm_90a) for M > WGMMA_MIN_M")
    ap.add_argument("--wg-all", action="store_true",
                    help="with --wgmma: every wgmma candidate tiling, even with --quick")
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    for item in filter(None, args.layout.split(",")):
        kind, lay = item.split("=")
        n, k, _, rows = PROJECTIONS[kind]
        PROJECTIONS[kind] = (n, k, "mma" if lay == "mma" else ("rows", int(lay.split(":")[1])),
                             rows)
    rng = np.random.default_rng(0)
    dev = cuda.get_current_device()
    name = getattr(dev, "name", b"simulator")
    results = {"device": name.decode() if isinstance(name, bytes) else str(name),
               "graph_timed": torch is not None, "rows": []}
    plan = []
    for kind in args.kinds.split(","):
        candidates = CANDIDATES
        if args.quick:
            default = M.make_gemm(kind, *PROJECTIONS[kind][:3])
            candidates = list(dict.fromkeys(default.pick(m)[0] for m in ms))
        wg = []
        if args.wgmma:
            wg = (list(dict.fromkeys(T.default_tiles(kind, m) for m in ms))
                  if args.quick and not args.wg_all else WG_CANDIDATES)
        plan.append((kind, candidates, wg))
    precompile(ms, plan)
    for kind, candidates, wg in plan:
        results["rows"].extend(bench_projection(kind, ms, candidates, max(args.reps, 10), rng,
                                                wg))
    layer = {}
    for m in ms:
        for label, pick in (("nq", lambda r: r["default"]),
                            ("wgmma", lambda r: r.get("wgmma_default", False)),
                            ("cublas_fp16", lambda r: r["tiles"] == "cublas_fp16")):
            rs = [r for r in results["rows"] if r["m"] == m and pick(r)]
            if len(rs) == len(args.kinds.split(",")):
                per_layer = sum(r["ms"] for r in rs)
                layer.setdefault(str(m), {})[label] = {
                    "layer_ms": per_layer, "x28_ms": 28 * per_layer,
                    "tflops": sum(2.0 * m * r["n"] * r["k"] for r in rs) / per_layer * 1e-9}
                log(f"M={m:5d} {label:12s} 28 layers of projections: {28 * per_layer:8.2f} ms "
                    f"({layer[str(m)][label]['tflops']:.0f} TFLOP/s)")
    results["layer"] = layer
    Path(args.json).write_text(json.dumps(results, indent=1))
    print(json.dumps(layer, indent=1))


if __name__ == "__main__":
    main()
