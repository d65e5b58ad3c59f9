"""The flags of `nq bench` and `nq verify`, apart from the tools themselves.

nq/cli.py builds every subcommand's parser at each start, `nq generate` included; bench.py and
verify.py import numpy at the top, so their flags live here, in a module that imports
nothing heavy, and the tools load only when their subcommand runs.
"""
from __future__ import annotations

import argparse

from nq.cli_args import precision_arg
from nq.config import DEFAULT_LM_HEAD, LM_HEADS, PRESETS

# --sampling NAME -> nq.sample.SamplingParams keywords (seed fixed: the same draws every run)
SAMPLING = {"default": dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.0,
                            repeat_penalty=1.05, repeat_last_n=-1, seed=0)}
DEFAULT_PREFILL_LENGTHS = (1, 17, 300, 2100)  # 2100: past one 2,048-token chunk


def _ctx_list(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ctx wants comma-separated token counts, e.g. "
                                         f"512,2048,8192; got {text!r}") from None
    if any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"--ctx values must be positive; got {text!r}")
    return vals


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v <= 0:
        raise argparse.ArgumentTypeError(f"wants a positive integer, got {text!r}")
    return v


def bench_arguments(s: argparse.ArgumentParser) -> None:
    """The flags of `nq bench` (llama-bench's -m -p -n -r)."""
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("-m", "--model", help=".nanoqwen file, HF folder or repo id")
    src.add_argument("--random", choices=list(PRESETS), metavar="SIZE",
                     help="random weights of a Qwen2.5 shape made on the GPU: "
                          + ", ".join(PRESETS))
    s.add_argument("--lm-head", choices=list(LM_HEADS),
                   help="with --random: the lm_head's weights as `nq pack --lm-head` writes "
                        f"them (default {DEFAULT_LM_HEAD}, as it does: INT4 g128 as the "
                        "projections, its candidates rescored by fp16 rows; fp16: the fp16 head "
                        "alone; int8: one fp32 scale a row; int4: INT4 alone)")
    s.add_argument("-p", "--n-prompt", dest="p", type=_ctx_list, default=[512],
                   help="prompt tokens, one pp test each, e.g. 512,2048,8192,32000 (default "
                        "512); the tg test follows the first")
    s.add_argument("-n", "--n-gen", dest="n", type=_positive, default=128,
                   help="decode steps per test (tg test; default 128)")
    s.add_argument("-r", "--repetitions", dest="r", type=_positive, default=5,
                   help="runs per test (default 5)")
    s.add_argument("--sampling", choices=list(SAMPLING),
                   help="add a tg row sampled on the device with these settings (default: "
                        "Qwen2.5-Instruct's T 0.7, top-k 20, top-p 0.8, repetition penalty 1.05)")
    s.add_argument("--ctx", type=_ctx_list, default=[],
                   help="decode at these context lengths too, e.g. 512,2048,8192,32768")
    s.add_argument("--replays", type=_positive, default=100,
                   help="graph replays per region in the ITL breakdown (default 100)")
    s.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompt")
    s.add_argument("--no-peers", action="store_true", help="skip the torch peer chains")
    s.add_argument("--gemm", type=_ctx_list, default=[512, 8192], metavar="M,M",
                   help="token counts of the prefill GEMM table (each projection, nq against "
                        "cuBLAS fp16)")
    s.add_argument("--no-gemm", action="store_true", help="skip the prefill GEMM table")
    s.add_argument("--json", metavar="FILE", help="write every figure and the environment here "
                                                  "(plots go next to it)")
    precision_arg(s)


def verify_arguments(s: argparse.ArgumentParser) -> None:
    """The flags of `nq verify`."""
    s.add_argument("-m", "--model", help=".nanoqwen file, HF folder or repo id")
    s.add_argument("--tiers", default="unit,layer,prefill,decode,graph",
                   help="comma-separated: unit (every kernel against its NumPy reference), layer "
                        "(decoder layer 0 against nq.ref), prefill (last-position logits of the "
                        "batched prefill against the reference engine), decode (every decode "
                        "step's logits, teacher-forced with the reference's tokens), graph "
                        "(greedy tokens of the decode graph against transformers or nq.ref)")
    s.add_argument("--prefill-lengths", default=",".join(map(str, DEFAULT_PREFILL_LENGTHS)),
                   help="prefill tier: prompt lengths in tokens, comma-separated; the longest "
                        "is also run as two halves, the second continuing the first")
    s.add_argument("--prompts", type=int, default=100, help="graph tier: random prompts to run")
    s.add_argument("--tokens", type=int, default=32, help="graph tier: greedy tokens a prompt")
    s.add_argument("--prompt-len", type=int, default=16, help="graph tier: tokens a prompt")
    s.add_argument("--decode-prompts", type=int, default=8,
                   help="decode tier: the first this many of the graph tier's prompts, each fed "
                        "its reference continuation of --tokens tokens")
    s.add_argument("--reference", choices=["auto", "torch", "numpy"], default="auto",
                   help="the prefill, decode and graph tiers' reference: transformers on "
                        "torch, nq.ref on NumPy, or torch when importable")
    s.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    s.add_argument("--json", help="also write the table as JSON to this path")
    precision_arg(s)
