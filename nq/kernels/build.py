"""The one way a kernel is specialised, named and compiled, and the on-disk kernel cache.

Every kernel family builds a plain Python kernel body from a factory whose arguments are the
kernel's baked-in constants (shape, tiling, eps, ...); numba freezes closure ints and floats
as compile-time constants, which is how one source serves every model size.  The factory
hands the body here:

    kernel = compile_kernel(body, sig, name, launch_bounds=(256,), fastmath=True)

`name` must encode every constant the factory baked in (it names the kernel in profiles and
launcher errors); `kernel_name` builds one from readable parts.  Under the CUDA simulator the
body is returned as a simulator kernel (no signature, no options: the simulator takes none).
Factories stay cached with functools.cache on their arguments, so a kernel is built once per
process.

The cache.  Compiling (NVVM, then nvJitLink) costs ~0.1-2 s a kernel and a 7B step has ~45
kernels, so every start used to spend most of its time here.  A compiled kernel is its cubin:
after the first compile, the cubin is stored under `$NQ_CACHE/kernels/` (default
~/.cache/nq/kernels) and later starts load it into a numba dispatcher without calling NVVM.
The entry's key is a hash of everything that changes the code: the kernel's name, signature
and options, the values its body closes over, the source of every module under nq/kernels,
nq/ptx and the modules they read (config, paged, ref), nq's version, numba-cuda's version,
the compute capability and the driver's CUDA version.  An entry is a small JSON header (the
key's inputs, the entry symbol, the cubin's sha256) followed by the cubin; one whose header,
key or checksum does not match is deleted and rebuilt, never loaded.  Entries are written to a
temporary file and renamed into place, so two processes starting at once cannot leave a torn
entry.  No pickle: the cubin is rebuilt into numba's kernel object field by field.
`NQ_NO_KERNEL_CACHE=1` turns the cache off; `nq cache info` / `nq cache clear` list and empty it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import sys
import time
import warnings
from pathlib import Path

from numba import cuda  # a module global: the simulator swaps it for its fake module

from nq.kernels import cache_files
from nq.kernels.cache_files import entry_path, read_entry, write_entry
from nq.ptx import SIMULATOR

OPTIONS = ("launch_bounds", "fastmath", "lineinfo")


def _part(v) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float):
        return f"{v:g}".replace("-", "m").replace("+", "").replace(".", "p")
    return str(v)


def kernel_name(family: str, **constants) -> str:
    """`family_key1v1_key2v2...`: a readable identifier that encodes every baked-in constant
    (floats as 1e-06 -> 1em06, booleans as 0/1), in the order given."""
    return "_".join([family] + [f"{k}{_part(v)}" for k, v in constants.items()])


# ---- what this process compiled or loaded (nq generate --verbose) --------------------------

@dataclasses.dataclass
class BuildStats:
    compiled: int = 0
    loaded: int = 0
    compile_s: float = 0.0
    load_s: float = 0.0
    rebuilt: int = 0      # entries found stale or corrupt, deleted and compiled again
    parallel_s: float = 0.0   # wall time of compile batches in child processes
    # each batch compiled in child processes: (kernels, processes, wall s, s until the first
    # child began compiling, (slowest kernel's name, its s), sum of the children's s)
    batches: list = dataclasses.field(default_factory=list)
    # every kernel asked for, by name, in order (compiled, loaded or left to a batch): nq bench
    # writes them into its JSON, so a figure names the exact kernels that made it
    names: list = dataclasses.field(default_factory=list)


STATS = BuildStats()


# ---- the cache's location and key ----------------------------------------------------------

def cache_enabled() -> bool:
    return not SIMULATOR and os.environ.get("NQ_NO_KERNEL_CACHE", "") in ("", "0")


@functools.cache
def source_digest() -> str:
    """sha256 over the source of every module a kernel's code can depend on."""
    root = Path(__file__).resolve().parent.parent          # the nq package
    files = sorted([*(root / "kernels").rglob("*.py"), *(root / "ptx").rglob("*.py"),
                    root / "config.py", root / "paged.py", root / "ref.py",
                    root / "loader" / "quant.py"])
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _closure_values(body) -> dict:
    """The constants a body closes over (the factory's specialisation), name -> repr; device
    functions are named by their qualified name (their own source is in source_digest)."""
    out = {}
    for name, cell in zip(body.__code__.co_freevars, body.__closure__ or ()):
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            out[name] = "<empty>"
            continue
        if isinstance(v, (int, float, bool, str, bytes, tuple, type(None))):
            out[name] = repr(v)
        else:
            py = getattr(v, "py_func", v)
            out[name] = f"{type(v).__name__}:{getattr(py, '__qualname__', '?')}"
    return out


@functools.cache
def _environment() -> dict:
    from importlib import metadata

    import nq
    env = {"nq": nq.__version__, "python": sys.version.split()[0]}
    for dist in ("numba-cuda", "numba", "llvmlite"):
        try:
            env[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            env[dist] = "?"
    dev = cuda.get_current_device()
    env["cc"] = list(dev.compute_capability)
    env["device"] = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    env["driver"] = list(cuda.cudadrv.driver.driver.get_version())
    return env


def cache_key(body, sig: str, name: str, options: dict) -> tuple[str, dict]:
    """(hex key, the inputs it hashes) of one kernel."""
    inputs = {"name": name, "sig": sig, "options": {k: repr(v) for k, v in sorted(options.items())},
              "closure": _closure_values(body), "source": source_digest(), "env": _environment()}
    blob = json.dumps(inputs, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest(), inputs


# ---- entries (their file format: cache_files.py) -----------------------------------------------

def _store(kernel, key: str, inputs: dict, path: Path) -> None:
    lib = kernel._codelibrary
    if lib._linking_files or lib.needs_cudadevrt or kernel.cooperative:
        return  # links other files or libraries at load: not cacheable as one cubin
    (cc, cubin), = lib._cubin_cache.items()
    cubin = getattr(cubin, "code", cubin)  # cuda.core's ObjectCode holds the bytes in .code
    if not isinstance(cubin, (bytes, bytearray, memoryview)):
        return  # an object this numba-cuda keeps in another form: compile every start
    header = {"key": key, "inputs": inputs, "entry": kernel.entry_name, "cc": list(cc),
              "sha256": hashlib.sha256(cubin).hexdigest(), "bytes": len(cubin),
              "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:
        write_entry(path, header, bytes(cubin))
    except OSError as e:  # a read-only or full cache directory must not stop the engine
        print(f"nq: kernel cache: could not write {path}: {e}", file=sys.stderr)


def _load(disp, argtypes, header: dict, cubin: bytes, name: str, options: dict) -> None:
    """Rebuild numba's kernel object from a cubin and bind it to the dispatcher."""
    from numba.core import types, typing
    from numba.cuda.codegen import CUDACodeLibrary
    from numba.cuda.dispatcher import _Kernel

    cc = tuple(header["cc"])
    try:  # numba-cuda on cuda.core keeps cubins as ObjectCode (what get_cufunc loads)
        from cuda.core import ObjectCode
    except ImportError:
        from cuda.core.experimental import ObjectCode
    cubin = ObjectCode.from_cubin(bytes(cubin))
    lib = CUDACodeLibrary._rebuild(
        codegen=None, name=name, entry_name=header["entry"], llvm_strs=[], ptx_cache={},
        cubin_cache={cc: cubin}, linkerinfo_cache={}, max_registers=None, nvvm_options={},
        needs_cudadevrt=False, nrt=False, use_cooperative=False, lto=True)
    kernel = _Kernel._rebuild(
        cooperative=False, name=header["entry"], signature=typing.signature(types.none, *argtypes),
        codelibrary=lib, debug=False, lineinfo=bool(options.get("lineinfo", False)),
        call_helper=None, extensions=[], shared_memory_carveout=None,
        launch_config_sensitive=False)
    kernel._codelibrary.get_cufunc()  # load the module now: a bad cubin fails here, not at launch
    disp.add_overload(kernel, argtypes)
    _apply_smem(disp)


def _apply_smem(disp) -> None:
    """Opt-ins (common.allow_smem) asked for while the kernel was still being compiled."""
    nbytes = getattr(disp, "nq_smem_bytes", 0)
    if nbytes:
        from nq.kernels.common import allow_smem
        allow_smem(disp, nbytes)


# ---- the compile path ----------------------------------------------------------------------

def in_cache(body, sig: str, name: str, **options) -> bool:
    """True when compile_kernel(body, sig, name, **options) would load a valid cache entry
    (its key matches and its checksum holds) rather than compile: what a start may leave to
    the first launch that needs the kernel.  False with the cache off or under the simulator."""
    if SIMULATOR or not cache_enabled():
        return False
    key, _ = cache_key(body, sig, name, options)
    path = entry_path(key, name)
    return path.exists() and read_entry(path, key) is not None


def compile_kernel(body, sig: str, name: str, **options):
    """The kernel named `name`, compiled for sig (or loaded from the kernel cache); options:
    launch_bounds, fastmath, lineinfo (numba.cuda.jit's)."""
    bad = set(options) - set(OPTIONS)
    if bad:
        raise TypeError(f"compile_kernel: unknown options {sorted(bad)}; allowed {OPTIONS}")
    body.__name__ = body.__qualname__ = name
    STATS.names.append(name)
    if SIMULATOR:
        return cuda.jit(body)
    from numba.core import sigutils
    disp = cuda.jit(**options)(body)       # lazy: nothing is compiled yet
    argtypes, _ = sigutils.normalize_signature(sig)
    if cache_enabled():
        t0 = time.perf_counter()
        key, inputs = cache_key(body, sig, name, options)
        path = entry_path(key, name)
        entry = read_entry(path, key) if path.exists() else None
        if entry is not None:
            try:
                _load(disp, argtypes, *entry, name, options)
                STATS.loaded += 1
                STATS.load_s += time.perf_counter() - t0
                return _specialise(disp)
            except Exception as e:  # noqa: BLE001 -- any failure to load means: rebuild
                print(f"nq: kernel cache: {path.name} did not load ({e}); compiling it again",
                      file=sys.stderr)
                disp = cuda.jit(**options)(body)
        if path.exists():
            STATS.rebuilt += 1
            path.unlink(missing_ok=True)
        if _BATCH is not None:      # compiled with the batch's other misses, at its end
            _BATCH.append(_Job(disp, body, sig, name, options, argtypes, key, inputs, path))
            return disp
    _compile_here(disp, sig, name)
    if cache_enabled():
        _store(disp.overloads[argtypes], key, inputs, path)
    return _specialise(disp)


def _compile_here(disp, sig: str, name: str) -> None:
    t0 = time.perf_counter()
    _progress(f"compiling kernel {STATS.compiled + 1}: {name}")
    disp.compile(sig)
    STATS.compiled += 1
    STATS.compile_s += time.perf_counter() - t0


def _progress(text: str) -> None:
    """One status line on stderr while kernels compile (a first start is otherwise ~20 s of
    silence): rewritten in place on a terminal, absent otherwise."""
    if sys.stderr.isatty():
        sys.stderr.write(f"\rnq: {text[:100]:100s} (cached after the first start)\r")
        sys.stderr.flush()


def _specialise(disp):
    """What `cuda.jit(sig)` does after compiling: one signature, launches skip type dispatch,
    and a call with other argument types is refused instead of compiling a second kernel."""
    disp._specialized = True
    disp.disable_compile()
    return disp


# ---- compiling a batch of misses in parallel processes --------------------------------------
#
# NVVM runs under numba's compiler lock, so threads compile one kernel at a time.  Inside
# `parallel_compiles()` a kernel that is not in the cache is not compiled at once: compile_kernel
# hands back its dispatcher still empty, and at the block's end the misses are compiled by
# forked processes (numba's objects and the kernel bodies are inherited; nothing is pickled),
# each compiling the cubin for this device's cc offline (NVVM and nvJitLink run on the CPU; the
# child never touches the CUDA driver) and storing it as a cache entry.  The parent then loads
# every entry as on a warm start.  A miss a child could not compile is compiled here, so a
# failed child costs time, never a kernel.  Only what the kernels' users do before their first
# launch may happen inside the block: they get the dispatcher, and `common.allow_smem` is
# remembered on it and applied when it is loaded.  `NQ_COMPILE_WORKERS=1` compiles in this
# process instead (0 or unset: min(16, CPUs)).

@dataclasses.dataclass
class _Job:
    disp: object
    body: object
    sig: str
    name: str
    options: dict
    argtypes: tuple
    key: str
    inputs: dict
    path: Path


_BATCH: list | None = None      # the open batch's jobs


def compile_workers() -> int:
    raw = os.environ.get("NQ_COMPILE_WORKERS", "").strip()
    if raw not in ("", "0"):
        try:
            return max(1, int(raw))
        except ValueError:
            raise ValueError(f"NQ_COMPILE_WORKERS={raw!r}: give a number of processes "
                             "(1: compile in this process)") from None
    return max(1, min(16, os.cpu_count() or 1))


@contextlib.contextmanager
def parallel_compiles(workers: int | None = None):
    """Compile the kernels requested inside the block that miss the cache in up to `workers`
    processes at its end (module comment above); nested blocks join the outer one."""
    global _BATCH
    if _BATCH is not None or SIMULATOR or not cache_enabled():
        yield
        return
    _BATCH = jobs = []
    try:
        yield
    finally:
        _BATCH = None
    finish_batch(jobs, compile_workers() if workers is None else workers)


def finish_batch(jobs: list, workers: int) -> None:
    """Compile jobs' kernels (in `workers` forked processes when more than one), load them."""
    todo = [j for j in jobs if j.argtypes not in j.disp.overloads]
    todo = [todo[i] for i in cache_files.longest_first([j.name for j in todo])]
    if workers > 1 and len(todo) > 1:
        t0 = time.perf_counter()
        _progress(f"compiling {len(todo)} kernels in {min(workers, len(todo))} processes")
        failed = _compile_in_children(todo, min(workers, len(todo)))
        for name, err in failed:
            print(f"nq: kernel cache: a compile process failed on {name} ({err}); compiling "
                  "it here", file=sys.stderr)
        STATS.parallel_s += time.perf_counter() - t0
    for j in jobs:
        entry = None
        if j.argtypes not in j.disp.overloads:   # (a launch inside the block compiled it)
            entry = read_entry(j.path, j.key) if j.path.exists() else None
        if entry is not None:
            try:
                _load(j.disp, j.argtypes, *entry, j.name, j.options)
                STATS.compiled += 1              # compiled by this start, in a child
            except Exception as e:  # noqa: BLE001 -- a child's cubin that does not load
                print(f"nq: kernel cache: {j.path.name} from a compile process did not load "
                      f"({e}); compiling it here", file=sys.stderr)
                j.path.unlink(missing_ok=True)
                entry = None
        if entry is None:
            if j.argtypes not in j.disp.overloads:
                _compile_here(j.disp, j.sig, j.name)
            _store(j.disp.overloads[j.argtypes], j.key, j.inputs, j.path)
            _apply_smem(j.disp)
        _specialise(j.disp)


_CHILD_JOBS: list = []


def _compile_in_children(jobs: list, workers: int) -> list[tuple[str, str]]:
    """Fork `workers` processes that compile jobs into the cache; [(name, error)] of the jobs
    they did not store (a crashed child included: the parent compiles those itself)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool
    global _CHILD_JOBS
    _CHILD_JOBS = jobs            # inherited by the fork: the bodies are never pickled
    cc = tuple(_environment()["cc"])   # the children answer numba's device lookups with it
    errors, spans, t0 = {}, {}, time.time()
    for f in (sys.stdout, sys.stderr):  # a child flushes what it inherited when it exits
        f.flush()
    try:
        with warnings.catch_warnings():
            # Python 3.12 warns on forking a threaded process (the weight upload's thread): the
            # children run only NVVM, nvJitLink and file writes, no lock another thread holds
            warnings.simplefilter("ignore", DeprecationWarning)
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                     initializer=_child_init, initargs=(cc,)) as pool:
                futures = [pool.submit(_child_compile, i) for i in range(len(jobs))]
                for i, f in enumerate(futures):
                    try:
                        errors[i], *spans[i] = f.result()
                    except BrokenProcessPool as e:
                        errors[i] = f"the compile process died ({e})"
    except OSError as e:          # no fork here: the parent compiles them
        return [(j.name, f"{e}") for j in jobs]
    finally:
        _CHILD_JOBS = []
    if spans:
        took = {jobs[i].name: b - a for i, (a, b) in spans.items()}
        slowest = max(took, key=took.get)
        STATS.batches.append((len(jobs), workers, time.time() - t0,
                              min(a for a, _ in spans.values()) - t0,
                              (slowest, took[slowest]), sum(took.values())))
        cache_files.remember_costs(took)
    return [(jobs[i].name, err) for i, err in errors.items() if err]


def _child_init(cc) -> None:
    import signal
    import types

    import numba.cuda.dispatcher as dispatcher
    from numba.cuda.codegen import CUDACodeLibrary
    # Ctrl-C reaches the whole process group: the parent handles it (and stops the pool)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    dev = types.SimpleNamespace(compute_capability=cc, id=0, name=b"nq compile process")
    full = (cc[0], cc[1], "a" if tuple(cc) >= (9, 0) else "")   # numba's cubin key for cc
    dispatcher.get_current_device = lambda: dev
    CUDACodeLibrary._ensure_cc = lambda self, c: full if c is None else c


def _child_compile(i: int) -> tuple[str, float, float]:
    """Compile job i's cubin and store it: ('' on success, else the error (the parent
    retries), wall-clock start, end)."""
    from numba.cuda.dispatcher import _Kernel
    t0 = time.time()
    j = _CHILD_JOBS[i]
    try:
        kernel = _Kernel(j.body, j.argtypes, **j.disp.targetoptions)
        kernel._codelibrary.get_cubin()
        _store(kernel, j.key, j.inputs, j.path)
        return ("" if j.path.exists() else "not cacheable"), t0, time.time()
    except Exception as e:  # noqa: BLE001 -- reported to the parent, which compiles it itself
        return f"{type(e).__name__}: {e}"[:300], t0, time.time()
