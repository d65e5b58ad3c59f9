"""The kernel cache on the GPU: a kernel loaded from its cubin is the kernel that was compiled
(bit-identical outputs), a corrupt entry is rebuilt, and a whole engine started from a warm
cache decodes exactly as one started cold."""
import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def _factory(scale):
    from numba import cuda

    def body(x, y):
        i = cuda.grid(1)
        if i < x.size:
            y[i] = x[i] * scale + math.sin(x[i])
    return body


def test_a_cached_kernel_is_the_compiled_kernel(tmp_path, monkeypatch):
    from numba import cuda

    from nq.kernels import build
    monkeypatch.setenv("NQ_CACHE", str(tmp_path))
    monkeypatch.delenv("NQ_NO_KERNEL_CACHE", raising=False)
    sig = "void(float32[::1], float32[::1])"
    x = cuda.to_device(np.linspace(-50, 50, 4099, dtype=np.float32))

    def run(kernel):
        y = cuda.device_array(4099, np.float32)
        kernel[33, 128](x, y)
        return y.copy_to_host()

    s0 = dataclasses.replace(build.STATS)
    fresh = run(build.compile_kernel(_factory(1.5), sig, "test_cache_s1p5", fastmath=True))
    assert build.STATS.compiled == s0.compiled + 1
    (entry,) = (tmp_path / "kernels").glob("test_cache_s1p5-*.cubin")
    cached = run(build.compile_kernel(_factory(1.5), sig, "test_cache_s1p5", fastmath=True))
    assert build.STATS.loaded == s0.loaded + 1 and build.STATS.compiled == s0.compiled + 1
    assert np.array_equal(fresh.view(np.uint32), cached.view(np.uint32))
    # another constant is another entry, another result
    other = run(build.compile_kernel(_factory(2.5), sig, "test_cache_s2p5", fastmath=True))
    assert not np.array_equal(other, fresh)
    # a flipped byte in the cubin: detected, deleted, compiled again, same bits
    data = bytearray(entry.read_bytes())
    data[-100] ^= 0xFF
    entry.write_bytes(bytes(data))
    again = run(build.compile_kernel(_factory(1.5), sig, "test_cache_s1p5", fastmath=True))
    assert build.STATS.rebuilt == s0.rebuilt + 1 and build.STATS.compiled == s0.compiled + 3
    assert np.array_equal(fresh.view(np.uint32), again.view(np.uint32))
    assert build.read_entry(entry) is not None


ENGINE_RUN = """
import hashlib, sys, numpy as np
from nq.config import tiny_config
from nq.kernels import build
from nq.runtime.engine import Engine
eng = Engine.random(tiny_config(), max_len=256, seed=3)
logits = eng.prefill([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17])
ids = [int(np.argmax(logits))]
for _ in range(8):
    logits = eng.decode(ids[-1])
    ids.append(int(np.argmax(logits)))
print(build.STATS.compiled, build.STATS.loaded, hashlib.sha256(logits.tobytes()).hexdigest(), ids)
"""


def test_an_engine_from_a_warm_cache_decodes_as_a_cold_one(tmp_path):
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, NQ_CACHE=str(tmp_path), PYTHONPATH=path)
    env.pop("NQ_NO_KERNEL_CACHE", None)

    def start():
        out = subprocess.run([sys.executable, "-c", ENGINE_RUN], env=env, capture_output=True,
                             text=True, timeout=600, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-3000:]
        compiled, loaded, digest, ids = out.stdout.strip().split(" ", 3)
        return int(compiled), int(loaded), digest, ids

    cold, warm = start(), start()
    assert cold[0] > 10 and cold[1] == 0          # every kernel of the step compiled once
    # and then none compiled: the step's loaded, and of the prefill's GEMM tiles only those a
    # 17-token prompt runs (Gemm.prepare leaves cached tiles to their first use)
    assert warm[0] == 0 and 10 < warm[1] < cold[0]
    assert warm[2:] == cold[2:]                   # the same logits, bit for bit, and tokens
