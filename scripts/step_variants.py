"""Time kernel variants where they matter: inside the whole decode step graph, not alone.

A GEMV tiling that wins alone can lose in the step (docs/PERF.md, "GEMV grids, one wave"):
with programmatic dependent launch the next kernel's blocks start beside the running one's,
so what counts is the step.  This script builds the 7B-shaped engine once (random weights made
on the GPU) and, for each variant, rebuilds the step with other GEMV tilings or attention
options (`Engine.variant`), recaptures it and times decode steps at each context.

    python3 scripts/step_variants.py --ctx 512,8192 \\
        "down.warps=8" "down.mma=0 down.threads=256" "attn.early=1" --leave-out

A variant is space-separated `kind.field=value` settings: kind is a GEMV (qkv, o_proj,
gate_up, down; fields of its tiling, nq.kernels.int4.tiling: a Tiling's ks, rows, threads,
prefetch, span, min_blocks, early, an MmaTiling's warps, threads, min_blocks -- a new ks reads the
weights in the wrong order, which is fine for timing random weights and nothing else;
`kind.mma=0` / `kind.mma=1` first switches o_proj, down or gate_up to the shape's CUDA-core /
tensor-core tiling, `tiling.mma_tiling`; gate_up.mma=1 is what NQ_MMA_GATE_UP=1 makes default)
or `attn` (keywords of nq.kernels.attention.decode_launcher: consumers, nstage,
rows_per_copy, min_pps, early, ppc -- e.g. "attn.consumers=2"; and max_splits, the split
kernel's grid width a kv head, up to the engine's default), or rope.fused=1 (the qkv_rope GEMV instead of qkv + rope_kv;
its tiling: qkv_rope.field=value), or pdl.full=NAME[+NAME...] (the graph's edges into kernels
whose names contain NAME left as full dependencies, the rest programmatic: where PDL costs).
The baseline is timed first and last (drift between them is printed).  --rounds R times the
baseline and every variant R times in turn (baseline, variants; baseline, variants; ...) and
ends with each variant's difference from its own round's baseline, the median over rounds and
its range: drift between rounds (0.005-0.017 ms on the H100 of 2026-12-07) is as large as the
levers it measures, and a difference paired inside a round cancels most of it.  --leave-out also
times the step with each region left out (the results are garbage, the timing is not): a
region's marginal cost in the step.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nq.config import PRESETS  # noqa: E402


def parse_variant(text: str, defaults: dict, engines: dict | None = None
                  ) -> tuple[dict, dict, bool | None]:
    """'down.warps=8 attn.early=1 rope.fused=1' -> ({kind: tiling}, {attn keyword: value},
    fuse_rope).  defaults: {kind: its default tiling}; engines: {kind: (CUDA-core tiling,
    tensor-core tiling or None)}, what kind.mma=0 / kind.mma=1 switch to."""
    tilings, attn, rope = {}, {}, None
    for item in text.split():
        key, _, value = item.partition("=")
        kind, _, field = key.partition(".")
        if not value or not field:
            raise SystemExit(f"step_variants: {item!r} is not kind.field=value")
        try:
            v = int(value)
        except ValueError:
            try:
                v = float(value)
            except ValueError:
                v = value
        if kind == "attn":
            attn[field] = bool(v) if field == "early" else v
        elif kind == "pdl":
            if field != "full":
                raise SystemExit(f"step_variants: {item!r}: pdl takes full=NAME[+NAME...] "
                                 f"(edges into kernels so named left full)")
            attn["pdl_full"] = str(v)
        elif kind == "rope" and field == "fused":
            rope = bool(v)
        elif kind in defaults and field == "mma":
            t = (engines or {}).get(kind, (None, None))[bool(v)]
            if t is None:
                raise SystemExit(f"step_variants: {item!r}: no such tiling for {kind}")
            tilings[kind] = t
        elif kind in defaults:
            base = tilings.get(kind, defaults[kind])
            try:
                tilings[kind] = dataclasses.replace(base, **{field: v})
            except TypeError:
                names = [f.name for f in dataclasses.fields(base)]
                raise SystemExit(f"step_variants: {item!r}: {type(base).__name__} has no field "
                                 f"{field!r}; one of {names} (or mma=0/1)") from None
        else:
            raise SystemExit(f"step_variants: unknown kind {kind!r} in {item!r}")
    return tilings, attn, rope


def itl(eng, ctx: int, steps: int) -> float:
    from nq.tools.bench import at_context
    at_context(eng, ctx, ahead=steps + 8)
    return statistics.median(eng.time_steps(steps))


def paired(rows: list[dict], ctxs: list[int]) -> list[dict]:
    """Each variant's difference from the baseline of its own round, over the rounds: rows are
    the timings in run order, each with "variant", "round" and ms at every context; a round's
    baseline is its row named "baseline".  -> [{"variant", ctx: (median, lo, hi), ...}] in the
    order variants first appear, the baseline's own round-to-round change (against round 0's)
    first."""
    base = {r["round"]: r for r in rows if r["variant"] == "baseline"}
    if not base:
        raise ValueError("paired: no baseline row")
    names = list(dict.fromkeys(r["variant"] for r in rows))
    out = []
    for name in names:
        mine = [r for r in rows if r["variant"] == name and r["round"] in base]
        row = {"variant": name, "rounds": len(mine)}
        for c in ctxs:
            d = sorted(r[c] - base[min(base) if name == "baseline" else r["round"]][c]
                       for r in mine)
            row[c] = (statistics.median(d), d[0], d[-1])
        out.append(row)
    return out


def regs(eng) -> dict:
    """Registers per thread of the step's GEMV kernels (numba dispatchers), and each grid's
    blocks x threads: a grid of more blocks than SMs piles its early blocks up under PDL
    (docs/KERNELS_GEMV.md, "One wave for the family's grids")."""
    from nq.kernels.int4.launch import make_qkv_rope_gemv
    from nq.runtime.weights import gemvs
    out = {}
    given = getattr(eng, "_tilings", None) or {}
    tilings = {k: t for k, t in given.items() if k != "qkv_rope"}
    kernels = gemvs(eng.cfg, tilings, check_layout=False)
    try:   # qkv_rope too: its registers decide whether its blocks fit beside down's (PERF.md 0.38)
        kernels["qkv_rope"] = make_qkv_rope_gemv(eng.cfg, given.get("qkv_rope"))
    except Exception:  # noqa: BLE001 -- informative only
        pass
    for kind, g in kernels.items():
        try:
            local = g.kernel.get_local_mem_per_thread()
            r = g.kernel.get_regs_per_thread()
            out[kind] = (f"{r}" if not local else f"{r} + {local} B local") + \
                f" {g.grid}x{g.block}"
        except Exception:  # noqa: BLE001 -- informative only
            pass
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="*")
    ap.add_argument("--random", default="7b", choices=sorted(PRESETS))
    ap.add_argument("--ctx", default="512")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1,
                    help="time the baseline and the variants this many times in turn and "
                         "report differences paired within a round")
    ap.add_argument("--leave-out", action="store_true")
    ap.add_argument("--region", default="",
                    help="regions (eng.regions' names, comma-separated) also timed alone for "
                         "each variant at each context, as `nq bench` times them")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    from nq.runtime.engine import Engine
    from nq.runtime.graphs import CapturedGraph
    from nq.runtime.weights import gemvs
    from nq.tools.bench import at_context, region_ms

    ctxs = [int(c) for c in a.ctx.split(",")]
    cfg = PRESETS[a.random]
    t0 = time.perf_counter()
    eng = Engine.random(cfg, max_len=max(ctxs) + 16 * a.steps + 64)
    print(f"engine built in {time.perf_counter() - t0:.1f} s", flush=True)
    from nq.kernels.int4 import default_tiling, make_qkv_rope_gemv, mma_tiling
    launchers = gemvs(cfg)
    defaults = {k: g.tiling for k, g in launchers.items()}
    defaults["qkv_rope"] = make_qkv_rope_gemv(cfg).tiling
    engines = {k: (default_tiling(k, g.n_out, g.k, mma=False), mma_tiling(k, g.n_out, g.k))
               for k, g in launchers.items()}
    results = []

    if a.rounds < 1:
        raise SystemExit(f"step_variants: --rounds {a.rounds}: at least 1")
    parsed = [(v, parse_variant(v, defaults, engines)) for v in a.variants]  # refused up front

    def run(name, tilings, attn, rope=None, rnd=0):
        t1 = time.perf_counter()
        full = tuple(f for f in (attn or {}).pop("pdl_full", "").split("+") if f)
        eng.variant(tilings, attn, check_layout=False, fuse_rope=rope)  # random weights: timing only
        if full:   # edges into these kernels as full dependencies (the rest programmatic)
            eng.capture(True, full_into=full)
        eng._tilings = tilings
        row = {"variant": name, "round": rnd, "regs": regs(eng)}
        for c in ctxs:
            row[c] = itl(eng, c, a.steps)
            for region in filter(None, a.region.split(",")):
                at_context(eng, c, ahead=8)
                row[f"{region}@{c}"] = region_ms(eng, region, replays=100)
        results.append(row)
        base = [r for r in results if r["variant"] == "baseline" and r["round"] == rnd][0]
        alone = "".join(f"  {k} alone {v:.4f} ms" for k, v in row.items()
                        if isinstance(k, str) and "@" in k)
        print(f"{name:48s} " + "  ".join(f"@{c}: {row[c]:.4f} ms ({row[c] - base[c]:+.4f})"
                                         for c in ctxs)
              + alone + f"  regs {row['regs']}  [{time.perf_counter() - t1:.1f} s]", flush=True)

    for rnd in range(a.rounds):
        run("baseline", None, None, rnd=rnd)
        for v, (tilings, attn, rope) in parsed:
            run(v, tilings and dict(tilings), attn and dict(attn), rope, rnd=rnd)  # run pops
    run("baseline (again)", None, None, rnd=a.rounds - 1)
    if a.rounds > 1:
        print(f"\npaired with each round's baseline over {a.rounds} rounds, ms: median (lo..hi)",
              flush=True)
        for row in paired(results, ctxs):
            name = row["variant"] + (" (against round 0)" if row["variant"] == "baseline" else "")
            print(f"{name:48s} " + "  ".join(
                f"@{c}: {row[c][0]:+.4f} ({row[c][1]:+.4f}..{row[c][2]:+.4f})" for c in ctxs),
                flush=True)
    if a.leave_out:
        eng.variant()
        for region in eng.regions:
            if region == "embed":
                continue
            keep = set(eng.regions) - {region}
            g = CapturedGraph(eng.stream, lambda: eng.run_eager(regions=keep), name="leave_out",
                              programmatic=True)
            eng.graph, saved = g, eng.graph
            row = {"variant": f"without {region}"}
            for c in ctxs:
                row[c] = itl(eng, c, a.steps)
            eng.graph = saved
            results.append(row)
            print(f"{row['variant']:48s} " + "  ".join(
                f"@{c}: {row[c]:.4f} ms (region costs {results[0][c] - row[c]:.4f})" for c in ctxs),
                flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
