"""The soak (issue #18): 20,000 tokens in one process on the GPU engine, across many generate
calls and a long chat, and whether the process is still what it was at the start.

    python3 scripts/soak.py [MODEL] [--tokens 20000] [--ctx 4096] [--out soak.json]

MODEL defaults to /tmp/r7b-text.nanoqwen (written first when missing, as scripts/serve_probe.py
does: a random 7B-shaped file whose greedy tokens all decode to text).  The backend is built by
nq.backend.make_backend, as `nq generate` and `nq chat` build it.  The work, in order:

    generate   calls of nq.generate.generate (the loop `nq generate` runs): prompts of 8..1500
               tokens, 16..400 new tokens, greedy (the device argmax graph) and sampled
               (temperature 0.8, top-k 40, top-p 0.95, repeat penalty 1.1, seeded: the host
               sampler), a fresh context each
    chat       one nq.chat.ChatSession (`nq chat`'s code path, --context-shift) with sampling,
               turn after turn until the conversation has filled the context and dropped its
               oldest turns at least twice
    generate   more calls as above, until --tokens tokens were generated in all

Criteria, each with a one-line verdict:
    ITL        p50 of 128 greedy tokens after the same 64-token prompt, and of 128 sampled
               ones, measured after the warm-up and again at the end: drift <= 10 %
    memory     host RSS (/proc/self/status VmRSS) and GPU memory in use (total - free from
               cuda.current_context().get_memory_info()), after gc, start vs end: within 1 %
    errors     none: every call returns, and the engine's cache length is what the loop says
At ~2 ms a greedy token and ~4 ms a host-sampled one this takes about 1.5 minutes on the H200
(plus the engine's start: ~5 s with a warm kernel cache, ~1 minute cold).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nq.sample import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, repeat_penalty=1.0)
SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, repeat_penalty=1.1,
                         repeat_last_n=64, seed=7)
WORDS = ("def return import class self value list dict print range for while if else "
         "assistant user the of and to in is it that with as not this").split()


def host_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def gpu_used() -> int:
    """Device bytes in use, after numba's deferred frees ran (else garbage counts as growth)."""
    from numba import cuda
    ctx = cuda.current_context()
    ctx.synchronize()
    ctx.deallocations.clear()
    free, total = ctx.get_memory_info()
    return int(total - free)


def measure() -> dict:
    gc.collect()
    return {"rss": host_rss(), "gpu": gpu_used()}


def itl_probe(backend, generate, seed_ids) -> dict:
    """p50 ITL (ms) of 128 greedy and 128 sampled tokens after the same prompt."""
    out = {}
    for name, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
        _, st = generate(backend, seed_ids, 128, params)
        out[name] = float(np.percentile(st.itl_ms, 50))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default="/tmp/r7b-text.nanoqwen")
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--backend", default="gpu", help="numpy: a CPU smoke test of the script")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    if not Path(args.model).exists():
        print(f"soak: writing {args.model} (7B shape, random, --text-ids)", flush=True)
        subprocess.run([sys.executable, str(ROOT / "scripts/make_random_nanoqwen.py"), "7b",
                        args.model, "--text-ids"], check=True)

    from nq.backend import make_backend
    from nq.chat import ChatSession
    from nq.generate import generate
    from nq.loader.format import NanoqwenFile
    from nq.text import Tokenizer

    t_start = time.perf_counter()
    nf = NanoqwenFile(args.model)
    tok = Tokenizer.from_nanoqwen(nf)
    backend = make_backend(args.backend, nf, args.ctx)
    if args.backend != "gpu":
        globals()["gpu_used"] = lambda: 0
    stop = tuple(tok.eos_ids)
    rng = random.Random(0)
    vocab = min(500, nf.config.vocab_size)  # prompt ids the tokenizer knows
    probe_ids = [rng.randrange(vocab) for _ in range(64)]
    t_load = time.perf_counter() - t_start
    print(f"soak: engine up in {t_load:.1f} s; warming up", flush=True)
    itl_probe(backend, generate, probe_ids)  # warm-up: every kernel, both sampling paths
    for n in (8, 60, min(1500, args.ctx // 2)):  # each prefill GEMM tile class compiles on
        #                                           first use
        generate(backend, [rng.randrange(vocab) for _ in range(n)], 2, GREEDY)
    itl0, mem0 = itl_probe(backend, generate, probe_ids), measure()
    print(f"soak: start: ITL greedy {itl0['greedy']:.3f} ms, sampled {itl0['sampled']:.3f} ms, "
          f"RSS {mem0['rss'] / 2**20:.0f} MiB, GPU {mem0['gpu'] / 2**20:.0f} MiB", flush=True)

    total, calls, errors, per_call = 0, 0, [], []
    t0 = time.perf_counter()

    def one_call():
        nonlocal total, calls
        p = [rng.randrange(vocab) for _ in range(rng.randint(8, min(1500, args.ctx // 2)))]
        n = rng.randint(16, min(400, args.ctx // 4))
        params = GREEDY if calls % 2 == 0 else dataclasses.replace(SAMPLED, seed=calls)
        try:
            out, st = generate(backend, p, n, params, stop_ids=stop)
            if backend.length != len(p) + len(out) - 1:
                raise RuntimeError(f"cache holds {backend.length} tokens, the loop fed "
                                   f"{len(p) + len(out) - 1}")
            total += len(out)
            per_call.append(("greedy" if params is GREEDY else "sampled",
                             float(np.percentile(st.itl_ms, 50)) if st.itl_ms else None))
        except Exception as e:  # noqa: BLE001 -- counted, and the soak goes on
            errors.append(f"generate call {calls}: {type(e).__name__}: {e}")
        calls += 1

    while total < args.tokens * 0.4:
        one_call()
    # the chat: sampling, context shift, turn after turn until two shifts happened
    session = ChatSession(backend, tok, SAMPLED, args.ctx, context_shift=True)
    turns = shifts = chat_tokens = 0
    while shifts < 2 and turns < 200:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120)))
        before = len(session.messages)
        try:
            _, st = session.turn(text, min(300, args.ctx // 4))
            chat_tokens += st.generated_tokens
            if len(session.messages) < before + 2:
                shifts += 1
            if backend.length != len(session.fed):
                raise RuntimeError(f"chat: cache {backend.length}, session {len(session.fed)}")
        except Exception as e:  # noqa: BLE001
            errors.append(f"chat turn {turns}: {type(e).__name__}: {e}")
        turns += 1
    total += chat_tokens
    while total < args.tokens:
        one_call()
    work_s = time.perf_counter() - t0

    itl1, mem1 = itl_probe(backend, generate, probe_ids), measure()
    total += 4 * 128
    rows, verdicts = [], []

    def row(name, a, b, unit, limit):
        change = (b - a) / a if a else 0.0
        rows.append((name, a, b, unit, change, limit))
        verdicts.append((name, abs(change) <= limit, change, limit))
    row("ITL p50, greedy (device argmax)", itl0["greedy"], itl1["greedy"], "ms", 0.10)
    row("ITL p50, sampled (host sampler)", itl0["sampled"], itl1["sampled"], "ms", 0.10)
    row("host RSS", mem0["rss"] / 2**20, mem1["rss"] / 2**20, "MiB", 0.01)
    row("GPU memory in use", mem0["gpu"] / 2**20, mem1["gpu"] / 2**20, "MiB", 0.01)

    print(f"\n| soak ({Path(args.model).name}, {args.backend}, -c {args.ctx}, "
          f"{time.strftime('%Y-%m-%d')}) | start | end | change | limit |")
    print("| --- | --- | --- | --- | --- |")
    for name, a, b, unit, change, limit in rows:
        print(f"| {name} | {a:.3f} {unit} | {b:.3f} {unit} | {change:+.2%} | {limit:.0%} |")
    g = [v for k, v in per_call if k == "greedy" and v]
    print(f"\n{total} tokens in {work_s:.1f} s: {calls} generate calls, a chat of {turns} turns "
          f"({chat_tokens} tokens, {shifts} context shifts), 4 ITL probes; greedy calls' ITL "
          f"p50: first 5 {np.mean(g[:5]):.3f} ms, last 5 {np.mean(g[-5:]):.3f} ms")
    for name, ok, change, limit in verdicts:
        print(f"verdict {name}: {'PASS' if ok else 'FAIL'} ({change:+.2%}, limit {limit:.0%})")
    print(f"verdict errors: {'PASS (none)' if not errors else 'FAIL (' + str(len(errors)) + ')'}")
    for e in errors[:10]:
        print("  " + e)
    ok_tokens = total >= args.tokens
    print(f"verdict tokens >= {args.tokens}: {'PASS' if ok_tokens else 'FAIL'} ({total})")
    print(f"command: python3 scripts/soak.py {args.model} --tokens {args.tokens} --ctx {args.ctx}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "rows": rows, "errors": errors, "tokens": total, "calls": calls, "turns": turns,
            "shifts": shifts, "chat_tokens": chat_tokens, "work_s": work_s, "load_s": t_load,
            "per_call_itl": per_call}, indent=1))
    good = all(ok for _, ok, _, _ in verdicts) and not errors and ok_tokens
    return 0 if good else 1


if __name__ == "__main__":
    raise SystemExit(main())
