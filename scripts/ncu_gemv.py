"""Launch each default 7B INT4 GEMV a few times, eagerly, for Nsight Compute to read.

    source scripts/h200_env.sh
    ncu --clock-control none --kernel-name regex:gemv_mma_down --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis --section Occupancy python3 scripts/ncu_gemv.py

Each launch reads its own copy of the weights (4 copies, so the one profiled is not in L2
from the launch before it, as in the decode step).  `--tiling kind=N,threads[,key=value...]`
profiles another tiling of the default's type, N its first field (a Tiling's ks, an
MmaTiling's warps), e.g. `--tiling down=8,512` or `--tiling gate_up=4,256,span=32`.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import bench_gemv as B  # noqa: E402
from nq.kernels.int4.tiling import MmaTiling, Tiling, default_tiling  # noqa: E402


def parse_tiling(kind: str, spec: str) -> Tiling | MmaTiling:
    n_out, k, _ = B.SHAPES[kind]
    base = default_tiling(kind, n_out, k)
    head, *rest = spec.split(",")
    fields = {dataclasses.fields(base)[0].name: int(head)}
    for i, item in enumerate(rest):
        if "=" in item:
            key, value = item.split("=")
            fields[key] = int(value)
        elif i == 0:
            fields["threads"] = int(item)
    return dataclasses.replace(base, **fields)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="qkv,o_proj,gate_up,down")
    ap.add_argument("--tiling", action="append", default=[], help="kind=ks,threads[,key=value]")
    ap.add_argument("--launches", type=int, default=4)
    args = ap.parse_args()
    overrides = dict(t.split("=", 1) for t in args.tiling)
    b = B.Buffers()
    for kind in args.kinds.split(","):
        n_out, k, n_rows = B.SHAPES[kind]
        t = parse_tiling(kind, overrides[kind]) if kind in overrides else default_tiling(kind, n_out, k)
        g = B.make(kind, t)
        ws = [(B.dev_u32(n_rows, k // 8), B.dev_f16(n_rows, k // 128)) for _ in range(args.launches)]
        for qw, sc in ws:
            B.launcher(kind, g, b, qw, sc)(0)
        torch.cuda.synchronize()
        print(f"{kind}: {t.tag()} grid {g.grid} x {g.block}, {B.kernel_info(g)}", flush=True)
        del ws


if __name__ == "__main__":
    main()
