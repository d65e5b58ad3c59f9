"""The weights' copy started before numba's import (nq/runtime/preload.py) on the GPU: the
device holds the bytes of the ordinary upload (upload_mismatches: none), and the engine decodes
the same tokens with it on, off (NQ_PRELOAD=0) and after its copies failed (upload copies again
into its arena); `nq generate` gives the same ids either way.  Fresh processes: the driver's
thread and the preload start once a process."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]

RUN = r"""
import json, os, sys
from nq import gpu_start
from nq.loader.format import NanoqwenFile
from nq.runtime import preload, staging
from nq.timeline import TIMELINE
if os.environ.get("NQ_TEST_BREAK_PRELOAD") == "1":
    def broken(self, dst, ptr, nbytes):
        raise RuntimeError("a copy that fails (test)")
    staging.DriverDevice.copy = broken
gpu_start.start(TIMELINE)
nf = NanoqwenFile(sys.argv[1])
started = preload.start(nf, TIMELINE) is not None
gpu_start.wait()
from nq.runtime.engine import Engine
from nq.runtime.weights import upload_mismatches
from nq.sample import SamplingParams
eng = Engine.from_file(nf, max_len=256)
ids = [(7 * i + 3) % nf.config.vocab_size for i in range(40)]
out = [int(t) for t in eng.generate_ids(ids, 12, SamplingParams(temperature=0.0))]
print("RESULT " + json.dumps({"started": started, "tokens": out,
                              "bad": upload_mismatches(nf, eng.w),
                              "aside": [n for n, _ in TIMELINE.side]}))
"""


def _env(**kw):
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, **kw)
    for k in ("NQ_PRELOAD", "NQ_DRIVER_THREAD"):
        if k not in kw:
            env.pop(k, None)
    return env


def _run(model, **env):
    r = subprocess.run([sys.executable, "-c", RUN, str(model)], env=_env(**env),
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[7:])


def test_preloaded_weights_are_the_uploaded_ones(tiny_nanoqwen):
    from nq.runtime.preload import PART
    on = _run(tiny_nanoqwen)
    off = _run(tiny_nanoqwen, NQ_PRELOAD="0")
    broken = _run(tiny_nanoqwen, NQ_TEST_BREAK_PRELOAD="1")
    assert on["started"] and not off["started"] and broken["started"]
    assert any(n.startswith(PART + " (") for n in on["aside"]), on["aside"]
    assert any(n.startswith(PART + " failed") for n in broken["aside"]), broken["aside"]
    assert on["bad"] == off["bad"] == broken["bad"] == []
    assert on["tokens"] == off["tokens"] == broken["tokens"]


def test_generate_gives_the_same_ids_with_and_without_the_preload(tiny_nanoqwen):
    cmd = [sys.executable, "-m", "nq", "generate", "-m", str(tiny_nanoqwen), "-p", "def fib(n):",
           "-n", "12", "--temp", "0", "--ignore-eos", "--json", "--verbose"]
    got = {}
    for tag, env in (("on", {}), ("off", {"NQ_PRELOAD": "0"}),
                     ("no driver thread", {"NQ_DRIVER_THREAD": "0"})):
        r = subprocess.run(cmd, env=_env(**env), capture_output=True, text=True, timeout=300,
                           cwd=ROOT)
        assert r.returncode == 0, r.stderr[-4000:]
        got[tag] = json.loads(r.stdout)["ids"]
        assert ("weights upload before numba (" in r.stderr) == (tag == "on"), r.stderr
    assert got["on"] == got["off"] == got["no driver thread"]
