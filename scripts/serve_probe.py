"""`nq serve` at the 7B shape on the H200, measured at the client: streamed ITL and the TTFT of an
editor's resent context (issue #17's speed targets).

    python3 scripts/serve_probe.py [MODEL] [--itl-ref 1.874] [--out probe.json]

MODEL defaults to /tmp/r7b-text.nanoqwen, written first when missing by
`scripts/make_random_nanoqwen.py 7b MODEL --text-ids` (~20 s; --text-ids makes greedy pick only ids
the embedded tokenizer can show, so every token reaches the client as text; a file without it
still works, with fewer chunks than tokens).  The server runs as a real process on 127.0.0.1:

    python3 -m nq serve -m MODEL --port 0 -c 8192 --cache-slots 2 --alias r7b

and the probe talks to it with http.client (the standard library: nothing to install for the
client).  Every request is greedy (temperature 0), so decode runs the device argmax graph.

    ITL    /v1/completions, stream, ignore_eos, 256 tokens after a 64-token prompt: the gaps
           between SSE chunks (p50) and (last chunk - first chunk) / (tokens - 1); compared with
           `nq bench --random 7b`'s 1.874 ms (H200, 2026-12-01; target: within 5 %)
    TTFT   max_tokens 1, not streamed (the reply is the first token), wall time at the client:
           a fresh 64-token prompt (median of 5); a 4096-token context the first time; the same
           context with its last line (16 tokens) changed (median of 5; target < 2x the 64-token
           TTFT); and after another 4K conversation took the GPU, the first one again with a line
           changed (its KV restored from the pinned host copy: --cache-slots 2)

The server needs starlette and uvicorn (`pip install "nq[serve]"`).  On a machine that reaches no
registry (the H200 here), download their pure-Python wheels where PyPI is reachable, into the
ignored .whl/ folder that scripts/h200_env.sh installs from (these are the versions the CPU tests
ran with on 2026-12-01):

    python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \\
      --platform manylinux_2_28_x86_64 -d .whl "starlette==1.10.0" "uvicorn==0.54.0"
    # -> starlette-1.10.0, uvicorn-0.54.0, anyio-4.16.0, click-8.5.1, h11-0.16.0, idna-3.20,
    #    typing_extensions-4.16.0 (all py3-none-any)

The probe checks for them first and says what is missing.  It runs in about a minute with a warm
kernel cache ($NQ_CACHE), ~2 more the first time (the server compiles its kernels).
"""
from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ("starlette-1.10.0, uvicorn-0.54.0, anyio-4.16.0, click-8.5.1, h11-0.16.0, idna-3.20, "
          "typing_extensions-4.16.0")
TEXT_IDS = 500  # prompt ids below the embedded tokenizer's 535 regular ids


class Server:
    """`nq serve` as a child process; its stderr lines are kept (and echoed on failure)."""

    def __init__(self, model: str, ctx: int, slots: int, start_s: float, backend: str = "gpu"):
        cmd = [sys.executable, "-m", "nq", "serve", "-m", model, "--port", "0", "-c", str(ctx),
               "--cache-slots", str(slots), "--alias", "r7b", "--backend", backend]
        self.cmd = " ".join(cmd[1:])
        self.lines: list[str] = []
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        q: queue.Queue = queue.Queue()

        def pump():
            for line in self.proc.stderr:
                self.lines.append(line.rstrip())
                q.put(line)
            q.put(None)
        threading.Thread(target=pump, daemon=True).start()
        t0, deadline = time.perf_counter(), time.perf_counter() + start_s
        while True:
            try:
                line = q.get(timeout=max(0.1, deadline - time.perf_counter()))
            except queue.Empty:
                line = None
            if line is None:
                self.stop()
                sys.exit("the server did not start:\n" + "\n".join(self.lines[-30:]))
            m = re.search(r"serving .* at http://([\d.]+):(\d+)", line)
            if m:
                self.host, self.port = m.group(1), int(m.group(2))
                self.start_s = time.perf_counter() - t0
                return

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def post(self, path: str, body: dict) -> tuple[dict, float]:
        """(reply, wall seconds) of a non-streamed request."""
        c = http.client.HTTPConnection(self.host, self.port, timeout=300)
        t = time.perf_counter()
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        dt = time.perf_counter() - t
        c.close()
        if r.status != 200:
            raise RuntimeError(f"{path}: {r.status} {data[:500]!r}")
        return json.loads(data), dt

    def stream(self, path: str, body: dict) -> tuple[list[tuple[float, dict]], float]:
        """The SSE events of a streamed request with their arrival times (s after the send)."""
        c = http.client.HTTPConnection(self.host, self.port, timeout=300)
        t = time.perf_counter()
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"{path}: {r.status} {r.read()[:500]!r}")
        events = []
        while True:
            line = r.fp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                break
            events.append((time.perf_counter() - t, json.loads(line[6:])))
        done = time.perf_counter() - t
        c.close()
        return events, done


def ids(seed: int, n: int, first: int | None = None) -> list[int]:
    import random
    rng = random.Random(seed)
    out = [rng.randrange(TEXT_IDS) for _ in range(n)]
    if first is not None:
        out[0] = first
    return out


def ttft(srv: Server, prompt: list[int]) -> tuple[float, int]:
    """(ms, cached tokens) of a one-token completion."""
    r, dt = srv.post("/v1/completions", {"model": "r7b", "prompt": prompt, "max_tokens": 1,
                                         "temperature": 0})
    return 1e3 * dt, r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def itl(srv: Server, n: int) -> dict:
    events, done = srv.stream("/v1/completions", {
        "model": "r7b", "prompt": ids(7, 64), "max_tokens": n, "temperature": 0, "stream": True,
        "ignore_eos": True, "stream_options": {"include_usage": True}})
    times = [t for t, e in events if e.get("choices") and e["choices"][0].get("text")]
    tokens = next((e["usage"]["completion_tokens"] for _, e in events if e.get("usage")), 0)
    gaps = [1e3 * (b - a) for a, b in zip(times, times[1:])]
    return {"tokens": tokens, "chunks": len(times),
            "gap_p50_ms": statistics.median(gaps) if gaps else None,
            "mean_ms": 1e3 * (times[-1] - times[0]) / (tokens - 1) if len(times) > 1 else None,
            "ttft_ms": 1e3 * times[0] if times else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default="/tmp/r7b-text.nanoqwen")
    ap.add_argument("--itl-ref", type=float, default=1.874,
                    help="nq bench's ITL in ms to compare with (H200, 2026-12-01: 1.874)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--ctx-tokens", type=int, default=4096)
    ap.add_argument("--backend", default="gpu",
                    help="numpy: a CPU smoke test of the probe itself on a tiny model")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    missing = [m for m in ("starlette", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"serve_probe: {' and '.join(missing)} not installed: `nq serve` needs the serve "
              f"extra.  This machine reaches no registry?  Then on one that does, run\n"
              f"  python3 -m pip download --only-binary=:all: --python-version "
              f"{sys.version_info.major}.{sys.version_info.minor} --implementation cp --platform "
              f"manylinux_2_28_x86_64 -d .whl starlette==1.10.0 uvicorn==0.54.0\n"
              f"and carry .whl (scripts/h200_env.sh installs it); the wheels: {WHEELS}",
              file=sys.stderr)
        return 2
    if not Path(args.model).exists():
        print(f"serve_probe: writing {args.model} (7B shape, random, --text-ids)", flush=True)
        subprocess.run([sys.executable, str(ROOT / "scripts/make_random_nanoqwen.py"), "7b",
                        args.model, "--text-ids"], check=True)
    n_ctx, edit = args.ctx_tokens, 16
    srv = Server(args.model, ctx=2 * n_ctx, slots=2, start_s=400, backend=args.backend)
    print(f"server up in {srv.start_s:.1f} s: {srv.cmd}", flush=True)
    res: dict = {"command": srv.cmd, "server_start_s": srv.start_s}
    try:
        # warm-up: every prefill GEMM tile class compiles on first use (M <= 16, <= 64, larger)
        ttft(srv, ids(1, 64, first=1))
        w = ids(2, n_ctx)
        ttft(srv, w)
        ttft(srv, w[:-edit] + ids(3, edit, first=3))
        itl(srv, 32)
        res["itl"] = itl(srv, args.tokens)

        short = [ttft(srv, ids(10 + i, 64, first=10 + i)) for i in range(5)]
        res["ttft_64_ms"] = statistics.median(t for t, _ in short)
        a, b = ids(20, n_ctx, first=20), ids(21, n_ctx, first=21)
        res["ttft_ctx_cold_ms"], _ = ttft(srv, a)
        edits = [ttft(srv, a[:-edit] + ids(30 + i, edit, first=30 + i)) for i in range(5)]
        res["ttft_ctx_edit_ms"] = statistics.median(t for t, _ in edits)
        res["ctx_edit_cached"] = [c for _, c in edits]
        switches = []
        for i in range(3):  # A and B take turns: each turn restores the other from the host
            ttft(srv, b[:-edit] + ids(40 + i, edit, first=40 + i))
            switches.append(ttft(srv, a[:-edit] + ids(50 + i, edit, first=50 + i)))
        res["ttft_ctx_switch_ms"] = statistics.median(t for t, _ in switches)
        res["ctx_switch_cached"] = [c for _, c in switches]
    finally:
        srv.stop()
    log = [line for line in srv.lines if "prompt tokens" in line]
    res["server_log_tail"] = log[-6:]

    it, ref = res["itl"], args.itl_ref
    # the verdict's figure: stream time per token, first chunk to last (robust to chunks that
    # arrive together in one read, which the p50 of the gaps is not)
    itl_ms = it["mean_ms"]
    res["itl_ms"] = itl_ms
    ratio = res["ttft_ctx_edit_ms"] / res["ttft_64_ms"]
    rows = [
        (f"ITL at the client, first to last of {it['tokens']} tokens ({it['chunks']} chunks)",
         f"{it['mean_ms']:.3f} ms" if it["mean_ms"] else "-", f"within 5 % of {ref} ms"),
        ("ITL at the client, p50 of the gaps between chunks", f"{it['gap_p50_ms']:.3f} ms"
         if it["gap_p50_ms"] else "-", f"(nq bench's p50: {ref} ms)"),
        ("TTFT, fresh 64-token prompt (median of 5)", f"{res['ttft_64_ms']:.1f} ms", ""),
        (f"TTFT, {n_ctx}-token context, first time", f"{res['ttft_ctx_cold_ms']:.1f} ms", ""),
        (f"TTFT, same context, last {edit} tokens changed (median of 5)",
         f"{res['ttft_ctx_edit_ms']:.1f} ms", f"< 2x the 64-token TTFT: {ratio:.2f}x"),
        (f"TTFT, back to it after another {n_ctx}-token conversation (host restore)",
         f"{res['ttft_ctx_switch_ms']:.1f} ms", "cache slot 2"),
    ]
    print(f"\n| measure ({Path(args.model).name}, {args.backend}, {time.strftime('%Y-%m-%d')}) "
          "| value | target |")
    print("| --- | --- | --- |")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")
    itl_ok = itl_ms is not None and abs(itl_ms / ref - 1) <= 0.05
    want_cached = n_ctx - edit
    print(f"\nverdict ITL within 5 % of {ref} ms: {'PASS' if itl_ok else 'FAIL'} "
          f"({(itl_ms or float('nan')) / ref - 1:+.1%}: {itl_ms} ms)")
    print(f"verdict editor TTFT < 2x short TTFT: {'PASS' if ratio < 2 else 'FAIL'} ({ratio:.2f}x)")
    cached_ok = set(res["ctx_edit_cached"]) | set(res["ctx_switch_cached"]) == {want_cached}
    print(f"verdict prompt cache served {want_cached} of {n_ctx} tokens on every edit and switch: "
          f"{'PASS' if cached_ok else 'FAIL'} (edits {res['ctx_edit_cached']}, switches "
          f"{res['ctx_switch_cached']})")
    print("server: " + "\n        ".join(res["server_log_tail"]))
    print(f"command: python3 scripts/serve_probe.py {args.model}  (server: {srv.cmd})")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0 if itl_ok and ratio < 2 and cached_ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
