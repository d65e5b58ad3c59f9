"""What a GPU start (`nq generate`, `nq chat`, `nq serve`) does beside the main thread.

Before the first kernel can load, two slow things must happen: numba's import (~0.3-0.5 s of
Python, holding the GIL) and the CUDA driver's cuInit plus the device's primary context
(~0.3-0.5 s inside libcuda, holding no GIL).  numba does the second only after the first, on
the thread that imported it.  So two threads start as soon as the arguments are parsed, while
the main thread opens the file and tokenizes the prompt:

    driver   cuInit(0), cuDeviceGet(0), cuDevicePrimaryCtxRetain, straight from libcuda.so.1
             through ctypes (which lets go of the GIL for each call): the driver works while
             the other two threads run Python
    imports  numba (its cuInit and context lookup are then cheap: numba-cuda makes the
             device's *primary* context current, cuda.core's Device.set_current ->
             cuDevicePrimaryCtxRetain, and it already exists), the kernel cache's key inputs,
             and the modules the engine imports as it is built (~0.1 s)

`wait()` (make_backend calls it) joins both before numba is used on the main thread, so two
threads never import the same modules at once past that point.  Each thread books its time
on the timeline as a part beside the main thread (`nq generate --verbose`).

Harmless without a GPU: no libcuda.so.1, a cuInit error or no device is swallowed here, and
numba's own initialisation then meets the same failure and make_backend reports it as before.
The context retained here is never released: numba uses that same context, and a release
that dropped its count to zero would destroy it under numba (process exit tears it down).
NQ_DRIVER_THREAD=0 leaves the driver to numba, as before this module: for measuring it.
"""
from __future__ import annotations

import os
import threading
import time

DRIVER_PART = "CUDA driver init, cuInit + primary context (thread)"
IMPORTS_PART = "numba import (thread)"
ENGINE_PART = "CUDA context (numba), engine imports (thread)"

# the modules Engine.from_file imports as it builds, imported by the thread beforehand
ENGINE_MODULES = ("nq.runtime.engine", "nq.runtime.weights", "nq.runtime.prefill",
                  "nq.runtime.staging", "nq.kernels.int4", "nq.kernels.attention",
                  "nq.kernels.rows", "nq.kernels.embed", "nq.kernels.feed",
                  "nq.kernels.lm_head", "nq.kernels.rope_kv", "nq.kernels.sampling")

_RETAINED: list = []        # [(libcuda, context handle)] once retained: kept for the process
_THREADS: list[threading.Thread] = []


def init_driver(load=None) -> float | None:
    """cuInit(0) and device 0's primary context, retained for good; the seconds it took, or
    None when there is no driver, no device or any error (nothing is raised).  `load`: how
    libcuda is opened (ctypes.CDLL; tests pass fakes)."""
    t = time.perf_counter()
    try:
        import ctypes
        lib = (load or ctypes.CDLL)("libcuda.so.1")
        dev, ctx = ctypes.c_int(0), ctypes.c_void_p(0)
        # each returns a CUresult, 0 = CUDA_SUCCESS
        if lib.cuInit(0) != 0 or lib.cuDeviceGet(ctypes.byref(dev), 0) != 0:
            return None
        if lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:
            return None
        _RETAINED.append((lib, ctx))
    except Exception:  # noqa: BLE001 -- no libcuda, a broken one: numba's init says what
        return None
    return time.perf_counter() - t


def import_numba_and_engine(timeline=None) -> None:
    """numba's import, its CUDA context, the kernel cache's key inputs and the engine's
    modules; every error is left for make_backend to report (a renamed module here costs only
    its import time later)."""
    try:
        t = time.perf_counter()
        from numba import cuda
        if timeline is not None:
            timeline.aside(IMPORTS_PART, time.perf_counter() - t)
        t = time.perf_counter()
        if cuda.is_available():
            cuda.current_context()
            from nq.kernels import build
            build.source_digest()
            build._environment()
            import importlib
            for name in ENGINE_MODULES:
                importlib.import_module(name)
            if timeline is not None:
                timeline.aside(ENGINE_PART, time.perf_counter() - t)
    except Exception:  # noqa: BLE001
        pass


def driver_thread_wanted() -> bool:
    """False where numba will not use the driver (NUMBA_DISABLE_CUDA, the simulator) or
    NQ_DRIVER_THREAD=0 asks numba to start it, as before this module."""
    return all(os.environ.get(k, d).strip() in ("", "0") for k, d in (
        ("NUMBA_DISABLE_CUDA", "0"), ("NUMBA_ENABLE_CUDASIM", "0"))) and \
        os.environ.get("NQ_DRIVER_THREAD", "1").strip() != "0"


def start(timeline=None) -> None:
    """Start the driver's thread and the imports' thread (module docstring); returns at once."""
    if _THREADS:
        return

    def driver() -> None:
        sec = init_driver()
        if sec is not None and timeline is not None:
            timeline.aside(DRIVER_PART, sec)

    if driver_thread_wanted():
        _THREADS.append(threading.Thread(target=driver, name="nq-cuda-driver", daemon=True))
    _THREADS.append(threading.Thread(target=import_numba_and_engine, args=(timeline,),
                                     name="nq-gpu-imports", daemon=True))
    for t in _THREADS:
        t.start()


def wait() -> bool:
    """Join the threads `start` began (none: returns at once); True if there were any."""
    for t in _THREADS:
        t.join()
    return bool(_THREADS)
