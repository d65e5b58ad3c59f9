"""Start-up on the GPU: kernels compiled by build.parallel_compiles' forked processes are the
kernels a serial compile makes (their cache entries hold the same code, and an engine decodes
the same tokens from them, cold and warm); the tiny model's warm start is measured and printed
(`-s` shows it), not asserted: a timing bound would be a test that fails on a busy machine."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]

RUN = r"""
import json, sys, time
t0 = time.perf_counter()
from nq.kernels.build import STATS
from nq.loader.format import NanoqwenFile
from nq.runtime.engine import Engine
from nq.sample import SamplingParams
from nq.timeline import TIMELINE, process_age
age = process_age()
nf = NanoqwenFile(sys.argv[1])
TIMELINE.start(before=None)
t1 = time.perf_counter()
eng = Engine.from_file(nf, max_len=256)
ids = [(7 * i + 3) % nf.config.vocab_size for i in range(100)]   # LARGE GEMM tiles (M = 99)
out, first = [], None
for tok in eng.generate_ids(ids, 12, SamplingParams(temperature=0.0)):
    first = first or time.perf_counter()
    out.append(int(tok))
short = list(eng.generate_ids(ids[:9], 6, SamplingParams(temperature=0.0)))  # SMALL tiles
logits = eng.prefill(ids[:40])                                                 # MEDIUM tiles
import hashlib
print("RESULT " + json.dumps({
    "tokens": out, "short": [int(t) for t in short], "compiled": STATS.compiled,
    "logits": hashlib.sha256(logits.tobytes()).hexdigest(),
    "loaded": STATS.loaded, "parallel_s": STATS.parallel_s,
    "from_file_to_first_token_s": first - t1, "process_to_first_token_s": (age or 0) + first - t0,
    "parts": TIMELINE.parts, "aside": TIMELINE.side}))
"""


def _start(model, cache, workers):
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, NQ_CACHE=str(cache), PYTHONPATH=path, NQ_COMPILE_WORKERS=str(workers))
    env.pop("NQ_NO_KERNEL_CACHE", None)
    r = subprocess.run([sys.executable, "-c", RUN, str(model)], env=env, capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[7:])


def test_parallel_compiled_kernels_are_the_serial_ones(tiny_nanoqwen, tmp_path):
    from nq.kernels import build
    par = _start(tiny_nanoqwen, tmp_path / "par", 8)       # a first start, in 8 processes
    ser = _start(tiny_nanoqwen, tmp_path / "ser", 1)       # a first start, in the process
    warm = [_start(tiny_nanoqwen, tmp_path / "par", 8) for _ in range(2)]
    assert par["compiled"] > 0 and par["parallel_s"] > 0 and ser["parallel_s"] == 0
    assert all(w["compiled"] == 0 and w["loaded"] > 0 for w in warm), warm
    for run in (ser, *warm):   # bit-identical logits, the same tokens
        assert (run["logits"], run["tokens"], run["short"]) == (
            par["logits"], par["tokens"], par["short"])
    # the same entries; the same bytes where the entry symbols are as long (a symbol carries
    # numba's per-process count of compiled functions, ...B2v7B... against ...B2v31B...: masked;
    # of another length it moves the ELF's offsets, and the logits above are the check)
    a = {p.name: p for p in (tmp_path / "par" / "kernels").glob("*.cubin")}
    b = {p.name: p for p in (tmp_path / "ser" / "kernels").glob("*.cubin")}
    assert a.keys() == b.keys() and a
    compared = 0
    for name in a:
        (ha, ca), (hb, cb) = build.read_entry(a[name]), build.read_entry(b[name])
        ea, eb = ha["entry"].encode(), hb["entry"].encode()
        if len(ea) == len(eb):
            assert ca.replace(ea, b"E" * len(ea)) == cb.replace(eb, b"E" * len(eb)), name
            compared += 1
    print(f"\n{len(a)} cache entries; {compared} byte-compared with the serial compile's")
    print(f"\ntiny model, Engine.from_file -> first token: first start {par['from_file_to_first_token_s']:.2f} s "
          f"in 8 processes ({par['parallel_s']:.2f} s of compiling), "
          f"{ser['from_file_to_first_token_s']:.2f} s serial; warm "
          f"{', '.join('%.3f' % w['from_file_to_first_token_s'] for w in warm)} s "
          f"(process start -> first token {warm[-1]['process_to_first_token_s']:.3f} s)")
    for name, sec in warm[-1]["parts"]:
        print(f"  {name:40s}{sec * 1e3:9.1f} ms")
    for name, sec in warm[-1]["aside"]:
        print(f"  beside it: {name:29s}{sec * 1e3:9.1f} ms")
