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

Once the context is retained, `nq generate` starts the weights' upload on a third thread, before
numba is in (nq/runtime/preload.py); `LibCuda` is the few driver calls it makes through ctypes.
"""
from __future__ import annotations

import ctypes
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
_DRIVER: list[threading.Thread] = []     # the driver's thread, for `retained()` to join


def signatures() -> dict:
    """The C argument types of the calls made through ctypes: ctypes would pass a Python int as
    a 32-bit int, so a 64-bit pointer must be declared.  The _v2 names are what cuda.h's macros
    call (`cuMemAlloc` without it is the 32-bit pointer API of CUDA 3.1)."""
    P, U64, SIZE, ptr = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER
    return {"cuCtxSetCurrent": (P,), "cuMemGetInfo_v2": (ptr(SIZE), ptr(SIZE)),
            "cuMemAlloc_v2": (ptr(U64), SIZE), "cuMemFree_v2": (U64,),
            "cuMemHostAlloc": (ptr(P), SIZE, ctypes.c_uint), "cuMemFreeHost": (P,),
            "cuMemcpyHtoDAsync_v2": (U64, P, SIZE, P),
            "cuStreamCreate": (ptr(P), ctypes.c_uint), "cuStreamSynchronize": (P,),
            "cuStreamDestroy_v2": (P,), "cuEventCreate": (ptr(P), ctypes.c_uint),
            "cuEventRecord": (P, P), "cuEventSynchronize": (P,), "cuEventDestroy_v2": (P,),
            "cuGetErrorName": (ctypes.c_int, ptr(ctypes.c_char_p))}


class LibCuda:
    """libcuda.so.1's calls by name, through ctypes with their C signatures; a call that does
    not return CUDA_SUCCESS raises RuntimeError naming the call and the error.  For the work
    done before numba is imported (nq/runtime/preload.py); numba's own bindings do the rest."""

    def __init__(self, lib):
        self.lib = lib
        for name, args in signatures().items():
            try:
                getattr(lib, name).argtypes = args
            except AttributeError:   # a test's fake library: plain Python methods
                pass

    def __call__(self, name: str, *args) -> None:
        r = getattr(self.lib, name)(*args)
        if r != 0:
            raise RuntimeError(f"{name} failed: {self.error_name(r)} ({r})")

    def error_name(self, r: int) -> str:
        s = ctypes.c_char_p()
        try:
            if self.lib.cuGetErrorName(r, ctypes.byref(s)) == 0 and s.value:
                return s.value.decode()
        except Exception:  # noqa: BLE001 -- the number alone still says what failed
            pass
        return "CUDA error"


def init_driver(load=None) -> float | None:
    """cuInit(0) and device 0's primary context, retained for good; the seconds it took, or
    None when there is no driver, no device or any error (nothing is raised).  `load`: how
    libcuda is opened (ctypes.CDLL; tests pass fakes)."""
    t = time.perf_counter()
    try:
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
        _DRIVER.append(threading.Thread(target=driver, name="nq-cuda-driver", daemon=True))
        _THREADS.append(_DRIVER[0])
    _THREADS.append(threading.Thread(target=import_numba_and_engine, args=(timeline,),
                                     name="nq-gpu-imports", daemon=True))
    for t in _THREADS:
        t.start()


def wait() -> bool:
    """Join the threads `start` began (none: returns at once); True if there were any."""
    for t in _THREADS:
        t.join()
    return bool(_THREADS)


def retained():
    """(LibCuda, primary context handle) once the driver's thread has retained the context
    (it is joined first), or None: no driver thread, no GPU, or its start failed."""
    for t in _DRIVER:
        t.join()
    if not _RETAINED:
        return None
    lib, ctx = _RETAINED[0]
    return LibCuda(lib), ctx
