"""nq/kernels/build.py on the CPU: kernel names, the cache key, entries and their checks, and
concurrent writers.  Loading a cubin needs a GPU: tests/kernels/test_build_gpu.py."""
import hashlib
import json
import multiprocessing
import os
import subprocess

import pytest

from nq.kernels import build, cache_files


def test_kernel_name_encodes_every_constant():
    assert build.kernel_name("rmsnorm", h=3584, eps=1e-6, res=True) == "rmsnorm_h3584_eps1em06_res1"
    assert build.kernel_name("x", a=0.5, b=False) == "x_a0p5_b0"


@pytest.fixture
def env(monkeypatch, tmp_path):
    """A fixed device environment (no GPU here) and an empty $NQ_CACHE."""
    monkeypatch.setenv("NQ_CACHE", str(tmp_path / "cache"))
    fixed = {"nq": "0", "numba-cuda": "0.30", "cc": [9, 0], "driver": [13, 0]}
    monkeypatch.setattr(build, "_environment", lambda: dict(fixed))
    return fixed


def _factory(n, eps):
    def body(a):
        a[0] = n * eps
    return body


def test_stats_name_every_kernel_asked_for(env, monkeypatch):
    """STATS.names: each kernel compile_kernel is asked for, by name (nq bench's JSON lists
    them), also one left to a compile batch."""
    from nq.tools.bench import kernels_built
    monkeypatch.setattr(build, "_BATCH", [])       # collected, not compiled: no GPU here
    monkeypatch.setattr(build.STATS, "names", [])
    build.compile_kernel(_factory(3, 1e-6), "void(float32[::1])", "k_b_n3")
    build.compile_kernel(_factory(2, 1e-6), "void(float32[::1])", "k_a_n2")
    build.compile_kernel(_factory(3, 1e-6), "void(float32[::1])", "k_b_n3")
    assert build.STATS.names == ["k_b_n3", "k_a_n2", "k_b_n3"]
    assert kernels_built() == ["k_a_n2", "k_b_n3"]


def test_cache_key_changes_with_every_input(env, monkeypatch):
    sig = "void(float32[::1])"
    base, inputs = build.cache_key(_factory(4, 1e-6), sig, "k", {"fastmath": True})
    assert inputs["closure"] == {"n": "4", "eps": "1e-06"}
    # the same inputs give the same key
    assert build.cache_key(_factory(4, 1e-6), sig, "k", {"fastmath": True})[0] == base
    others = [build.cache_key(_factory(5, 1e-6), sig, "k", {"fastmath": True})[0],   # a constant
              build.cache_key(_factory(4, 1e-5), sig, "k", {"fastmath": True})[0],   # eps
              build.cache_key(_factory(4, 1e-6), "void(float64[::1])", "k", {"fastmath": True})[0],
              build.cache_key(_factory(4, 1e-6), sig, "k2", {"fastmath": True})[0],
              build.cache_key(_factory(4, 1e-6), sig, "k", {"fastmath": False})[0]]
    monkeypatch.setattr(build, "_environment", lambda: dict(env, cc=[10, 0]))
    others.append(build.cache_key(_factory(4, 1e-6), sig, "k", {"fastmath": True})[0])
    monkeypatch.setattr(build, "_environment", lambda: dict(env, **{"numba-cuda": "0.31"}))
    others.append(build.cache_key(_factory(4, 1e-6), sig, "k", {"fastmath": True})[0])
    monkeypatch.setattr(build, "_environment", lambda: env)
    monkeypatch.setattr(build, "source_digest", lambda: "another source")
    others.append(build.cache_key(_factory(4, 1e-6), sig, "k", {"fastmath": True})[0])
    assert len({base, *others}) == len(others) + 1


def test_source_digest_covers_the_kernel_sources():
    build.source_digest.cache_clear()
    d = build.source_digest()
    assert len(d) == 64 and d == build.source_digest()


def test_entries_are_checked_before_use(env):
    path = cache_files.entry_path("ab" * 32, "some_kernel")
    assert path.parent == cache_files.cache_root() and str(path).startswith(os.environ["NQ_CACHE"])
    cubin = bytes(range(256)) * 40
    header = {"key": "ab" * 32, "entry": "e", "cc": [9, 0, "a"],
              "sha256": hashlib.sha256(cubin).hexdigest(), "created": "now"}
    cache_files.write_entry(path, header, cubin)
    assert build.read_entry(path, "ab" * 32) == (header, cubin)
    assert build.read_entry(path, "cd" * 32) is None            # another key: stale
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))         # one flipped bit
    assert build.read_entry(path, "ab" * 32) is None
    path.write_bytes(data[: len(data) // 2])                    # torn
    assert build.read_entry(path, "ab" * 32) is None
    path.write_bytes(b"garbage")
    assert build.read_entry(path) is None
    # `nq cache info` lists it as invalid; `nq cache clear` removes it and stale temporaries
    gone = subprocess.Popen(["true"])
    gone.wait()
    (path.parent / f".tmp-x-{gone.pid}").write_bytes(b"left by a killed process")
    live = path.parent / f".tmp-y-{os.getpid()}"    # a writer still running keeps its file
    live.write_bytes(b"being written")
    assert [h for _, _, h in cache_files.cache_entries()] == [None]
    assert cache_files.clear_cache()[0] == 2 and list(path.parent.iterdir()) == [live]


def _writer(args):
    path, i = args
    os.environ["NQ_CACHE"] = str(path)
    cubin = os.urandom(200_000)
    header = {"key": "k", "sha256": hashlib.sha256(cubin).hexdigest(), "writer": i}
    for _ in range(20):
        cache_files.write_entry(cache_files.entry_path("k" * 64, "shared"), header, cubin)
    return True


def test_in_cache_says_whether_a_compile_would_load(env, monkeypatch):
    body, sig, name = _factory(3, 0.5), "void(float32[::1])", "probe_kernel"
    assert not build.in_cache(body, sig, name)
    key, _ = build.cache_key(body, sig, name, {})
    cubin = b"\x7fELF" + bytes(300)
    header = {"key": key, "sha256": hashlib.sha256(cubin).hexdigest()}
    path = cache_files.entry_path(key, name)
    cache_files.write_entry(path, header, cubin)
    assert build.in_cache(body, sig, name)
    assert not build.in_cache(body, sig, name, fastmath=True)     # other options: another key
    assert not build.in_cache(_factory(4, 0.5), sig, name)        # another constant
    path.write_bytes(path.read_bytes()[:-1] + b"\x01")           # corrupt: would be rebuilt
    assert not build.in_cache(body, sig, name)
    cache_files.write_entry(path, header, cubin)
    monkeypatch.setenv("NQ_NO_KERNEL_CACHE", "1")
    assert not build.in_cache(body, sig, name)


def test_concurrent_writers_never_leave_a_torn_entry(tmp_path):
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        assert all(pool.map(_writer, [(tmp_path, i) for i in range(8)]))
    entries = list((tmp_path / "kernels").iterdir())
    assert len(entries) == 1                       # no temporary file left behind
    header, cubin = build.read_entry(entries[0])   # whole and consistent: one writer's bytes
    assert header["sha256"] == hashlib.sha256(cubin).hexdigest()
    assert json.loads(json.dumps(header))["writer"] in range(8)


def test_the_cache_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("NQ_NO_KERNEL_CACHE", "1")
    assert not build.cache_enabled()
    monkeypatch.setenv("NQ_NO_KERNEL_CACHE", "0")
    assert build.cache_enabled() is (not build.SIMULATOR)


def test_every_kernel_compiles_through_build():
    """One compile path: outside build.py, cuda.jit only makes device functions (device=True,
    e.g. common.dev) -- a kernel compiled elsewhere would bypass its name and the cache."""
    import re
    from pathlib import Path
    root = Path(build.__file__).resolve().parent.parent
    offenders = []
    for f in sorted(root.rglob("*.py")):
        if f.name == "build.py" and f.parent.name == "kernels":
            continue
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if re.search(r"cuda\.jit\(", line) and "device=True" not in line:
                offenders.append(f"{f.relative_to(root)}:{i}: {line.strip()}")
    assert not offenders, "kernels compiled outside nq/kernels/build.py:\n" + "\n".join(offenders)



PARALLEL_SCRIPT = r"""
import dataclasses, json, os, time
from pathlib import Path
from nq.kernels import build, cache_files
build._environment = lambda: {"nq": "0", "numba-cuda": "0.30", "cc": [9, 0], "driver": [13, 0]}
from nq.kernels import fill
from nq.kernels.int4 import retile

# what parallel_compiles collects (its exit would load the entries: that needs a GPU)
build._BATCH = jobs = []
kernels = [retile.compile_retile_rows(), retile.compile_retile_mma(), *fill.fill_kernels()]
build._BATCH = None
print("deferred", len(jobs), "still empty", sum(not k.overloads for k in kernels))
t = time.perf_counter()
failed = build._compile_in_children(jobs, 2)
print("parallel_s", time.perf_counter() - t, "failed", failed)
n, procs, wall, first, (slow, slow_s), total = build.STATS.batches[-1]
costs = cache_files.read_costs()
print("batch", n, procs, sorted(costs) == sorted(j.name for j in jobs),
      slow in costs and costs[slow] == max(costs.values()), 0 < slow_s <= wall, 0 <= first < wall)

# the same jobs compiled one after another in this process, into another folder
serial = Path(os.environ["NQ_CACHE"]) / "serial"
build._child_init((9, 0))
build._CHILD_JOBS = [dataclasses.replace(j, path=serial / j.path.name) for j in jobs]
t = time.perf_counter()
errors = [build._child_compile(i)[0] for i in range(len(jobs))]
print("serial_s", time.perf_counter() - t, "errors", errors)
def same_code(a, b):
    # the entry symbol carries numba's count of functions defined so far in the process
    # (...B2v1B... vs ...B2v3B...): the code is compared with the symbol masked
    ea, eb = a[0]["entry"].encode(), b[0]["entry"].encode()
    masked = a[1].replace(ea, b"E" * len(ea)), b[1].replace(eb, b"E" * len(eb))
    return len(ea) == len(eb) and masked[0] == masked[1]


out = {}
skip = ("created", "entry", "sha256")
for j in jobs:
    a, b = build.read_entry(j.path, j.key), build.read_entry(serial / j.path.name, j.key)
    out[j.name] = [a is not None, b is not None, a is not None and b is not None and same_code(a, b),
                   a is not None and b is not None and
                   {k: v for k, v in a[0].items() if k not in skip} ==
                   {k: v for k, v in b[0].items() if k not in skip}]
print("RESULT", json.dumps(out))
"""


def test_a_batch_hands_out_the_slowest_kernels_first(env):
    names = ["gemv_a", "prefill_attn_wgmma_x", "fill_u32", "gemm_wgmma_b", "gemm_c"]
    # nothing remembered: the first guesses by family, the rest in the given order
    assert cache_files.longest_first(names) == [1, 0, 3, 4, 2]
    # remembered costs win, and an unknown name takes its family's largest known cost
    costs = {"gemv_a": 0.5, "gemm_c": 9.0, "fill_u32": 0.2, "gemv_z": 7.0}
    assert cache_files.longest_first(names, costs) == [4, 1, 3, 0, 2]
    cache_files.remember_costs({"gemm_c": 9.0})
    cache_files.remember_costs({"fill_u32": 0.25})                 # merged, not replaced
    assert cache_files.read_costs() == {"gemm_c": 9.0, "fill_u32": 0.25}
    assert cache_files.longest_first(names)[0] == 4
    size = cache_files.costs_path().stat().st_size
    assert cache_files.clear_cache() == (1, size) and not cache_files.costs_path().exists()
    cache_files.costs_path().write_text("{not json")               # a torn file: order hint lost
    assert cache_files.read_costs() == {}


def test_parallel_compiles_store_the_entries_a_serial_compile_stores(tmp_path):
    """build.parallel_compiles' children (forked, offline sm_90 compiles: no GPU here) leave
    the same cache entries -- key, inputs, cc, size, and the cubin's bytes but for the entry
    symbol's numba counter -- as compiling one by one."""
    import sys
    env = dict(os.environ, NQ_CACHE=str(tmp_path), NQ_NO_KERNEL_CACHE="0")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, "-c", PARALLEL_SCRIPT], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert "deferred 4 still empty 4" in lines, r.stdout
    assert "batch 4 2 True True True True" in lines, r.stdout   # timings kept, costs remembered
    assert "failed []" in r.stdout and "errors ['', '', '', '']" in r.stdout, r.stdout
    result = json.loads(next(line for line in lines if line.startswith("RESULT"))[7:])
    assert len(result) == 4
    for name, (parallel, serial, same_cubin, same_header) in result.items():
        assert parallel and serial and same_cubin and same_header, (name, r.stdout)
