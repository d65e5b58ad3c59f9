"""Quick TTFT probe: a random-weight engine of a preset, prefill timings of a few prompt
lengths (wall clock, ids on the host to logits on the host), median of runs, and what the
host spends enqueueing the prefill's eager launches (1 + 8 a layer a chunk) against it.

    python3 scripts/ttft_probe.py 7b 16,64,512,2048

"enqueue" is the time Prefill.run takes to return (the launches queued, the GPU still
working); when it is close to the TTFT, the host's launches, not the GPU, set the pace.
"""
import sys
import time

import numpy as np

from nq.config import PRESETS
from nq.kernels import build
from nq.runtime.engine import Engine

name, lengths = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
t = time.perf_counter()
eng = Engine.random(PRESETS[name], max_len=max(lengths) + 64)
print(f"engine {time.perf_counter() - t:.1f} s; {build.STATS}; startup {eng.startup}", flush=True)
pre = eng.prefiller
for n in lengths:
    ids = np.random.default_rng(n).integers(0, eng.cfg.vocab_size, n)
    ts, enq = [], []
    for _ in range(4):
        eng.reset()
        t = time.perf_counter()
        eng.prefill(ids)
        ts.append(1e3 * (time.perf_counter() - t))
        if n > 1:  # the prefill alone: enqueue time, then until the GPU is done
            eng.reset()
            eng._reserve(n)
            eng.prompt[:n].copy_to_device(ids.astype(np.int32), stream=eng.stream)
            eng.stream.synchronize()
            t = time.perf_counter()
            pre.run(0, 0, n, eng.stream)
            e = time.perf_counter()
            eng.stream.synchronize()
            enq.append((1e3 * (e - t), 1e3 * (time.perf_counter() - t)))
    line = (f"TTFT {name} {n} tokens: runs {['%.1f' % x for x in ts]} ms, median of the last 3 "
            f"{np.median(ts[1:]):.1f} ms")
    if enq:
        q, d = np.median([x[0] for x in enq[1:]]), np.median([x[1] for x in enq[1:]])
        line += f"; prefill of {n} alone {d:.1f} ms, of which enqueueing {q:.1f} ms"
    print(line, flush=True)
eng.reset()
