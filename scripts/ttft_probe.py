"""Quick TTFT probe: a random-weight engine of a preset, prefill timings of a few prompt
lengths (wall clock, ids on the host to logits on the host), median of runs.

    python3 scripts/ttft_probe.py 7b 512,2048
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
for n in lengths:
    ids = np.random.default_rng(n).integers(0, eng.cfg.vocab_size, n)
    ts = []
    for _ in range(4):
        eng.reset()
        t = time.perf_counter()
        eng.prefill(ids)
        ts.append(1e3 * (time.perf_counter() - t))
    print(f"TTFT {name} {n} tokens: runs {['%.1f' % x for x in ts]} ms, median of the last 3 "
          f"{np.median(ts[1:]):.1f} ms", flush=True)
