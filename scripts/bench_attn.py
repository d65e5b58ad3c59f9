"""Benchmark: paged attention decode for the 7B shape (28 q heads, 4 kv heads, d 128), timed
inside a CUDA graph of 28 layer launches (each layer its own KV pages, so L2 cannot hold the
working set beyond ~2K context), plus the small per-step kernels.

Prints per-layer time, KV bytes read (2 x len x 4 heads x 128 x 2 B), GB/s and the fraction of
the device-to-device copy ceiling measured in the same run; and the 28-layer sum.
    python3 scripts/bench_attn.py [--lengths 512,2048,8192,16384,32768] [--reps 20]
    python3 scripts/bench_attn.py --variants 2:3:1,1:3:4,4:2:1 --max-splits 33,66 --min-pps 2
Variants are consumers:nstage:rows_per_copy of nq.kernels.attention.decode_launcher (default:
the launcher's 1:3:4); --max-splits takes a comma-separated sweep.  Results go to stderr and,
as one JSON line, to stdout.  (The fp32 kernel's `--kernel fp32` left with it: commit 13c221c.)
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def time_graph(fn, stream, reps):
    """ms per replay of a graph capturing fn(stream) (warmed up once, eagerly)."""
    from numba import cuda
    from nq.runtime.graphs import CapturedGraph
    fn(stream)
    stream.synchronize()
    g = CapturedGraph(stream, lambda: fn(stream))
    for _ in range(3):
        g.replay(stream)
    e0, e1 = cuda.event(), cuda.event()
    e0.record(stream)
    for _ in range(reps):
        g.replay(stream)
    e1.record(stream)
    e1.synchronize()
    return cuda.event_elapsed_time(e0, e1) / reps


def copy_ceiling(stream, nbytes=1 << 30):
    """Device-to-device copy bandwidth (read + write bytes / s)."""
    from numba import cuda
    a = cuda.device_array(nbytes // 4, np.float32, stream=stream)
    b = cuda.device_array(nbytes // 4, np.float32, stream=stream)
    b.copy_to_device(a, stream=stream)
    e0, e1 = cuda.event(), cuda.event()
    e0.record(stream)
    for _ in range(10):
        b.copy_to_device(a, stream=stream)
    e1.record(stream)
    e1.synchronize()
    return 2 * nbytes * 10 / (cuda.event_elapsed_time(e0, e1) * 1e-3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="512,2048,8192,16384,32768")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", default="1:3:4", help="consumers:nstage:rows_per_copy, ...")
    ap.add_argument("--min-pps", type=int, default=None,
                    help="fewest pages a split (default: the launcher's, plan.MIN_PPS)")
    ap.add_argument("--max-splits", default=None,
                    help="grid width of the split kernel, comma-separated sweep (default: "
                         "plan.default_max_splits, ~2 CTAs per SM over the kv heads)")
    ap.add_argument("--tma", type=int, default=None, metavar="K",
                    help="tensor-map copies (decode_launcher's tma) from K pages a split "
                         "(tma_from; 0: always)")
    ap.add_argument("--ppc", type=int, default=0,
                    help="pages a consumer (decode_launcher's ppc; 0: every consumer always)")
    args = ap.parse_args()

    from numba import cuda

    from nq.config import PRESETS
    from nq.kernels import embed, rmsnorm, rope_kv
    from nq.kernels import sampling as argmax
    from nq.kernels import attention
    from nq.kernels.attention import plan
    from nq.paged import pages_for, pool_shape
    from nq.runtime.kv_cache import make_state

    cfg = PRESETS["7b"]
    L = cfg.num_layers
    lengths = [int(x) for x in args.lengths.split(",")]
    stream = cuda.stream()
    ceil = copy_ceiling(stream)
    log(f"copy ceiling (device-to-device, read+write): {ceil / 1e12:.2f} TB/s")

    max_pages = pages_for(max(lengths))
    n_pages = max_pages  # per layer pool pages
    rng = np.random.default_rng(0)
    pool = cuda.device_array(pool_shape(cfg, n_pages), np.float16)  # (L, n_pages, 4, 2, 16, 128)
    # Fill with small random values (a device-side fill: uploading 1.9 GB from the host is slow).
    fill = cuda.to_device((rng.standard_normal(pool_shape(cfg, 64)[1:]) * 0.5).astype(np.float16))
    for l in range(L):
        for p0 in range(0, n_pages, 64):
            n = min(64, n_pages - p0)
            pool[l, p0:p0 + n].copy_to_device(fill[:n], stream=stream)
    table = cuda.to_device(rng.permutation(n_pages).astype(np.int32))
    q = cuda.to_device(rng.standard_normal(cfg.q_size).astype(np.float32))
    o = cuda.device_array(cfg.q_size, np.float16)
    state = make_state()
    results = {"ceiling_TBps": ceil / 1e12, "attn": []}
    sweep = [int(x) for x in args.max_splits.split(",")] if args.max_splits else [None]
    min_pps = plan.MIN_PPS if args.min_pps is None else args.min_pps

    for max_splits in sweep:
        pa, pm = attention.decode_workspace(cfg, max_splits)
        for variant in args.variants.split(","):
            nc, nst, rpc = (int(x) for x in variant.split(":"))
            kw = dict(consumers=nc, nstage=nst, rows_per_copy=rpc, min_pps=min_pps)
            if args.ppc:
                kw["ppc"] = args.ppc
            if args.tma is not None:
                kw.update(tma=True, tma_from=args.tma)
            name = (f"c={nc} st={nst} rpc={rpc} min_pps={min_pps} "
                    f"smem={plan.smem_bytes(cfg.head_dim, nc, nst, rpc)}")
            try:
                launchers = [attention.decode_launcher(cfg, q, state, table, pool[l], o, pa, pm,
                                                       **kw) for l in range(L)]
            except Exception as e:  # an opt-in variant past 227 KiB is refused
                log(f"variant {variant}: skipped ({type(e).__name__}: {e})")
                continue
            for length in lengths:
                st = np.zeros(state.shape, np.int32)
                st[1] = length - 1
                state.copy_to_device(st, stream=stream)
                ms = time_graph(lambda s: [f(s) for f in launchers], stream, args.reps)
                per_layer_us = ms * 1e3 / L
                nbytes = 2 * length * cfg.num_kv_heads * cfg.head_dim * 2
                bw = nbytes / (per_layer_us * 1e-6)
                _, n_splits = plan.split_plan(length, pa.shape[0], min_pps)
                log(f"{name} max_splits={pa.shape[0]} len={length:6d}: {per_layer_us:7.2f} us/layer, "
                    f"28 layers {ms * 1e3:8.1f} us, {nbytes / 1e6:6.1f} MB/layer, "
                    f"{bw / 1e9:7.1f} GB/s = {bw / ceil * 100:5.1f}% of copy, splits {n_splits}")
                results["attn"].append(dict(variant=variant, **kw, max_splits=pa.shape[0],
                                            length=length, us_per_layer=per_layer_us,
                                            us_28_layers=ms * 1e3, GBps=bw / 1e9, frac=bw / ceil))

    # Small per-step kernels, each alone in a graph of 28 launches (per-launch time).
    hid = cfg.hidden_size
    x = cuda.device_array(hid, np.float32)
    h = cuda.device_array(hid, np.float16)
    w = cuda.to_device(np.ones(hid, np.float16))
    qkv = cuda.to_device(rng.standard_normal(cfg.qkv_size).astype(np.float32))
    inv = cuda.to_device(rope_kv.rope_inv_freq(cfg.head_dim, cfg.rope_theta))
    emb = cuda.device_array((cfg.vocab_size, hid), np.float16)
    logits = cuda.to_device(rng.standard_normal(cfg.vocab_size).astype(np.float32))
    ring = cuda.device_array(4096, np.int32)
    st = np.zeros(state.shape, np.int32)
    st[1] = 1000
    state.copy_to_device(st, stream=stream)
    small = {
        "rope_kv": rope_kv.rope_kv_launcher(cfg, qkv, state, inv, table, pool[0], q),
        "embed": embed.embed_launcher(emb, state, x),
        "rmsnorm": rmsnorm.rmsnorm_launcher(x, w, h, 1e-6),
        "argmax": argmax.argmax_launcher(logits, state, ring, argmax.argmax_workspace()),
    }
    results["small_us"] = {}
    for name, f in small.items():
        us = time_graph(lambda s: [f(s) for _ in range(28)], stream, args.reps) * 1e3 / 28
        results["small_us"][name] = us
        log(f"{name:8s}: {us:6.2f} us per launch (in a graph of 28)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
