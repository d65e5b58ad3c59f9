"""How long `nq generate` takes from the command to its first token and to its exit (issue 15).

    source scripts/h200_env.sh && python3 scripts/start_probe.py        # ~2-3 minutes on the H200

Makes the random 7B file if it is missing (scripts/make_random_nanoqwen.py, ~16 s) and reads it
once so it is in the page cache, packs the tiny test model, and runs with a kernel cache of its
own (emptied first; $NQ_CACHE's is left alone):

    upload alone          the pinned ring at a few shapes vs the pageable copies it replaced
    7B  first start       every kernel compiled (in processes: build.parallel_compiles)
    7B  long prompt       ~2000 tokens: the first prompt that needs the large GEMM tiles
    7B  warm x 2          short prompt, everything from the cache
    7B  warm long         the long prompt again, every tile loaded at start
    tiny first, warm x 2

For each: wall seconds from the command to its first byte of generated text on stdout and to
its exit, TTFT, and `--verbose`'s parts (nq/timeline.py: they add up to the process's life up to
its last lap; "exit" below is what is left: interpreter and CUDA teardown).

    python3 scripts/start_probe.py --warm 3      # ~2 minutes on the H200

Warm starts only: the import times (median of 5 fresh processes), one start of each model to
fill the kernel cache, then 3 warm starts of the 7B and of the tiny model in each of three
settings, alternated: as shipped (the CUDA driver started on its own thread, nq/gpu_start.py,
and the weights copied while numba imports, nq/runtime/preload.py), NQ_PRELOAD=0 (the copy
waits for numba, as before the preload) and NQ_DRIVER_THREAD=0 (numba starts the driver, and
nothing is preloaded); each part's median, side by side.  `--imports` prints only the import
times (it runs on a CPU).
"""
from __future__ import annotations

import argparse
import os
import re
import selectors
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(cmd, env) -> dict:
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    sel.register(p.stderr, selectors.EVENT_READ)
    first, err = None, b""
    open_ = 2
    while open_:
        for key, _ in sel.select():
            data = os.read(key.fileobj.fileno(), 65536)
            if not data:
                sel.unregister(key.fileobj)
                open_ -= 1
            elif key.fileobj is p.stdout and first is None and data.strip():
                first = time.perf_counter() - t0
            elif key.fileobj is p.stderr:
                err += data
    rc = p.wait()
    wall = time.perf_counter() - t0
    text = err.decode(errors="replace")
    if rc != 0:
        sys.exit(f"start_probe: {' '.join(map(str, cmd))} failed ({rc}):\n{text[-3000:]}")
    # a rate in a part's name ("... 12.3 GB/s") varies run to run: named "x GB/s", the parts
    # of several runs line up (its seconds and the bytes stay)
    parts = [(re.sub(r"\d+\.\d+ GB/s", "x GB/s", m.group(1).strip()), float(m.group(2)) / 1e3)
             for m in re.finditer(r"^(.+?):\s+([\d.]+) ms$", text, re.M)]
    ttft = re.search(r"TTFT ([\d.]+) ms", text)
    return {"wall": wall, "first": first, "ttft": float(ttft.group(1)) / 1e3 if ttft else None,
            "parts": parts, "stderr": text}


def show(label: str, r: dict, detail: bool) -> None:
    parts = dict(r["parts"])
    total = parts.get("sum of the parts")
    inner = parts.get("process start to the first token")
    print(f"{label:22s} first byte {r['first'] or float('nan'):6.2f} s  exit {r['wall']:6.2f} s  "
          f"TTFT {(r['ttft'] or 0) * 1e3:7.1f} ms  (own clock: first token {inner or 0:6.2f} s, "
          f"exit - sum of parts {r['wall'] - (total or 0):5.2f} s)", flush=True)
    if detail:
        for name, sec in r["parts"]:
            if name not in ("process start to the first token",) and not name.startswith(
                    ("prompt eval", "time to first", "eval ", "ITL")):
                print(f"    {name:44s}{sec * 1e3:9.1f} ms")
        for line in r["stderr"].splitlines():
            if line.startswith("kernels:"):
                print("    " + line)


IMPORTS = {   # what a `nq generate` start imports, in fresh processes (wall, median of 5)
    "python -c pass": "pass",
    "import nq.cli + its parser": "import nq.cli; nq.cli.build_parser()",
    "generate's main thread": "import nq.cli; nq.cli.build_parser(); import nq.generate, "
                              "nq.loader.format, nq.text, nq.runtime.preload",
    "from numba import cuda": "from numba import cuda",
    "cuda.bindings.driver": "from cuda.bindings import driver",
    "the start's threads' imports": "from numba import cuda; import nq.kernels.build; "
                                    "import nq.gpu_start as g; [__import__(m) for m in "
                                    "g.ENGINE_MODULES]",
}


def import_times(env, reps: int = 5) -> None:
    for name, code in IMPORTS.items():
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            r = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,
                               capture_output=True)
            ts.append(time.perf_counter() - t)
        ok = "" if r.returncode == 0 else "  (failed: " + r.stderr.decode()[-80:].strip() + ")"
        print(f"  {name:32s}{statistics.median(ts) * 1e3:7.0f} ms{ok}", flush=True)


SETTINGS = {"as shipped": {}, "NQ_PRELOAD=0": {"NQ_PRELOAD": "0"},
            "NQ_DRIVER_THREAD=0": {"NQ_DRIVER_THREAD": "0"}}


def warm_table(label: str, cmd, env, n: int) -> None:
    """n warm starts in each of SETTINGS, alternated; the median of each part, first byte and
    exit, side by side."""
    runs = {k: [] for k in SETTINGS}
    for _ in range(n):
        for k, extra in SETTINGS.items():
            runs[k].append(run(cmd, dict(env, **extra)))
    names = []
    for rs in runs.values():
        for r in rs:
            names += [p for p, _ in r["parts"] if p not in names and not p.startswith(
                ("prompt eval", "time to first", "eval ", "ITL"))]

    def med(rs, key):
        vals = [v for v in (key(r) for r in rs) if v is not None]
        return f"{statistics.median(vals) * 1e3:9.1f}" if vals else f"{'-':>9s}"
    print(f"{label + f' (median of {n}, ms)':60s}" + "".join(f"{k:>22s}" for k in runs))
    rows = [("first byte on stdout (wall)", lambda r: r["first"]),
            ("exit (wall)", lambda r: r["wall"])]
    rows += [(p, lambda r, p=p: dict(r["parts"]).get(p)) for p in names]
    for name, key in rows:
        print(f"    {name:56s}" + "".join(f"{med(rs, key):>22s}" for rs in runs.values()),
              flush=True)


def sweep(path: str) -> None:
    """The weight upload alone (nq/runtime/staging.py) from the page cache into one device
    buffer, at a few ring shapes, against the pageable copies it replaced; bytes checked once."""
    import numpy as np
    from numba import cuda

    from nq.runtime import staging
    size = Path(path).stat().st_size
    dev = cuda.device_array(size, np.uint8)
    ptr = dev.__cuda_array_interface__["data"][0]
    stream = cuda.stream()
    shapes = [(16, 8, 4), (16, 8, 8), (16, 8, 2), (16, 8, 1), (64, 4, 4), (4, 16, 4)]
    for i, (chunk_mb, buffers, readers) in enumerate(shapes):
        t = time.perf_counter()
        staging.run(path, [staging.Copy(0, size, ptr)], staging.CudaDevice(stream),
                    chunk_mb << 20, buffers, readers)
        dt = time.perf_counter() - t
        print(f"  ring {chunk_mb:3d} MB x {buffers:2d}, {readers} readers: {dt:6.3f} s "
              f"{size / 1e9 / dt:6.1f} GB/s", flush=True)
        if i == 0:
            host = np.memmap(path, np.uint8, "r")
            step = 256 << 20
            same = all(np.array_equal(dev[a:a + step].copy_to_host(), host[a:a + step])
                       for a in range(0, size, step))
            print(f"  bytes on the device equal the file: {same}", flush=True)
            if not same:
                sys.exit("start_probe: the ring's upload differs from the file")
    host = np.memmap(path, np.uint8, "r")
    t = time.perf_counter()
    for a in range(0, size, 64 << 20):     # what upload did before: pageable copies of the map
        dev[a:a + (64 << 20)].copy_to_device(host[a:a + (64 << 20)])
    cuda.synchronize()
    dt = time.perf_counter() - t
    print(f"  pageable copies of the mapping: {dt:6.3f} s {size / 1e9 / dt:6.1f} GB/s", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="/tmp/r7b.nanoqwen",
                    help="the random 7B file (made if missing)")
    ap.add_argument("--tiny", default="/tmp/nq_probe_tiny.nanoqwen")
    ap.add_argument("--all-parts", action="store_true", help="print every run's parts")
    ap.add_argument("--backend", default="gpu", help="numpy: a smoke test of this script on a CPU")
    ap.add_argument("--tiny-only", action="store_true", help="skip the 7B runs")
    ap.add_argument("--warm", type=int, metavar="N", default=0,
                    help="only warm starts: N in each setting (the module docstring), medians")
    ap.add_argument("--imports", action="store_true", help="only the import times (CPU)")
    ap.add_argument("--sweep", metavar="FILE", help=argparse.SUPPRESS)   # the child of the sweep
    a = ap.parse_args()
    if a.sweep:
        sys.path.insert(0, str(ROOT))
        sweep(a.sweep)
        return 0
    if a.imports:
        print("imports (wall of a fresh process, median of 5):")
        import_times(os.environ)
        return 0

    if a.tiny_only:
        pass
    elif not Path(a.model).exists():
        t = time.perf_counter()
        subprocess.run([sys.executable, str(ROOT / "scripts/make_random_nanoqwen.py"), "7b",
                        a.model], check=True, cwd=ROOT)
        print(f"made {a.model} in {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    with open(a.model if not a.tiny_only else a.tiny, "rb") as f:   # into the page cache
        while f.read(64 << 20):
            pass
    size = Path(a.model if not a.tiny_only else a.tiny).stat().st_size
    print(f"read {size / 1e9:.2f} GB in {time.perf_counter() - t:.2f} s "
          f"({size / 1e9 / (time.perf_counter() - t):.1f} GB/s from the page cache, one thread)")
    if not Path(a.tiny).exists():
        sys.path.insert(0, str(ROOT))
        from nq.config import tiny_config
        from nq.loader.hf import pack
        from nq.loader.synth import make_hf_snapshot
        with tempfile.TemporaryDirectory() as d:
            pack(make_hf_snapshot(Path(d) / "hf", tiny_config(), seed=0), a.tiny, progress=False)

    cache = Path(tempfile.mkdtemp(prefix="nq-probe-cache-"))
    env = dict(os.environ, NQ_CACHE=str(cache))
    for k in ("NQ_NO_KERNEL_CACHE", "NQ_PRELOAD", "NQ_DRIVER_THREAD"):
        env.pop(k, None)
    long_prompt = cache / "long.txt"
    fib = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    long_prompt.write_text(fib * 53)   # ~2000 tokens of the test tokenizer
    gen = [sys.executable, "-m", "nq", "generate", "--temp", "0", "-n", "16", "--ignore-eos",
           "--verbose", "--backend", a.backend]
    short = ["-p", "def fib(n):"]
    long_ = ["-f", str(long_prompt), "-c", "4096"]
    try:
        if a.warm:
            print("imports (wall of a fresh process, median of 5):")
            import_times(env)
            models = ([("7B", a.model)] if not a.tiny_only else []) + [("tiny", a.tiny)]
            for label, path in models:   # fills the kernel cache
                show(f"{label} first start", run(gen + ["-m", path] + short, env), False)
            for label, path in models:
                warm_table(f"{label} warm", gen + ["-m", path] + short, env, a.warm)
            return 0
        if not a.tiny_only and a.backend == "gpu":
            print("weight upload alone (first run: its bytes checked against the file):")
            subprocess.run([sys.executable, __file__, "--sweep", a.model], check=True, env=env,
                           cwd=ROOT)
        r = subprocess.run([sys.executable, "-X", "importtime", "-c",
                            "import nq.cli; from numba import cuda; import nq.runtime.engine"],
                           capture_output=True, text=True, env=env, cwd=ROOT)
        rows = [line.split("|") for line in r.stderr.splitlines()
                if line.startswith("import time:")]
        top = sorted(((int(c), n.strip()) for _, c, n in rows[1:] if c.strip().isdigit()),
                     reverse=True)
        print("imports (cumulative, -X importtime): " + ", ".join(
            f"{n} {c / 1e3:.0f} ms" for c, n in top if n in (
                "nq.cli", "numpy", "numba", "numba.cuda", "nq.runtime.engine", "cuda.core",
                "nq.loader.format", "nq.kernels")))
        print(f"kernel cache {cache} (empty); nq generate -n 16 --temp 0 --verbose:")
        if not a.tiny_only:
            show("7B first start", run(gen + ["-m", a.model] + short, env), True)
            show("7B long, first", run(gen + ["-m", a.model] + long_, env), a.all_parts)
            show("7B warm", run(gen + ["-m", a.model] + short, env), a.all_parts)
            show("7B warm", run(gen + ["-m", a.model] + short, env), True)
            show("7B warm long", run(gen + ["-m", a.model] + long_, env), True)
        show("tiny first start", run(gen + ["-m", a.tiny] + short, env), a.all_parts)
        show("tiny warm", run(gen + ["-m", a.tiny] + short, env), a.all_parts)
        show("tiny warm", run(gen + ["-m", a.tiny] + short, env), True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
