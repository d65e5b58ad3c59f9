"""The PNGs `nq bench --json` writes beside its JSON (matplotlib, when installed)."""
from __future__ import annotations

import sys
from pathlib import Path


def write_plots(stem: Path, rows: list[dict], bds: list[dict]) -> list[str]:
    """<stem>_itl_vs_ctx.png and <stem>_breakdown.png; skipped (with a note) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("nq bench: plots skipped: matplotlib is not installed (pip install matplotlib)",
              file=sys.stderr, flush=True)
        return []
    paths = []
    tg = sorted((r for r in rows if r["itl_p50_ms"] is not None), key=lambda r: r["ctx"])
    if tg:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["ctx"] for r in tg], [r["itl_p50_ms"] for r in tg], "o-", label="ITL p50")
        ax.plot([r["ctx"] for r in tg], [r["itl_p90_ms"] for r in tg], "x--", label="ITL p90")
        if bds:
            ax.plot([b["ctx"] for b in bds], [b["regions_ms"].get("paged_attention", 0) for b in bds],
                    "s:", label="paged_attention alone")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="context (tokens)", ylabel="ms / token", title="decode ITL vs context")
        ax.grid(alpha=0.3)
        ax.legend()
        paths.append(str(stem) + "_itl_vs_ctx.png")
        fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
        plt.close(fig)
    if bds:
        fig, ax = plt.subplots(figsize=(7, 4))
        parts = list(bds[0]["regions_ms"]) + ["kernel_gap"]
        bottom = [0.0] * len(bds)
        labels = [str(b["ctx"]) for b in bds]
        for p in parts:
            vals = [b["kernel_gap_ms"] if p == "kernel_gap" else b["regions_ms"][p] for b in bds]
            ax.bar(labels, vals, bottom=bottom, label=p)
            bottom = [x + y for x, y in zip(bottom, vals)]
        ax.set(xlabel="context (tokens)", ylabel="ms / token",
               title="ITL breakdown (norms fused into the GEMVs)")
        ax.legend(fontsize=7, bbox_to_anchor=(1.01, 1), loc="upper left")
        paths.append(str(stem) + "_breakdown.png")
        fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
        plt.close(fig)
    return paths
