"""`nq bench`'s prefill GEMM table: each projection of the engine's prefill at M tokens, nq's
INT4 GEMM against cuBLAS fp16 at the same shapes, in the same run.

nq: the engine's own `Prefill.gemm[kind]` (the tiles it picks for M) on the engine's uploaded
weights, one launch per layer in a row, so every launch reads another layer's weights and L2
holds none of them (the 7B's smallest, qkv, is 8 MB a layer; 28 layers are 4x the 60 MB L2).
Launches are eager, through nq/kernels/fastlaunch.py (~16 us of host time each on the H200);
the shortest, qkv and o_proj at M = 512, take ~40-90 us on the GPU, so the GPU does not wait
on Python.  (Through numba's own launch, ~94 us, the H200 measured the host there: o_proj at
512 read 0.204 ms against 0.043 graph-timed by scripts/bench_gemm.py, the reference figure.)
Median over `reps` batches after a warm-up batch (which also compiles or loads the tiles),
timed with CUDA events.

cuBLAS: torch's fp16 `x @ w.T` over one weight copy of the same (N, K), in a CUDA graph
(nq.tools.peers.graph_ms).  qkv's fp16 weight (33 MB at 7B) fits L2, which flatters cuBLAS a
little there.  TFLOP/s = 2 M N K / t, with gate_up's N both halves (2I).
"""
from __future__ import annotations

import statistics

import numpy as np

KINDS = ("qkv", "o_proj", "gate_up", "down")


def shapes(cfg) -> dict[str, tuple[int, int]]:
    """kind -> (weight rows N, K) of one layer."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": (cfg.qkv_size, h), "o_proj": (h, cfg.q_size), "gate_up": (2 * i, h),
            "down": (h, i)}


def _weights(layer, kind):
    return {"qkv": (layer.qkv_w, layer.qkv_s, layer.qkv_b), "o_proj": (layer.o_w, layer.o_s),
            "gate_up": (layer.gu_w, layer.gu_s), "down": (layer.down_w, layer.down_s)}[kind]


def time_nq(eng, kind: str, m: int, reps: int = 5) -> float:
    """Median ms of one launch of the prefill GEMM `kind` at m tokens."""
    from numba import cuda

    cfg, g = eng.cfg, eng.prefiller.gemm[kind]
    n, k = shapes(cfg)[kind]
    rng = np.random.default_rng(m + n + k)
    x = cuda.to_device((rng.standard_normal((m, k), np.float32) * 0.5).astype(np.float16))
    out = (cuda.device_array((m, cfg.intermediate_size), np.float16) if kind == "gate_up"
           else cuda.device_array((m, n if kind == "qkv" else cfg.hidden_size), np.float32))
    stream = cuda.stream()
    layers = eng.w.layers

    def batch():
        for layer in layers:
            g(x, *_weights(layer, kind), out, m, stream=stream)

    batch()                          # compiles or loads the tiles, first touch
    stream.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = cuda.event(), cuda.event()
        e0.record(stream)
        batch()
        e1.record(stream)
        e1.synchronize()
        times.append(cuda.event_elapsed_time(e0, e1) / len(layers))
    return statistics.median(times)


def time_cublas(torch, n: int, k: int, m: int, reps: int = 20) -> float:
    from nq.tools.peers import graph_ms
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    w = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
    return graph_ms(torch, lambda: torch.matmul(x, w.t()), reps)


def measure(eng, ms=(512, 8192), log=print, reps: int = 5) -> list[dict]:
    """One row per (M, kind): nq ms and TFLOP/s, cuBLAS fp16 ms and TFLOP/s (None without
    torch), then a row "layers" per M: the four kinds' sum x the layer count."""
    try:
        import torch
        if not torch.cuda.is_available():
            torch = None
    except ImportError:
        torch = None
    rows = []
    for m in ms:
        for kind, (n, k) in shapes(eng.cfg).items():
            flop = 2.0 * m * n * k
            t = time_nq(eng, kind, m, reps)
            c = time_cublas(torch, n, k, m) if torch is not None else None
            rows.append({"kind": kind, "m": m, "n": n, "k": k, "nq_ms": t,
                         "nq_tflops": flop / t * 1e-9, "cublas_ms": c,
                         "cublas_tflops": None if c is None else flop / c * 1e-9})
            log(f"nq bench: GEMM {kind} M={m}: {t:.3f} ms ({flop / t * 1e-9:.0f} TFLOP/s)"
                + ("" if c is None else f", cuBLAS fp16 {c:.3f} ms ({flop / c * 1e-9:.0f})"))
        mine = [r for r in rows if r["m"] == m]
        layers = eng.cfg.num_layers
        flop = sum(2.0 * m * r["n"] * r["k"] for r in mine) * layers
        t = sum(r["nq_ms"] for r in mine) * layers
        c = None if torch is None else sum(r["cublas_ms"] for r in mine) * layers
        rows.append({"kind": f"{layers} layers", "m": m, "n": None, "k": None, "nq_ms": t,
                     "nq_tflops": flop / t * 1e-9, "cublas_ms": c,
                     "cublas_tflops": None if c is None else flop / c * 1e-9})
    return rows


def format_gemms(rows: list[dict]) -> str:
    """The rows of `measure` as `nq bench` prints them."""
    from nq.tools.tables import cell, md_table
    header = ["M", "projection", "N x K", "nq ms", "nq TFLOP/s", "cuBLAS fp16 ms",
              "cuBLAS TFLOP/s", "nq / cuBLAS time"]
    body = [[r["m"], r["kind"], "-" if r["n"] is None else f"{r['n']} x {r['k']}",
             f"{r['nq_ms']:.3f}", f"{r['nq_tflops']:.0f}", cell(r["cublas_ms"], ".3f"),
             cell(r["cublas_tflops"], ".0f"),
             "-" if r["cublas_ms"] is None else f"{r['nq_ms'] / r['cublas_ms']:.2f}x"]
            for r in rows]
    return md_table(header, body, right={0, 3, 4, 5, 6, 7})
