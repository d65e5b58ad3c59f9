"""Which fp16 roundings make the GPU engine's decode error, modelled on the CPU.

nq.ref is fp32 throughout; the GPU engine rounds some activations to fp16 between (or inside)
kernels.  This script runs nq.ref with fp16 rounding at chosen points and measures what `nq
verify`'s decode tier measures -- max |logit - reference| / (max - min) of the reference's
logits at every teacher-forced decode step -- against plain nq.ref, on a packed model (the
same INT4 weights on both sides):

    python3 scripts/rounding_model.py --width 7b --layers 2 --steps 24
    python3 scripts/rounding_model.py -m model.nanoqwen all kv h

Rounding points (combine them with "+", e.g. kv+a+m):
    h_qkv   rmsnorm(x) * norm_w, qkv's input      (staged fp16 unless digits/i8)
    h_mlp   the same before gate_up               (staged fp16 unless digits/i8)
    h       both of the above
    kv      K (after RoPE) and V in the cache     (fp16 pages)
    a       the attention output, o_proj's input  (written fp16 by the combine)
    m       silu(gate) * up, down's input         (written fp16 by gate_up)
    all     every point above

The method's own floor: with no point rounded the error is ~4e-7 of the spread (the reference
runs prompt + continuation as one forward, the model one token at a time; only fp32 summation
order differs).

On 2026-12-02 (2 layers of the 7B width, nq.ref's random init, 2 prompts x 23 steps) this put
h's share first (2.95e-4 of the spread alone), then kv 2.09e-4, a 1.64e-4, m 1.13e-4; all
4.15e-4 / 4.89e-4 (median / max), near the H200's 4.36e-4 / 5.81e-4 with qkv on the tensor
cores then: docs/KERNELS_GEMV.md, "The fp32-accurate step".  The default step has staged h as
digits since docs/PERF.md 0.30 (gate_up's i8, qkv's dp4a), which takes h's share away.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nq import ref as R  # noqa: E402

POINTS = {"h_qkv", "h_mlp", "kv", "a", "m"}
ALIASES = {"h": {"h_qkv", "h_mlp"}, "all": POINTS}


def parse_points(text: str) -> set:
    out = set()
    for p in text.split("+"):
        got = ALIASES.get(p, {p} if p in POINTS else None)
        if got is None:
            raise SystemExit(f"rounding_model: {p!r} is not one of {sorted(POINTS | set(ALIASES))}")
        out |= got
    return out


def f16(a):
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


class Rounded(R.RefModel):
    """nq.ref with fp16 rounding at `points` (the module doc names them): RefModel.stored,
    which layer() passes each of them through, rounds them."""
    points: set = set()

    def stored(self, point, a):
        return f16(a) if point in self.points else a


def teacher_forced(cfg, weights, prompts, steps: int, variants: dict) -> dict:
    """{variant: errors over every step}: the reference's greedy continuation of each prompt
    is fed to the rounded model one token at a time; each step's logits against the
    reference's at the same position (one forward over prompt + continuation)."""
    ref = R.RefModel(cfg, weights)
    runs = []
    for pr in prompts:
        ref.reset()
        lg = ref.forward(np.array(pr))[-1]
        ids = []
        for _ in range(steps):
            ids.append(int(np.argmax(lg)))
            lg = ref.forward(np.array([ids[-1]]))[-1]
        ref.reset()
        runs.append((pr, ids, ref.forward(np.array(pr + ids[:-1]))[len(pr) - 1:]))
    out = {}
    for name, points in variants.items():
        mdl = Rounded(cfg, weights)
        mdl.points = points
        errs = []
        for pr, ids, want in runs:
            mdl.reset()
            mdl.forward(np.array(pr))
            for j, tok in enumerate(ids[:-1]):
                got = mdl.forward(np.array([tok]))[-1]
                r = want[j + 1]
                errs.append(float(np.abs(got - r).max() / (r.max() - r.min())))
        out[name] = np.asarray(errs)
    return out


def make_model(width: str, layers: int, folder: Path):
    """A packed model of the preset's width and `layers` layers, nq.ref's random init (the
    GPU decode tier's test models): its config and fp32 host weights."""
    import dataclasses

    from nq.config import PRESETS
    from nq.loader.format import NanoqwenFile
    from nq.loader.hf import hf_name, pack
    from nq.loader.synth import make_hf_snapshot
    from nq.loader.weights import load_host_weights
    cfg = dataclasses.replace(PRESETS[width], num_layers=layers,
                              name=f"{width}-width-{layers}layers")
    w = R.random_weights(cfg, 0)
    if cfg.tie_word_embeddings:
        w.pop("lm_head", None)
    snap = make_hf_snapshot(folder / "hf", cfg, weights={hf_name(k): v for k, v in w.items()})
    nf = NanoqwenFile(pack(snap, folder / "m.nanoqwen", progress=False))
    return nf.config, load_host_weights(nf)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="*", default=["all", "kv", "a", "m", "h", "kv+a+m"])
    ap.add_argument("-m", "--model", help="a .nanoqwen file (default: a random model made here)")
    ap.add_argument("--width", default="7b", help="the random model's preset (default 7b)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24, help="greedy tokens a prompt")
    a = ap.parse_args(argv)
    variants = {v: parse_points(v) for v in a.variants}
    with tempfile.TemporaryDirectory() as tmp:
        if a.model:
            from nq.loader.format import NanoqwenFile
            from nq.loader.weights import load_host_weights
            nf = NanoqwenFile(a.model)
            cfg, weights = nf.config, load_host_weights(nf)
        else:
            cfg, weights = make_model(a.width, a.layers, Path(tmp))
        prompts = np.random.default_rng(5).integers(0, min(cfg.vocab_size, 500),
                                                    (a.prompts, 12)).tolist()
        errs = teacher_forced(cfg, weights, prompts, a.steps, variants)
    for name, e in errs.items():
        print(f"{name:12s} median {np.median(e):.2e}  max {e.max():.2e}  ({e.size} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
