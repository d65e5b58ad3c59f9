"""The flags `nq` subcommands share (model, context, backend, sampling), their range checks,
and the help formatter that shows each flag's default.  nq/cli.py builds the parser with them."""
from __future__ import annotations

import argparse
import sys

from nq.loader.resolve import DEFAULT_REPO


FP32_ACCURATE = ("the default decode step is already fp32-accurate (qkv's activations as "
                 "digits summed exactly by dp4a, docs/PERF.md 0.30); --fp32-accurate changes "
                 "nothing and is kept only so that old command lines still run")


def precision_arg(s) -> None:
    s.add_argument("--fp32-accurate", action="store_true", help=FP32_ACCURATE)


def apply_precision(args) -> None:
    """--fp32-accurate: a no-op since NQ_MMA_QKV=1, the tensor-core qkv it set, was retired
    (nq/kernels/int4/tiling.py's epitaph); it says so on stderr."""
    if getattr(args, "fp32_accurate", False):
        print(f"nq: {FP32_ACCURATE}", file=sys.stderr)


def model_args(s) -> None:
    s.add_argument("-m", "--model", help=f".nanoqwen file, HF folder or repo id (default {DEFAULT_REPO})")
    s.add_argument("--revision", help="revision of a repo id given to -m")
    s.add_argument("-c", "--ctx-size", dest="ctx", type=int, default=0,
                   help="context length in tokens (default: min(model max, 4096))")
    s.add_argument("--backend", choices=["gpu", "numpy"], default="gpu",
                   help="gpu: the CUDA engine (H100/H200); numpy: the reference engine on the CPU "
                        "(slow; small models)")
    precision_arg(s)


def ranged(kind, lo, hi, lo_open=False, what=""):
    """An argparse type: kind(text) within [lo, hi] ((lo, hi] with lo_open); None: no bound."""
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}")
        if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi) \
                or v != v:
            span = f"{'(' if lo_open else '['}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
            raise argparse.ArgumentTypeError(f"{text} is outside {span}{what}")
        return v
    return parse


def sampling_args(s) -> None:
    g = s.add_argument_group("sampling (defaults: the model's generation_config.json)")
    g.add_argument("--temp", type=ranged(float, 0, None), help="temperature; 0 = greedy")
    g.add_argument("--top-k", type=ranged(int, 0, None, what="; 0 disables it"),
                   help="keep the k most likely tokens")
    g.add_argument("--top-p", type=ranged(float, 0, 1, lo_open=True, what="; 1 disables it"),
                   help="keep the smallest set whose probability reaches p")
    g.add_argument("--min-p", type=ranged(float, 0, 1, what="; 0 disables it"),
                   help="keep tokens at least min-p times as likely as the best")
    g.add_argument("--repeat-penalty", type=ranged(float, 0, None, lo_open=True,
                                                    what="; 1 disables it"),
                   help="penalise the last 64 tokens (llama.cpp's semantics)")
    g.add_argument("--seed", type=int, default=-1,
                   help="sampling seed; -1: a random one, printed so the run can be repeated")
    s.add_argument("--system", help="system message (implies --chat for generate)")


class Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows each flag's default (when it has one worth showing)."""

    def _get_help_string(self, action):
        if action.default in (None, False, argparse.SUPPRESS) or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)
