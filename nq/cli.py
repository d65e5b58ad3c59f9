"""The `nq` command: pack, info, generate, chat, serve, bench, verify, cache.

Flags follow llama.cpp where a user would look for them (`-m -p -f -n -c --temp --top-k
--top-p --min-p --repeat-penalty --seed`).  Generated text goes to stdout; tokens, TTFT and
tok/s go to stderr, so `nq generate ... > out.txt` captures only the text.  `--json` writes
one JSON object instead, for scripts and tests.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from nq import gpu_start
from nq.errors import interrupted, os_error_words, signals_as_interrupts
from nq.backend import context_size, make_backend, sampling_params
from nq.cli_args import Formatter, apply_precision, model_args, sampling_args
from nq.loader.resolve import resolve_model
from nq.tools.flags import bench_arguments, verify_arguments


def _err(msg: str) -> int:
    print(f"nq: error: {msg}", file=sys.stderr)
    return 2


# ---- subcommands ----------------------------------------------------------------------------
def cmd_pack(args) -> int:
    from nq.loader.hf import pack, resolve_snapshot
    from nq.loader.outfile import check_output

    out = check_output(args.out)   # a directory or an unwritable folder: refused before any download
    if out.exists() and not args.force:
        raise FileExistsError(f"{out} exists; pass --force to replace it (the new file is written "
                              "beside it and renamed over it only once complete)")
    if Path(args.src).is_file():     # a .nanoqwen: its head made anew from its fp16 rows
        from nq.loader.repack import repack
        if args.revision:
            raise ValueError(f"--revision {args.revision}: {args.src} is a file, not a repo id; "
                             "drop --revision")
        out = repack(args.src, out, lm_head=args.lm_head)
    else:
        snapshot = resolve_snapshot(args.src, revision=args.revision)
        out = pack(snapshot, out, lm_head=args.lm_head)
    print(f"nq: wrote {out} ({out.stat().st_size / 2**30:.2f} GiB)", file=sys.stderr)
    return 0


def cmd_info(args) -> int:
    from nq.loader.format import NanoqwenFile

    nf = NanoqwenFile(args.file)
    print(nf.describe())
    if args.verify:
        nf.verify()
        print(f"verify: every payload checksum of {args.file} matches")
    return 0


def _decode(data: bytes | str, where: str) -> str:
    """Prompt bytes as text (newlines as read_text makes them); not UTF-8 is named, with the byte."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}: not UTF-8 text (byte {data[e.start]:#04x} at offset "
                             f"{e.start}); convert it, e.g. `iconv -f latin1 -t utf-8`") from None
    return data.replace("\r\n", "\n").replace("\r", "\n")


def _stdin() -> str:
    return _decode(getattr(sys.stdin, "buffer", sys.stdin).read(), "stdin")


def _read_prompt(args) -> str:
    if args.file and args.prompt is not None:
        raise ValueError("give the prompt once: -p TEXT or -f FILE, not both")
    if args.file == "-":
        return _stdin()
    if args.file:
        return _decode(Path(args.file).read_bytes(), args.file)
    if args.prompt is not None:
        return args.prompt
    if not sys.stdin.isatty():
        return _stdin()
    raise ValueError("no prompt: give -p TEXT, -f FILE (- for stdin), or text on stdin")


def build_prompt_ids(tok, args) -> list[int]:
    """Prompt ids for plain text, a chat turn (--chat/--system) or a FIM request."""
    if args.fim_prefix is not None or args.fim_suffix is not None:
        if args.prompt is not None or args.file or args.chat or args.system is not None:
            raise ValueError("--fim-prefix/--fim-suffix build the whole prompt; drop -p, -f, "
                             "--chat and --system (or drop the FIM flags)")
        text = tok.fim_prompt(args.fim_prefix or "", args.fim_suffix or "")
    elif args.chat or args.system is not None:
        messages = []
        if args.system is not None:
            messages.append({"role": "system", "content": args.system})
        messages.append({"role": "user", "content": _read_prompt(args)})
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
    else:
        text = _read_prompt(args)
    return tok.encode(text)


def resolve_seed(args) -> None:
    """--seed -1 draws a seed and says which (stderr), as llama.cpp does: any run can be
    repeated with --seed N."""
    if args.seed < 0:
        import secrets
        args.seed = secrets.randbelow(2**31)
        print(f"nq: seed {args.seed}", file=sys.stderr)


def print_startup() -> None:
    """`--verbose`: what the start was made of, one line a part (nq/timeline.py: the parts add
    up to the wall time since the process started, to its first generated token)."""
    from nq.timeline import TIMELINE
    for line in TIMELINE.lines():
        print(line, file=sys.stderr)
    first = TIMELINE.until("first token")
    if first is not None:
        print(f"{'process start to the first token:':44s}{first * 1e3:10.1f} ms", file=sys.stderr)
    if "nq.kernels.build" in sys.modules:
        from nq.kernels.build import STATS
        print(f"{'kernels:':44s}{STATS.compiled} compiled ({STATS.compile_s:.2f} s here"
              f"{f', {STATS.parallel_s:.2f} s in parallel processes' if STATS.parallel_s else ''}"
              f"), {STATS.loaded} loaded from the cache ({STATS.load_s:.2f} s)"
              + (f", {STATS.rebuilt} stale rebuilt" if STATS.rebuilt else ""), file=sys.stderr)
        for n, procs, wall, first, (slow, slow_s), total in STATS.batches:
            print(f"  a batch: {n} kernels in {procs} processes, {wall:.2f} s (the first began "
                  f"after {first:.2f} s; slowest {slow} {slow_s:.2f} s; {total:.1f} s in all)",
                  file=sys.stderr)


def print_run_stats(stats) -> None:
    d = stats.as_dict()
    lines = [("prompt eval count", f"{stats.prompt_tokens} token(s)"),
             ("time to first token", f"{stats.ttft_s * 1e3:.1f} ms"),
             ("prompt eval rate", f"{stats.prefill_tok_s:.2f} tokens/s (to the first token)"),
             ("eval count", f"{stats.generated_tokens} token(s) ({stats.stop_reason})"),
             ("eval duration", f"{stats.decode_s * 1e3:.1f} ms"),
             ("eval rate", f"{stats.decode_tok_s:.2f} tokens/s")]
    if d["itl_p50_ms"] is not None:
        lines.append(("ITL p50 / p90", f"{d['itl_p50_ms']:.3f} / {d['itl_p90_ms']:.3f} ms"))
    for name, text in lines:
        print(f"{name + ':':22s}{text}", file=sys.stderr)


def cmd_generate(args) -> int:
    from nq.timeline import TIMELINE
    TIMELINE.lap("argument parsing")
    if args.backend == "gpu":
        gpu_start.start(TIMELINE)   # the CUDA driver and numba's import, beside the next steps
    from nq.generate import Interrupted, StopStrings, generate
    from nq.loader.format import NanoqwenFile
    from nq.text import Tokenizer
    TIMELINE.lap("imports (generate, text)")
    path = resolve_model(args.model, args.revision)
    nf = NanoqwenFile(path)
    if args.backend == "gpu":
        from nq.runtime import preload
        preload.start(nf, TIMELINE)    # the weights' copy, beside numba's import
    TIMELINE.lap("file open")
    tok = Tokenizer.from_nanoqwen(nf)
    TIMELINE.lap("tokenizer")
    ids = build_prompt_ids(tok, args)
    resolve_seed(args)
    params = sampling_params(args, tok.generation_defaults)
    ctx = context_size(args, nf.config)
    if args.n < -1:
        raise ValueError(f"-n {args.n}: give a token count, or -1 to run until an end token "
                         "or a full context")
    until_full = args.n < 0
    if len(ids) >= ctx:  # refused before any weight is read
        return _err(f"the prompt is {len(ids)} tokens, the context -c is {ctx}: no room to "
                    f"generate; shorten the prompt or raise -c (this model was trained on "
                    f"{nf.config.max_position_embeddings})")
    if args.n < 0:  # llama.cpp's -n -1: until an end-of-sequence token or the context is full
        args.n = ctx - len(ids)
    if len(ids) + max(args.n, 1) > ctx:
        return _err(f"prompt ({len(ids)} tokens) + -n {args.n} exceeds the context -c {ctx}; "
                    "raise -c or shorten the prompt")
    TIMELINE.lap("prompt")
    if args.backend == "gpu" and gpu_start.wait():
        TIMELINE.lap("numba, CUDA context, engine imports (waiting)")
    from nq.runtime.sampling import needs_device_sampler
    backend = make_backend(args.backend, nf, ctx, valid_vocab=tok.vocab_size,
                           sampler=needs_device_sampler(params))
    TIMELINE.lap("backend, other")   # what the engine's own laps leave: ~0
    stop = () if args.ignore_eos else tok.eos_ids

    stream = tok.stream()
    stopper = StopStrings(args.stop or [])
    shown: list[str] = []

    def emit(text: str) -> None:
        shown.append(text)
        if text and not args.json:
            sys.stdout.write(text)
            sys.stdout.flush()

    first = [True]

    def show(t: int) -> bool:
        if first[0]:
            first[0] = False
            TIMELINE.lap("first token")
        piece = stream.step(t)
        if t in tok.eos_ids and not args.ignore_eos:
            return False
        text, stopped = stopper.feed(piece or "")
        emit(text)
        return stopped

    try:
        out, stats = generate(backend, ids, args.n, params, stop, on_token=show)
    except Interrupted as e:  # Ctrl-C: show what there is, and the statistics so far
        out, stats = e.ids, e.stats
    emit(stopper.flush())
    if stats.stop_reason == "length" and until_full:
        stats.stop_reason = "context"
    if args.json:
        # a stop string cut the text where the ids do not; otherwise decode the ids whole (the
        # stream holds back a trailing incomplete UTF-8 sequence that decode shows as U+FFFD)
        text = ("".join(shown) if stats.stop_reason == "stop" else
                tok.decode([t for t in out if args.ignore_eos or t not in tok.eos_ids]))
        json.dump({"prompt_ids": ids, "ids": out, "text": text,
                   "stats": {**stats.as_dict(), "seed": args.seed}}, sys.stdout)
        sys.stdout.write("\n")
    else:
        sys.stdout.write("\n")
        why = {"length": f"-n {args.n} reached", "eos": "end of sequence",
               "stop": "a stop string", "context": f"the context (-c {ctx}) is full",
               "interrupted": "an interrupt"}
        print(f"nq: {stats.prompt_tokens} prompt tokens, {stats.generated_tokens} generated "
              f"(ended by {why.get(stats.stop_reason, stats.stop_reason)}); TTFT "
              f"{stats.ttft_s * 1e3:.1f} ms, decode {stats.decode_tok_s:.2f} tok/s "
              f"[{args.backend}]", file=sys.stderr)
        if args.verbose:
            print_run_stats(stats)
    if args.verbose:
        TIMELINE.lap(f"the other {max(stats.generated_tokens - 1, 0)} tokens + output")
        print_startup()
    return 130 if stats.stop_reason == "interrupted" else 0


def cmd_cache(args) -> int:
    """`nq cache info|clear`: the compiled-kernel cache (nq/kernels/build.py)."""
    from nq.kernels.cache_files import cache_root
    from nq.kernels.cache_files import cache_entries, clear_cache
    if args.action == "clear":
        from nq.loader.outfile import remove_stale
        from nq.loader.resolve import cache_dir
        n, size = clear_cache()
        print(f"nq: removed {n} files ({size / 1e6:.1f} MB) from {cache_root()}")
        stale = remove_stale(cache_dir(), "*.nanoqwen.tmp-*")  # packs killed half-way
        if stale:
            print(f"nq: removed {len(stale)} unfinished packs "
                  f"({sum(b for _, b in stale) / 1e6:.1f} MB) from {cache_dir()}")
        return 0
    entries = cache_entries()
    total = sum(size for _, size, _ in entries)
    print(f"{cache_root()}: {len(entries)} kernels, {total / 1e6:.1f} MB"
          + ("" if os.environ.get("NQ_NO_KERNEL_CACHE", "") in ("", "0")
             else " (NQ_NO_KERNEL_CACHE is set: not used)"))
    for path, size, header in entries:
        state = header["created"] if header else "INVALID (rebuilt at the next use)"
        print(f"  {size / 1e3:9.1f} kB  {state:19s}  {path.name}")
    return 0


def cmd_serve(args) -> int:
    if args.backend == "gpu":
        gpu_start.start()
    from nq.serve import main as serve  # lazy: starlette and uvicorn load only for `nq serve`
    return serve(args)


def cmd_bench(args) -> int:
    from nq.tools.bench import run  # lazy: numpy, numba and torch load only for `nq bench`
    return run(args)


def cmd_verify(args) -> int:
    from nq.tools.verify import run
    return run(args)


# ---- argument parsing -----------------------------------------------------------------------
def cmd_chat(args) -> int:
    if args.n == 0 or args.n < -1:
        raise ValueError(f"-n {args.n}: give the most tokens a reply may have, or -1 for "
                         "until an end token or a full context")
    if args.backend == "gpu":
        gpu_start.start()
    from nq.chat import ChatSession, repl
    from nq.loader.format import NanoqwenFile
    from nq.text import Tokenizer

    nf = NanoqwenFile(resolve_model(args.model, args.revision))
    if args.backend == "gpu":
        from nq.runtime import preload
        preload.start(nf)
    tok = Tokenizer.from_nanoqwen(nf)
    resolve_seed(args)
    params = sampling_params(args, tok.generation_defaults)
    ctx = context_size(args, nf.config)
    backend = make_backend(args.backend, nf, ctx, valid_vocab=tok.vocab_size, sampler=True)
    session = ChatSession(backend, tok, params, ctx, system=args.system,
                          context_shift=args.context_shift)
    if sys.stdin.isatty():
        print(f"nq chat: {Path(nf.path).name}, context {ctx} tokens, seed {args.seed}. "
              "/help for commands, /exit to quit.", file=sys.stderr)
    return repl(session, args.n)


def build_parser() -> argparse.ArgumentParser:
    import nq
    from nq.config import DEFAULT_LM_HEAD, LM_HEADS
    p = argparse.ArgumentParser(prog="nq", description=__doc__.split("\n")[0])
    p.add_argument("--version", action="version", version=f"nq {nq.__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub_add = sub.add_parser

    def add_parser(name, **kw):  # every subcommand: defaults in its help, its own usage on error
        s = sub_add(name, formatter_class=Formatter, **kw)
        s.set_defaults(_parser=s)
        return s
    sub.add_parser = add_parser

    s = sub.add_parser("pack", help="quantise an HF checkpoint (folder or repo id) into a .nanoqwen")
    s.add_argument("src", help="HF snapshot folder or repo id, e.g. "
                               "Qwen/Qwen2.5-Coder-7B-Instruct; or a .nanoqwen file, re-packed with another --lm-head made from "
                               "its fp16 rows (offline; the 7B in ~30 s: e.g. a file packed before "
                               "int4+fp16 was the default)")
    s.add_argument("out", help="output .nanoqwen path")
    s.add_argument("--revision", help="branch, tag or commit of a repo id")
    s.add_argument("--force", action="store_true", help="replace OUT if it exists")
    s.add_argument("--lm-head", choices=list(LM_HEADS), default=DEFAULT_LM_HEAD,
                   help="int4+fp16 (the default): the lm_head as INT4 g128 (the projections' "
                        "format), and the fp16 lm_head kept beside it (a larger file, and the "
                        "fp16 rows in GPU memory): each step reads the INT4 head and rescores "
                        "the few ids near the top with the fp16 rows, so greedy decoding gives "
                        "the fp16 head's tokens at about int4's speed (a 7B token ~0.15 ms "
                        "faster on an H200); the file needs nq >= 0.4.0.  fp16: the checkpoint's "
                        "head alone, as nq before 0.5 packed it.  int8: int8 rows with one fp32 "
                        "scale each, half its fp16 bytes; nq >= 0.2.0.  int4: INT4 alone, a "
                        "quarter of its fp16 bytes, at more cost to the logits than int8 "
                        "(scripts/lm_head_quality.py measures it); nq >= 0.3.0.  A tied model "
                        "keeps its fp16 embedding beside any of them, and it rescores a tied "
                        "INT4 head the same way")
    s.set_defaults(func=cmd_pack)

    s = sub.add_parser("info", help="print a .nanoqwen header, config and tensor table")
    s.add_argument("file")
    s.add_argument("--verify", action="store_true", help="also check every payload checksum")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("generate", help="generate text")
    model_args(s)
    s.add_argument("-p", "--prompt")
    s.add_argument("-f", "--file", help="read the prompt from a file (- for stdin)")
    s.add_argument("-n", "--n-predict", dest="n", type=int, default=128,
                   help="tokens to generate; -1: until end of sequence or the context is full")
    sampling_args(s)
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    s.add_argument("--fim-prefix", help="fill-in-the-middle: code before the cursor")
    s.add_argument("--fim-suffix", help="fill-in-the-middle: code after the cursor")
    s.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence ids")
    s.add_argument("--stop", action="append", metavar="STRING",
                   help="end the reply where this text appears (repeatable; it may span tokens "
                        "and is not printed)")
    s.add_argument("--json", action="store_true", help="one JSON object on stdout")
    s.add_argument("--verbose", action="store_true",
                   help="print what the start was made of (import, file, weights, kernels, "
                        "warm-up, capture) and ollama-style statistics, on stderr")
    s.set_defaults(func=cmd_generate)

    s = sub.add_parser("chat", help="multi-turn chat on stdin/stdout; the KV cache is kept "
                                    "between turns (/reset, /exit)")
    model_args(s)
    s.add_argument("-n", "--n-predict", dest="n", type=int, default=1024,
                   help="most tokens per reply; -1: until an end token or a full context")
    s.add_argument("--context-shift", action="store_true",
                   help="when the conversation outgrows -c, drop the oldest turns instead of "
                        "refusing the message")
    sampling_args(s)
    s.set_defaults(func=cmd_chat)

    s = sub.add_parser("cache", help="list (info) or empty (clear) the compiled-kernel cache "
                                     "in $NQ_CACHE/kernels")
    s.add_argument("action", choices=["info", "clear"])
    s.set_defaults(func=cmd_cache)

    s = sub.add_parser("serve", help="OpenAI- and llama.cpp-compatible HTTP server "
                                     "(/v1/chat/completions, /v1/completions, /infill); "
                                     "docs/SERVE.md")
    model_args(s)
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface; set --api-key then)")
    s.add_argument("--port", type=int, default=8080, help="port (0: any free one, printed)")
    s.add_argument("--api-key", help="require `Authorization: Bearer KEY` (or set $NQ_API_KEY, "
                                     "which keeps the key out of `ps`)")
    s.add_argument("--alias", help="the model name /v1/models reports (default: -m's name)")
    s.add_argument("--queue", type=int, default=16,
                   help="requests that may wait for the engine; more get 503 + Retry-After")
    s.add_argument("--cache-slots", type=int, default=1,
                   help="conversations whose KV cache is kept (LRU); the GPU keeps one, the "
                        "others are copies in pinned host memory (K x the context's KV bytes)")
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("verify", help="check this GPU's kernels, prefill and decode graph "
                                      "against the references (unit, layer, prefill, decode, "
                                      "graph tiers)")
    verify_arguments(s)
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("bench", help="prefill/decode speed as a llama-bench table, with the ITL "
                                     "breakdown, copy ceiling and torch peers (GPU)")
    bench_arguments(s)
    s.set_defaults(func=cmd_bench)
    return p


def main(argv=None) -> int:
    """`nq ...`; Ctrl-C, SIGTERM and SIGHUP anywhere (start-up included) end it without a
    traceback, exit status 128 + the signal (130 for Ctrl-C)."""
    try:
        with signals_as_interrupts():
            return _main(argv)
    except KeyboardInterrupt as e:
        return interrupted(e)


def _main(argv) -> int:
    from nq.timeline import TIMELINE
    TIMELINE.start()      # its first part: the process's life so far (python, nq.cli's imports)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the subcommand's usage, not the top level's
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    apply_precision(args)
    import warnings
    # numba warns about every launch with a grid under 128 CTAs; the small per-step kernels
    # (embed, argmax, attention at short context) are that size on purpose.
    warnings.filterwarnings("ignore", message=".*Grid size .* will likely result in GPU under-utilization")
    try:
        return args.func(args)
    except OSError as e:
        return _err(os_error_words(e))
    except (ValueError, RuntimeError) as e:
        return _err(str(e))
    except Exception as e:  # CUDA driver/compiler and template errors: say what, not a traceback
        kind = type(e).__module__.split(".")[0]
        if kind in ("numba", "jinja2", "cuda"):
            return _err(f"{type(e).__name__}: {e}")
        raise


if __name__ == "__main__":
    raise SystemExit(main())
