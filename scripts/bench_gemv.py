"""Time the INT4 GEMVs and the lm_head on the GPU, each inside a captured CUDA graph.

    source scripts/h200_env.sh && python3 scripts/bench_gemv.py [--quick] [--out DIR]

For every 7B shape and every candidate tiling: a graph of C launches, each on its own copy of
the weights (C copies >= 240 MB, four times the 60 MB L2, so L2 does not flatter), replayed
R times and timed with events; per launch: us, bytes (qweight + scales + activations), GB/s
and the fraction of a device-to-device copy ceiling measured in the same run.  Then the whole
28-layer projection chain (distinct weights per layer, the winning tilings) plus the lm_head
in one graph.  Random weights: the timing does not depend on the values or the chunk order.
numba launches go to torch's capturing stream through cuda.external_stream.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from numba import cuda  # noqa: E402

from nq.config import PRESETS  # noqa: E402
from nq.kernels import lm_head as L  # noqa: E402
from nq.kernels.int4 import launch  # noqa: E402
from nq.kernels.int4.tiling import MmaTiling, Tiling, default_tiling  # noqa: E402

CFG = PRESETS["7b"]
H, I, QKV = CFG.hidden_size, CFG.intermediate_size, CFG.qkv_size
SHAPES = {"qkv": (QKV, H, QKV), "o_proj": (H, H, H), "gate_up": (I, H, 2 * I), "down": (H, I, H)}
T = Tiling
CANDIDATES = {  # the default first; then block sizes that make the grid a whole number of
    # waves over 132 SMs (288 blocks of qkv's 16 rows put 3 blocks on some SMs, 2 on others)
    "qkv": [default_tiling("qkv", QKV, H), T(14, threads=576), T(14, threads=288),
            T(7, threads=288)],
    # o_proj, down and gate_up default to the tensor cores; the CUDA-core default second
    "o_proj": [default_tiling("o_proj", H, H), default_tiling("o_proj", H, H, mma=False),
               T(14, threads=448), T(7, threads=224), MmaTiling(warps=7, threads=448)],
    "gate_up": [default_tiling("gate_up", I, H), default_tiling("gate_up", I, H, mma=False),
                T(4, threads=128, span=128), T(4, threads=256, span=128),
                MmaTiling(warps=2, threads=128)],
    "down": [default_tiling("down", H, I), default_tiling("down", H, I, mma=False),
             MmaTiling(warps=16, threads=512), MmaTiling(warps=8, threads=512)],
}


def log(*a):
    print(*a, flush=True)


def dev_u32(n, k8):
    return cuda.as_cuda_array(torch.randint(-2**31, 2**31 - 1, (n, k8), dtype=torch.int32,
                                            device="cuda")).view(np.uint32)


def dev_f16(*shape, lo=0.001, hi=0.01):
    return cuda.as_cuda_array((torch.rand(*shape, device="cuda") * (hi - lo) + lo).half())


def dev_f32(*shape):
    return cuda.as_cuda_array(torch.randn(*shape, device="cuda"))


def graph_time(launch_all, reps):
    """us per replay of a graph holding launch_all(stream)."""
    s = torch.cuda.Stream()
    ns = cuda.external_stream(s.cuda_stream)
    with torch.cuda.stream(s):
        launch_all(ns)                       # warm (compiled already; loads modules)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
        launch_all(ns)
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        for _ in range(3):
            g.replay()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(3):
            e0.record(s)
            for _ in range(reps):
                g.replay()
            e1.record(s)
            e1.synchronize()
            times.append(e0.elapsed_time(e1) * 1e3 / reps)
    return float(np.median(times)), times


def copy_ceiling():
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_(0, 255)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(20):
        b.copy_(a)
    e1.record()
    e1.synchronize()
    return 2 * n * 20 / (e0.elapsed_time(e1) * 1e-3)


def gemv_bytes(n_rows, k, n_out, kind):
    act_in = k * (4 if kind in ("qkv", "gate_up") else 2)
    out = n_out * (2 if kind == "gate_up" else 8 if kind in ("o_proj", "down") else 4)
    return n_rows * k // 2 + n_rows * (k // 128) * 2 + act_in + out


def kernel_info(g):
    try:
        k = g.kernel

        def one(v):
            return int(next(iter(v.values()))) if isinstance(v, dict) else int(v)
        return {"regs": one(k.get_regs_per_thread()), "local": one(k.get_local_mem_per_thread()),
                "smem": one(k.get_shared_mem_per_block())}
    except Exception as e:  # noqa: BLE001
        return {"info_error": str(e)[:80]}


class Buffers:
    def __init__(self):
        self.x = dev_f32(H)
        self.x.copy_to_device(np.random.default_rng(0).standard_normal(H).astype(np.float32))
        self.norm = dev_f16(H, lo=0.5, hi=1.5)
        self.bias = dev_f16(QKV)
        self.qkv_out = dev_f32(QKV)
        self.attn = dev_f16(H, lo=-1, hi=1)
        self.mlp = dev_f16(I, lo=-1, hi=1)
        self.logits = dev_f32(CFG.vocab_size)


def launcher(kind, g, b, qw, sc):
    if kind == "qkv":
        return lambda s: g(b.x, b.norm, qw, sc, b.bias, b.qkv_out, s)
    if kind == "gate_up":
        return lambda s: g(b.x, b.norm, qw, sc, b.mlp, s)
    if kind == "o_proj":
        return lambda s: g(b.attn, qw, sc, b.x, s)
    return lambda s: g(b.mlp, qw, sc, b.x, s)


def make(kind, tiling):
    n_out, k, _ = SHAPES[kind]
    if isinstance(tiling, MmaTiling):   # the tensor-core kernel (nq/kernels/int4/gemv_mma.py)
        if kind == "gate_up":
            return launch.GateUpMmaGemv(CFG, n_out, k, tiling)
        return launch.ResidualMmaGemv(kind, n_out, k, tiling)
    if kind == "qkv":
        return launch.QkvGemv(CFG, n_out, k, n_out, tiling)
    if kind == "gate_up":
        return launch.GateUpGemv(CFG, n_out, k, 2 * n_out, tiling)
    return launch.ResidualGemv(kind, CFG, n_out, k, n_out, tiling)


def bench_shapes(b, ceiling, quick, results, kinds=()):
    best = {}
    for kind, cands in CANDIDATES.items():
        if kinds and kind not in kinds:
            continue
        n_out, k, n_rows = SHAPES[kind]
        nbytes = gemv_bytes(n_rows, k, n_out, kind)
        copies = max(2, -(-240_000_000 // nbytes))
        ws = [(dev_u32(n_rows, k // 8), dev_f16(n_rows, k // 128)) for _ in range(copies)]
        for t in (cands[:1] if quick else cands):
            try:
                t0 = time.time()
                g = make(kind, t)
                fns = [launcher(kind, g, b, qw, sc) for qw, sc in ws]
                us, all_us = graph_time(lambda s: [f(s) for f in fns], reps=10)
                us /= copies
                r = {"kind": kind, "tiling": t.tag(), "us": us, "bytes": nbytes,
                     "GBps": nbytes / us * 1e-3, "pct_ceiling": 100 * nbytes / (us * 1e-6) / ceiling,
                     "grid": g.grid, "spread_us": [x / copies for x in all_us],
                     "compile_s": time.time() - t0, **kernel_info(g)}
                results["shapes"].append(r)
                log(f"{kind:8s} {t.tag():28s} {us:8.2f} us {r['GBps']:7.0f} GB/s "
                    f"{r['pct_ceiling']:5.1f} %  grid {g.grid:5d}  {kernel_info(g)}")
                if kind not in best or us < best[kind][1]:
                    best[kind] = (t, us)
            except Exception as e:  # noqa: BLE001
                log(f"{kind} {t.tag()} FAILED: {e}")
                results["errors"].append(f"{kind} {t.tag()}: {traceback.format_exc()[-600:]}")
        del ws
        torch.cuda.empty_cache()
    return best


def bench_lm_head(b, ceiling, quick, results):
    w = cuda.as_cuda_array((torch.randn(CFG.vocab_size, H, device="cuda") * 0.02).half())
    nbytes = CFG.vocab_size * H * 2 + H * 6 + CFG.vocab_size * 4
    best = None
    variants = [dict(unroll=7), dict(unroll=4, blocks_per_sm=8), dict(unroll=8, blocks_per_sm=2)]
    for kw in (variants[:1] if quick else variants):
        try:
            head = L.make_lm_head(CFG, **kw)
            us, all_us = graph_time(lambda s: head(b.x, b.norm, w, b.logits, s), reps=20)
            r = {"kind": "lm_head", "tiling": str(kw), "us": us, "bytes": nbytes,
                 "GBps": nbytes / us * 1e-3, "pct_ceiling": 100 * nbytes / (us * 1e-6) / ceiling,
                 "grid": head.grid, "spread_us": all_us, **kernel_info(head)}
            results["shapes"].append(r)
            log(f"lm_head  {str(kw):28s} {us:8.2f} us {r['GBps']:7.0f} GB/s {r['pct_ceiling']:5.1f} %"
                f"  grid {head.grid}  {kernel_info(head)}")
            if best is None or us < best[1]:
                best = (kw, us)
        except Exception as e:  # noqa: BLE001
            log(f"lm_head {kw} FAILED: {e}")
            results["errors"].append(f"lm_head {kw}: {traceback.format_exc()[-600:]}")
    return w, best


def bench_chain(b, best, head_kw, w_head, ceiling, results):
    gs = {kind: make(kind, best[kind][0] if kind in best else CANDIDATES[kind][0])
          for kind in SHAPES}
    layers = []
    nbytes = 0
    for _ in range(CFG.num_layers):
        per = {}
        for kind, (n_out, k, n_rows) in SHAPES.items():
            per[kind] = (dev_u32(n_rows, k // 8), dev_f16(n_rows, k // 128, lo=1e-4, hi=1e-3))
            nbytes += gemv_bytes(n_rows, k, n_out, kind)
        layers.append(per)
    head = L.make_lm_head(CFG, **(head_kw or {}))
    fns = []
    for per in layers:
        for kind in ("qkv", "o_proj", "gate_up", "down"):
            fns.append(launcher(kind, gs[kind], b, *per[kind]))
    proj_us, _ = graph_time(lambda s: [f(s) for f in fns], reps=5)
    head_bytes = CFG.vocab_size * H * 2
    all_us, _ = graph_time(lambda s: ([f(s) for f in fns], head(b.x, b.norm, w_head, b.logits, s)),
                           reps=5)
    r = {"proj_chain_us": proj_us, "proj_bytes": nbytes,
         "proj_pct_ceiling": 100 * nbytes / (proj_us * 1e-6) / ceiling,
         "chain_plus_head_us": all_us, "chain_plus_head_bytes": nbytes + head_bytes,
         "chain_plus_head_pct_ceiling": 100 * (nbytes + head_bytes) / (all_us * 1e-6) / ceiling,
         "tilings": {k: g.tiling.tag() for k, g in gs.items()}}
    results["chain"] = r
    log(f"chain: 28-layer projections {proj_us:8.1f} us ({r['proj_pct_ceiling']:.1f} % of copy), "
        f"+ lm_head {all_us:8.1f} us ({r['chain_plus_head_pct_ceiling']:.1f} %)  {r['tilings']}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="default tilings only")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-chain", action="store_true")
    ap.add_argument("--kinds", default="", help="only these GEMVs, e.g. down,gate_up (and no lm_head)")
    args = ap.parse_args()
    torch.cuda.init()
    results = {"device": torch.cuda.get_device_name(), "shapes": [], "errors": []}
    ceiling = copy_ceiling()
    results["copy_ceiling_Bps"] = ceiling
    log(f"device-to-device copy ceiling: {ceiling / 1e12:.2f} TB/s")
    b = Buffers()
    try:
        kinds = [k for k in args.kinds.split(",") if k]
        best = bench_shapes(b, ceiling, args.quick, results, kinds)
        w_head, head_best = (None, None) if kinds else bench_lm_head(b, ceiling, args.quick, results)
        results["best"] = {k: (t.tag(), us) for k, (t, us) in best.items()}
        if not args.no_chain:
            bench_chain(b, best, head_best[0] if head_best else None, w_head, ceiling, results)
    finally:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_gemv.json").write_text(json.dumps(results, indent=1, default=str))
    log("best:", json.dumps(results.get("best")))


if __name__ == "__main__":
    main()
