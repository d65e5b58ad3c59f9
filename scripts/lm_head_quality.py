"""What a quantised lm_head (`nq pack --lm-head int8|int4`) does to the logits, on the CPU.

    python3 scripts/lm_head_quality.py                        # 0.5B shape, 2 layers, 100 prompts
    python3 scripts/lm_head_quality.py --size 7b --init ref   # the 7B's width (untied head)
    python3 scripts/lm_head_quality.py --head int4            # one head only (default both)

A random Qwen2-shaped model (a preset's width, few layers) runs through the NumPy reference
(nq.ref) once per prompt; its final normed hidden states then meet the lm_head as a default
pack stores it (fp16) and as `--lm-head int8` (quant.quantize_int8_rows of the same source)
and `--lm-head int4` (quant.quantize_pack, INT4 g128 as the projections) store it,
dequantised: what `nq verify` and the kernels compute.  At every position of every prompt,
for each quantised head: top-1 agreement, and |head - fp16| over the fp16 logits' spread
(max - min), its max (and the median over positions of a position's max, the figure `nq
verify` quotes for the engine against the reference) and mean; the largest fp16 top-2 gap
among the flips says how near a tie a position must be for the quantised head to change the
greedy token.  For
scale, the same figures for the fp16 head against the fp32 source it was rounded from (the
rounding every default pack already carries).

Two initialisations: `ref` (nq.ref.random_weights: weights scaled by fan-in, logits spread
over several units) and `hf` (synth.random_hf_weights: N(0, 0.02) as HF initialises, near-flat
logits with many near-ties).  Random weights have no outlier rows and no heavy-tailed logit
gaps; docs/PERF.md says what that leaves unknown about a trained model.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nq.config import PRESETS  # noqa: E402
from nq.loader.quant import (dequantize_int8_rows, dequantize_packed,  # noqa: E402
                             quantize_int8_rows, quantize_pack)
from nq.ref import KVCache, RefModel, random_weights, rms_norm  # noqa: E402


def model_weights(cfg, init: str, seed: int) -> dict:
    if init == "ref":
        return random_weights(cfg, seed)
    from nq.loader.synth import random_hf_weights
    from nq.loader.weights import hf_to_host
    return hf_to_host(cfg, random_hf_weights(cfg, seed))


def heads(w: dict, cfg, kinds) -> tuple[np.ndarray, dict]:
    """(fp16 head, {kind: quantised head}) as fp32 (V, H): what the packs store, dequantised."""
    src = w["embed_tokens"] if cfg.tie_word_embeddings else w["lm_head"]
    quant = {"int8": lambda: dequantize_int8_rows(*quantize_int8_rows(src)),
             "int4": lambda: dequantize_packed(*quantize_pack(src))}
    return src.astype(np.float16).astype(np.float32), {k: quant[k]() for k in kinds}


def final_hidden(model: RefModel, ids: np.ndarray) -> np.ndarray:
    """rmsnorm(x) after the last layer at every position of one prompt: (T, H) fp32."""
    cfg = model.cfg
    cache = KVCache(cfg, max_len=len(ids))
    cache.reserve(len(ids))
    x = model.w["embed_tokens"][ids]
    positions = np.arange(len(ids))
    for i in range(cfg.num_layers):
        x = model.layer(i, x, positions, cache)
    return rms_norm(x, model.w["norm"], cfg.rms_norm_eps)


def measure(size: str, layers: int, init: str, prompts: int, prompt_len: int, seed: int,
            kinds=("int8", "int4")) -> list[dict]:
    """One row a quantised head kind (module doc)."""
    cfg = PRESETS[size].replace(num_layers=layers, name=f"{PRESETS[size].name}-{layers}layers")
    t0 = time.perf_counter()
    w = model_weights(cfg, init, seed)
    w16, wq = heads(w, cfg, kinds)
    model = RefModel(cfg, w)
    del w
    rng = np.random.default_rng(seed + 1)
    st = {k: {"agree": 0, "rel_max": 0.0, "rel_sum": 0.0, "flips": [], "pos_max": []}
          for k in kinds}
    total, base_agree, base_max, spreads, gaps = 0, 0, 0.0, [], []
    for _ in range(prompts):
        h = final_hidden(model, rng.integers(0, cfg.vocab_size, prompt_len))
        l16 = h @ w16.T                                            # (T, V) fp32
        l32 = h @ model.w["lm_head"].T                             # the unrounded source
        spread = l16.max(axis=1) - l16.min(axis=1)
        top2 = np.sort(l16, axis=1)[:, -2:]
        gap = (top2[:, 1] - top2[:, 0]) / spread
        for k, wk in wq.items():
            lq, r = h @ wk.T, st[k]
            d = np.abs(lq - l16) / spread[:, None]
            r["rel_max"] = max(r["rel_max"], float(d.max()))
            r["rel_sum"] += float(d.mean(axis=1).sum())
            r["pos_max"] += d.max(axis=1).tolist()
            same = l16.argmax(axis=1) == lq.argmax(axis=1)
            r["agree"] += int(same.sum())
            r["flips"] += gap[~same].tolist()
        base_max = max(base_max, float((np.abs(l32 - l16) / spread[:, None]).max()))
        base_agree += int((l16.argmax(axis=1) == l32.argmax(axis=1)).sum())
        total += len(gap)
        spreads += spread.tolist()
        gaps += gap.tolist()
    return [{"model": f"{cfg.name} ({init} init)", "head": k, "positions": total,
             "agree": r["agree"], "rel_max": r["rel_max"], "rel_mean": r["rel_sum"] / total,
             "flip_gaps": r["flips"], "base_agree": base_agree, "base_max": base_max,
             "pos_max": float(np.median(r["pos_max"])), "spread": float(np.median(spreads)),
             "gap_median": float(np.median(gaps)), "seconds": time.perf_counter() - t0}
            for k, r in st.items()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", action="append", choices=sorted(PRESETS),
                    help="preset widths to measure (repeatable; default 0.5b)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--init", action="append", choices=["ref", "hf"],
                    help="weight initialisations (repeatable; default both)")
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--prompt-len", type=int, default=16, help="positions a prompt (each measured)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--head", action="append", choices=["int8", "int4"],
                    help="quantised heads to measure (repeatable; default both)")
    args = ap.parse_args(argv)
    print("| model | head | positions | vs fp16: top-1 agreement | max abs(dlogit)/spread (median "
          "of a position's max) | mean | largest flipped top-2 gap/spread | fp16 vs fp32 source: agreement, max | median spread "
          "| median top-2 gap/spread |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: |")
    for size in args.size or ["0.5b"]:
        for init in args.init or ["ref", "hf"]:
            for r in measure(size, args.layers, init, args.prompts, args.prompt_len, args.seed,
                             tuple(args.head or ["int8", "int4"])):
                row(r)
    return 0


def row(r: dict) -> None:
    flips = f"{max(r['flip_gaps']):.1e}" if r["flip_gaps"] else "no flips"
    print(f"| {r['model']} | {r['head']} | {r['positions']} | "
          f"{100 * r['agree'] / r['positions']:.2f} % ({r['positions'] - r['agree']} flips) | "
          f"{r['rel_max']:.2e} ({r['pos_max']:.1e}) | {r['rel_mean']:.2e} | {flips} | "
          f"{100 * r['base_agree'] / r['positions']:.2f} %, {r['base_max']:.1e} | "
          f"{r['spread']:.3g} | {r['gap_median']:.2e} |", flush=True)
    print(f"  ({r['seconds']:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
