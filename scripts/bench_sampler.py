"""Benchmark: the device sampler at Qwen2.5-Instruct's defaults against greedy argmax, over
152,064 fp32 logits, each timed as CUDA-event replays of a captured graph (PDL edges, as in the
decode step), plus the cost of the sampler's passes that do nothing at these settings.

    python3 scripts/bench_sampler.py [--reps 2000] [--json]

Reports microseconds a step for argmax, for the sampler under several controls, and how many
levels the sampler resolved.  Logits are LM-like (a normal tail and a few dozen high tokens)
and stay in L2 between replays, as in the decode step, where lm_head has just written them.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

V, VALID = 152064, 151665

CONTROLS = {
    "qwen (T0.7 k20 p0.8 rep1.05)": dict(temperature=0.7, top_k=20, top_p=0.8,
                                         repeat_penalty=1.05, repeat_last_n=-1),
    "greedy via sampler": dict(temperature=0),
    "top_p 0.95 (k off)": dict(top_k=0, top_p=0.95, temperature=1.0),
    "min_p 0.05 (k off)": dict(top_k=0, top_p=1.0, min_p=0.05),
    "k off, p off": dict(top_k=0, top_p=1.0),
    "top_k 1000": dict(top_k=1000, top_p=1.0),
}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def main():
    from numba import cuda

    from nq.kernels import sampling as argmax
    from nq.kernels.sampler import Sampler
    from nq.kernels.sampler import kernels as K
    from nq.paged import STATE_LEN
    from nq.tools.bench import graph_ms

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--json", action="store_true", help="one JSON line on stdout")
    args = ap.parse_args()

    stream = cuda.stream()
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(V).astype(np.float32) * np.float32(2.5)
    hot = rng.choice(VALID, 40, replace=False)
    logits[hot] += np.float32(12) + rng.standard_normal(40).astype(np.float32) * 3
    d_logits = cuda.to_device(logits, stream=stream)
    state = cuda.to_device(np.zeros(STATE_LEN, np.int32), stream=stream)
    out = cuda.device_array(4096, np.int32)
    s = Sampler(V, VALID, max_len=4096)
    s.seed_history(rng.integers(0, VALID, 1000).astype(np.int32), stream)

    def timed(fn, reps):
        fn()
        stream.synchronize()
        return 1e3 * graph_ms(stream, fn, reps, warmup=20, programmatic=True)

    results = {}
    am = argmax.argmax_launcher(d_logits, state, out, argmax.argmax_workspace())
    results["argmax"] = timed(lambda: am(stream), args.reps)
    log(f"argmax                          {results['argmax']:8.2f} us")

    for name, kw in CONTROLS.items():
        s.set_params(s.pack(seed=7, **kw), stream)
        # the history grows by one token a replay; keep it from filling the ring
        s.truncate_history(1000, stream)
        state.copy_to_device(np.array([0, 1000, 0, 0], np.int32), stream=stream)
        us = timed(lambda: s.launch(d_logits, state, out, stream), min(args.reps, 2000))
        # how many select passes did work on one step: replay once and read the depth reached
        s.truncate_history(1000, stream)
        state.copy_to_device(np.array([0, 1000, 0, 0], np.int32), stream=stream)
        s.launch(d_logits, state, out, stream)
        ctl = s.ctl.copy_to_host()
        results[name] = us
        log(f"{name:32s}{us:8.2f} us   (levels resolved {int(ctl[K.C_DEPTH])}, "
            f"{s.passes} select launches)")
    # pass A alone (penalties, max, first histogram, plan) at the Qwen settings
    s.set_params(s.pack(seed=7, **CONTROLS["qwen (T0.7 k20 p0.8 rep1.05)"]), stream)
    s.truncate_history(1000, stream)
    state.copy_to_device(np.array([0, 1000, 0, 0], np.int32), stream=stream)
    a_only = timed(lambda: s.penalize[s.nb, s.threads, stream](
        d_logits, state, s.params, s.counts, s.ctx, s.pen, s.ctl, s.hist_cnt), args.reps)
    results["penalize pass alone"] = a_only
    log(f"{'penalize pass alone':32s}{a_only:8.2f} us")
    # the floor: every select launch a no-op (mode DONE), i.e. what an idle pass costs
    ctl = s.ctl.copy_to_host()
    ctl[K.C_MODE] = K.MODE_DONE
    s.ctl.copy_to_device(ctl, stream=stream)
    noop = timed(lambda: [s.select[s.nb, s.threads, stream, s.smem](
        s.pen, state, s.params, out, s.ctl, s.hist_cnt, s.hist_mass, s.cand)
        for _ in range(s.passes)], args.reps) / s.passes
    results["idle select pass"] = noop
    log(f"{'idle select pass':32s}{noop:8.2f} us")
    if args.json:
        print(json.dumps({"us": results, "vocab": V, "valid": VALID, "nb": s.nb,
                          "threads": s.threads, "bits": s.bits, "passes": s.passes}))


if __name__ == "__main__":
    main()
