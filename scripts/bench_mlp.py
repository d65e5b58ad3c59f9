"""A layer's MLP alone: the step's two kernels (gate_up, then down) against the fused kernel
(nq/kernels/int4/gemv_mlp.py) and its phases, in microseconds a layer.

    python3 scripts/bench_mlp.py                                # the default MlpTiling
    python3 scripts/bench_mlp.py "slots=4" "slots=8 fill=0"     # MlpTiling fields, a case each

Random 7B-shaped weights for `--layers` layers (4: 420 MB, so L2 holds none of the next
layer's), one graph of the layers' kernels with programmatic edges as the step's, median of
`--reps` replays.  Rows: gate_up + down (the step's), each alone, then per case the fused
kernel, its phase 1 alone (gate_up and SwiGLU; the ring's fill is not issued) and its phase 2
alone (down through the ring, its fill issued at the start).  These are kernels alone: the step
(scripts/step_variants.py "mlp.slots=8") is what decides."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_case(text: str):
    from nq.kernels.int4.gemv_mlp import MlpTiling
    fields = {}
    for item in text.split():
        k, _, v = item.partition("=")
        fields[k] = int(v)
    return dataclasses.replace(MlpTiling(), **fields)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cases", nargs="*", default=[""])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args(argv)
    import numpy as np
    from numba import cuda

    from nq.config import PRESETS
    from nq.kernels.int4.launch import make_mlp_gemv
    from nq.runtime.graphs import CapturedGraph
    from nq.runtime.weights import gemvs, random_device_weights

    cfg = dataclasses.replace(PRESETS["7b"], num_layers=a.layers)
    w = random_device_weights(cfg)
    g = gemvs(cfg)
    gu, dn = g["gate_up"], g["down"]
    rng = np.random.default_rng(0)
    x = cuda.to_device(rng.standard_normal(cfg.hidden_size).astype(np.float32))
    act = cuda.to_device(np.zeros(cfg.intermediate_size, np.float16))
    bars = cuda.to_device(np.zeros((a.layers, 2), np.uint32))
    stream = cuda.stream()

    def timed(name, fn):
        graph = CapturedGraph(stream, fn, name="bench_mlp", programmatic=True)
        us = graph.median_ms(a.reps, warmup=3) * 1000 / a.layers
        print(f"{name:44s} {us:8.2f} us a layer", flush=True)

    def each(step):
        return lambda: [step(L, i) for i, L in enumerate(w.layers)]

    def gate_up(L, i):
        gu(x, L.post_norm, L.gu_w, L.gu_s, act, stream)

    def down(L, i):
        dn(act, L.down_w, L.down_s, x, stream)

    timed("gate_up + down (the step's)", each(lambda L, i: (gate_up(L, i), down(L, i))))
    timed("gate_up alone", each(gate_up))
    timed("down alone", each(down))
    for text in a.cases:
        t = parse_case(text)
        m = make_mlp_gemv(cfg, t)
        for phases, what in ((3, "fused"), (1, "phase 1"), (2, "phase 2")):
            timed(f"{what} {t.tag()}", each(lambda L, i, p=phases: m(
                x, L.post_norm, L.gu_w, L.gu_s, L.down_w, L.down_s, act, bars[i], stream,
                phases=p)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
