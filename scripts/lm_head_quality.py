"""What a quantised lm_head (`nq pack --lm-head int8|int4|int4+fp16`) does to the logits, on the CPU.

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
greedy token.  `int4+fp16` is the INT4 head with each position's candidates rescored by the
fp16 rows, as the GPU step does (nq/kernels/lm_head_rescore.py): its agreement should be 100 %
(a miss needs a 6-sigma rounding error), and its last column counts the rows a step reads
for it (7 KB each at the 7B's width).  Sampling: the last two columns are the total variation
distance between the distributions the sampler draws a token from with each head's logits
and with the fp16 head's (nq.sample.Sampler's reference filters): under Qwen2.5-Instruct's
defaults (T 0.7, top-k 20, top-p 0.8), and at T 1 over the whole vocabulary, where the ids
the rescoring leaves with their INT4 logits count too.  For scale, the same figures for the fp16 head against the fp32 source it was rounded from (the
rounding every default pack already carries).

With a trained model, the question random weights cannot settle (docs/PERF.md 0.8, 0.36):

    python3 scripts/lm_head_quality.py --model qwen2.5-coder-1.5b.nanoqwen --text some_code.py

runs the file's whole model through the NumPy reference (its weights dequantised to fp32 on
the host: ~4 bytes a parameter, so a 0.5B-3B model on an ordinary machine) over windows of
real text (`--prompts` windows of `--prompt-len` tokens of the file, tokenised by the
model's own tokenizer), and quantises the file's fp16 rows (an fp16 head, or those a default
int4+fp16 pack or a tied model keeps; the packer quantises from the checkpoint's own
precision, so this adds one fp16 rounding before it).
There is no fp32 source there, so that column says "-".

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
                             quantize_int8_rows, quantize_pack, row_bounds)
from nq.ref import KVCache, RefModel, random_weights, rescore_rows, rms_norm  # noqa: E402
from nq.sample import Sampler, SamplingParams  # noqa: E402

# The sampling a token's distribution is compared under (`sampling_tv`): Qwen2.5-Instruct's
# generation_config (T 0.7, top-k 20, top-p 0.8; no min-p), and T 1 over the whole vocabulary,
# where every id's logit counts
QWEN = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, min_p=0.0)


def sampling_tv(lq: np.ndarray, l16: np.ndarray) -> tuple[float, float]:
    """Total variation distance between the token distributions the sampler draws from with
    logits lq and with the fp16 head's l16 (one position): (under QWEN, at T 1 untruncated).
    0 when the two draw alike; the largest difference in the probability of any set of ids."""
    def dist(lg):
        ids, p = Sampler(QWEN).distribution(lg)
        out = np.zeros(lg.size)
        out[ids] = p
        return out

    def softmax(lg):
        e = np.exp(lg.astype(np.float64) - lg.max())
        return e / e.sum()
    return (0.5 * float(np.abs(dist(lq) - dist(l16)).sum()),
            0.5 * float(np.abs(softmax(lq) - softmax(l16)).sum()))


def model_weights(cfg, init: str, seed: int) -> dict:
    if init == "ref":
        return random_weights(cfg, seed)
    from nq.loader.synth import random_hf_weights
    from nq.loader.weights import hf_to_host
    return hf_to_host(cfg, random_hf_weights(cfg, seed))


def int4_searched(src: np.ndarray, clips=np.linspace(0.6, 1.0, 21)) -> np.ndarray:
    """An experiment, not a pack option: INT4 g128 whose fp16 scale is absmax * c / 7 with c
    the clip of `clips` that least-squares each group (codes -8..7), dequantised (V, H) fp32.
    It keeps the file format; only the packer would change."""
    v, h = src.shape
    out = np.empty((v, h), np.float32)
    for r in range(0, v, 4096):
        g = src[r:r + 4096].reshape(-1, h // 128, 128).astype(np.float32)
        amax = np.abs(g).max(axis=2, keepdims=True)
        best, best_err = None, None
        for c in clips:
            sc = (amax * c / 7).astype(np.float16).astype(np.float32)
            safe = np.where(sc == 0, 1, sc)
            d = np.clip(np.rint(g / safe), -8, 7) * sc
            err = ((d - g) ** 2).sum(axis=2, keepdims=True)
            if best is None:
                best, best_err = d, err
            else:
                take = err < best_err
                best = np.where(take, d, best)
                best_err = np.minimum(err, best_err)
        out[r:r + 4096] = best.reshape(-1, h)
    return out


def heads(src: np.ndarray, kinds) -> tuple[np.ndarray, dict]:
    """(fp16 head, {kind: quantised head}) as fp32 (V, H) from the source head src: what the
    packs store, dequantised (int4s: `int4_searched`, an experiment; int4+fp16: (the INT4
    head, its row bounds), whose candidates `measure` rescores with the fp16 rows)."""
    def rescored():
        q, sc = quantize_pack(src)
        return dequantize_packed(q, sc), row_bounds(sc)
    quant = {"int8": lambda: dequantize_int8_rows(*quantize_int8_rows(src)),
             "int4": lambda: dequantize_packed(*quantize_pack(src)),
             "int4s": lambda: int4_searched(src), "int4+fp16": rescored}
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


def random_case(size: str, layers: int, init: str, prompts: int, prompt_len: int, seed: int):
    """(label, RefModel, fp32 source head, prompt id windows) of a random model."""
    cfg = PRESETS[size].replace(num_layers=layers, name=f"{PRESETS[size].name}-{layers}layers")
    w = model_weights(cfg, init, seed)
    src = w["embed_tokens"] if cfg.tie_word_embeddings else w["lm_head"]
    rng = np.random.default_rng(seed + 1)
    windows = [rng.integers(0, cfg.vocab_size, prompt_len) for _ in range(prompts)]
    return f"{cfg.name} ({init} init)", RefModel(cfg, w), src, windows


def file_case(path: str, text_path: str | None, prompts: int, prompt_len: int):
    """(label, RefModel, the file's head as fp32, windows of the text's ids) of a packed model
    with the default fp16 head."""
    from nq.loader.format import NanoqwenFile
    from nq.loader.repack import fp16_rows_of
    from nq.loader.weights import load_host_weights
    from nq.text import Tokenizer
    nf = NanoqwenFile(path)
    rows = fp16_rows_of(nf)   # the fp16 head's, or those an INT4 head is rescored with
    if rows is None:
        raise SystemExit(f"{path}: its lm_head is already {nf.lm_head}, without the fp16 rows "
                         "this measures against; pack it with `--lm-head int4+fp16` (the "
                         "default) or `--lm-head fp16`")
    if not text_path:
        raise SystemExit("--model needs --text FILE: a trained model's logits on random ids say "
                         "nothing about its logits on text")
    ids = Tokenizer.from_nanoqwen(nf).encode(Path(text_path).read_text(encoding="utf-8"))
    if len(ids) < prompt_len:
        raise SystemExit(f"{text_path}: {len(ids)} tokens, fewer than --prompt-len {prompt_len}")
    starts = np.linspace(0, len(ids) - prompt_len, num=min(prompts, len(ids) // prompt_len))
    windows = [np.asarray(ids[int(a): int(a) + prompt_len]) for a in starts]
    w = load_host_weights(nf)
    src = nf.array(rows).astype(np.float32)
    return f"{nf.config.name} ({Path(text_path).name})", RefModel(nf.config, w), src, windows


def measure(label: str, model: RefModel, src, windows, kinds=("int8", "int4"),
            fp32_source: bool = True) -> list[dict]:
    """One row a quantised head kind (module doc).  src: the head (V, H) fp32 the packs
    quantise; fp32_source: src is the unrounded source (a random model), else the file's fp16."""
    t0 = time.perf_counter()
    w16, wq = heads(src, kinds)
    st = {k: {"agree": 0, "rel_max": 0.0, "rel_sum": 0.0, "flips": [], "pos_max": [],
              "cands": [], "tv": []} for k in kinds}
    total, base_agree, base_max, spreads, gaps = 0, 0, 0.0, [], []
    for ids in windows:
        h = final_hidden(model, ids)
        l16 = h @ w16.T                                            # (T, V) fp32
        spread = l16.max(axis=1) - l16.min(axis=1)
        top2 = np.sort(l16, axis=1)[:, -2:]
        gap = (top2[:, 1] - top2[:, 0]) / spread
        for k, wk in wq.items():
            r = st[k]
            if k == "int4+fp16":     # the INT4 logits, their candidates rescored (the step's)
                wk, bound = wk
                lq = h @ wk.T
                for t in range(len(lq)):
                    lq[t], cand = rescore_rows(lq[t], bound, h[t], w16)
                    r["cands"].append(int(cand.sum()))
            else:
                lq = h @ wk.T
            d = np.abs(lq - l16) / spread[:, None]
            r["rel_max"] = max(r["rel_max"], float(d.max()))
            r["rel_sum"] += float(d.mean(axis=1).sum())
            r["pos_max"] += d.max(axis=1).tolist()
            r["tv"] += [sampling_tv(lq[t], l16[t]) for t in range(len(lq))]
            same = l16.argmax(axis=1) == lq.argmax(axis=1)
            r["agree"] += int(same.sum())
            r["flips"] += gap[~same].tolist()
        if fp32_source:
            l32 = h @ src.T                                        # the unrounded source
            base_max = max(base_max, float((np.abs(l32 - l16) / spread[:, None]).max()))
            base_agree += int((l16.argmax(axis=1) == l32.argmax(axis=1)).sum())
        total += len(gap)
        spreads += spread.tolist()
        gaps += gap.tolist()
    return [{"model": label, "head": k, "positions": total,
             "agree": r["agree"], "rel_max": r["rel_max"], "rel_mean": r["rel_sum"] / total,
             "flip_gaps": r["flips"], "base_agree": base_agree if fp32_source else None,
             "base_max": base_max, "pos_max": float(np.median(r["pos_max"])),
             "spread": float(np.median(spreads)), "gap_median": float(np.median(gaps)),
             "cands": r["cands"], "tv": np.asarray(r["tv"]),
             "seconds": time.perf_counter() - t0}
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
    ap.add_argument("--head", action="append", choices=["int8", "int4", "int4s", "int4+fp16"],
                    help="quantised heads to measure (repeatable; default int8, int4 and "
                         "int4+fp16; int4s: int4 with a least-squares clip a group, an "
                         "experiment; int4+fp16: int4 with its candidates rescored by the fp16 "
                         "rows, as the step does -- its last column counts them)")
    ap.add_argument("--model", help="a packed trained model (.nanoqwen, fp16 head) instead of "
                                    "random ones; needs --text")
    ap.add_argument("--text", help="with --model: a UTF-8 text file the windows are cut from")
    args = ap.parse_args(argv)
    kinds = tuple(args.head or ["int8", "int4", "int4+fp16"])
    print("| model | head | positions | vs fp16: top-1 agreement | max abs(dlogit)/spread (median "
          "of a position's max) | mean | largest flipped top-2 gap/spread | fp16 vs fp32 source: agreement, max | median spread "
          "| median top-2 gap/spread | rescored ids a position (median, max) | sampling TV "
          "distance to fp16, Qwen defaults (mean, max) | the same at T 1, untruncated (mean, "
          "max) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: "
          "| ---: |")
    if args.model:
        label, model, src, windows = file_case(args.model, args.text, args.prompts,
                                               args.prompt_len)
        for r in measure(label, model, src, windows, kinds, fp32_source=False):
            row(r)
        return 0
    for size in args.size or ["0.5b"]:
        for init in args.init or ["ref", "hf"]:
            label, model, src, windows = random_case(size, args.layers, init, args.prompts,
                                                     args.prompt_len, args.seed)
            for r in measure(label, model, src, windows, kinds):
                row(r)
    return 0


def row(r: dict) -> None:
    flips = f"{max(r['flip_gaps']):.1e}" if r["flip_gaps"] else "no flips"
    print(f"| {r['model']} | {r['head']} | {r['positions']} | "
          f"{100 * r['agree'] / r['positions']:.2f} % ({r['positions'] - r['agree']} flips) | "
          f"{r['rel_max']:.2e} ({r['pos_max']:.1e}) | {r['rel_mean']:.2e} | {flips} | "
          + ("- | " if r["base_agree"] is None else
             f"{100 * r['base_agree'] / r['positions']:.2f} %, {r['base_max']:.1e} | ") +
          f"{r['spread']:.3g} | {r['gap_median']:.2e} | "
          + (f"{np.median(r['cands']):.0f}, {max(r['cands'])} | " if r["cands"] else "- | ")
          + f"{r['tv'][:, 0].mean():.1e}, {r['tv'][:, 0].max():.1e} | "
          f"{r['tv'][:, 1].mean():.1e}, {r['tv'][:, 1].max():.1e} |", flush=True)
    print(f"  ({r['seconds']:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
