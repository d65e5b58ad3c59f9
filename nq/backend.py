"""What a run is made of, below the CLI and the server alike: the backend (the GPU engine or the
NumPy reference), the context length, and the sampling settings taken from flags over the
model's generation_config.json.  `nq generate`, `nq chat` and `nq serve` all build runs here.
"""
from __future__ import annotations

import sys


def context_size(args, cfg) -> int:
    """-c: 0 means the model's trained length capped at 4096; negative is refused; above the
    trained length is allowed with a warning (RoPE past it is extrapolation)."""
    if args.ctx < 0:
        raise ValueError(f"-c {args.ctx}: give a context length in tokens (0: the default, "
                         f"min(the model's {cfg.max_position_embeddings}, 4096))")
    ctx = args.ctx or min(cfg.max_position_embeddings, 4096)
    if ctx > cfg.max_position_embeddings:
        print(f"nq: warning: -c {ctx} is beyond the {cfg.max_position_embeddings} tokens this "
              "model was trained on; quality past that is not expected to hold", file=sys.stderr)
    return ctx


def make_backend(name: str, nf, ctx: int, valid_vocab: int | None = None,
                 sampler: bool = False):
    """The backend of a run.  valid_vocab: the tokenizer's size (the GPU sampler never draws
    the padded lm_head rows above it); sampler: build the GPU's device sampler now, as part of
    the start, rather than at the first sampled request."""
    if name == "numpy":
        from nq.ref import NumpyBackend
        return NumpyBackend.from_file(nf, max_len=ctx)
    if name == "gpu":
        from nq import gpu_start
        gpu_start.wait()    # the start's threads (driver, numba's import) have finished
        from numba import cuda
        if not cuda.is_available():
            raise RuntimeError("no CUDA GPU is visible (nq's kernels need an NVIDIA sm_90 GPU); "
                               "use --backend numpy to run on the CPU")
        cc = cuda.get_current_device().compute_capability
        if tuple(cc) < (9, 0):
            raise RuntimeError(f"this GPU is sm_{cc[0]}{cc[1]}; nq's kernels use Hopper (sm_90) "
                               "instructions (cp.async.bulk, mbarrier): use an H100/H200, or "
                               "--backend numpy")
        from nq.runtime.engine import Engine
        from nq.timeline import TIMELINE
        TIMELINE.lap("device check + engine imports")
        valid = min(valid_vocab, nf.config.vocab_size) if valid_vocab else None
        eng = Engine.from_file(nf, max_len=ctx, valid_vocab=valid)
        print(f"nq: weights on the GPU in {eng.w.load_s:.2f} s", file=sys.stderr)
        if sampler:
            eng.prepare_sampler()
            TIMELINE.lap("sampler kernels + graph")
        return eng
    raise ValueError(f"unknown backend {name!r}; choose gpu or numpy")


def sampling_params(args, d: dict):
    """Flags over generation_config.json's defaults (transformers' names and semantics).

    `--temp 0` is plain greedy: the config's repetition_penalty then applies only if
    `--repeat-penalty` is given, so greedy runs on the device at full speed.  A penalty taken
    from the config covers the whole context, as in transformers (repeat_last_n = -1); a
    `--repeat-penalty` flag covers the last 64 tokens, as in llama.cpp.
    """
    from nq.sample import SamplingParams

    if args.temp is not None:
        temperature = args.temp
    else:
        temperature = d.get("temperature", 1.0) if d.get("do_sample", False) else 0.0
    if args.repeat_penalty is not None:
        penalty, last_n = args.repeat_penalty, 64
    elif temperature == 0:
        penalty, last_n = 1.0, 64
    else:
        penalty, last_n = d.get("repetition_penalty", 1.0), -1
    return SamplingParams(
        temperature=temperature,
        top_k=args.top_k if args.top_k is not None else d.get("top_k", 0) or 0,
        top_p=args.top_p if args.top_p is not None else d.get("top_p", 1.0),
        min_p=args.min_p if args.min_p is not None else 0.0,
        repeat_penalty=penalty, repeat_last_n=last_n,
        seed=None if args.seed < 0 else args.seed,
    )
