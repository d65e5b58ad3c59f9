"""File bytes to device memory through a ring of pinned staging buffers, filled by reader threads.

Why.  `cuda.to_device` of a view of the mmapped .nanoqwen is a pageable copy: the driver copies
through its own small pinned buffer, one thread, and every 4 KiB page of the mapping is faulted
in on first touch.  Measured on the H200 (2026-12-01, the 4.46 GB 7B file in the page cache):
0.95-1.4 s, 3.2-4.7 GB/s, against PCIe Gen5's ~50 GB/s for pinned host memory.  Here `readers` threads
`preadv` the file's byte ranges (page cache -> user memory, ~5-10 GB/s a thread, the GIL
released) into `buffers` pinned buffers of `chunk` bytes, and the calling thread enqueues one
`cuMemcpyHtoDAsync` a filled buffer on its stream, recording an event per buffer; a buffer is
refilled only once its event says its copy left it.  Predicted: host memory bandwidth bound,
~15-25 GB/s with 4 readers.  Measured there (scripts/start_probe.py): a reader copies only
~1.4-4.3 GB/s out of the page cache, so the readers are what scale it: 4 readers 12.1 GB/s,
8 readers 21.0 GB/s (0.26 s for the 5.55 GB file); READERS is 8 where there are 8 CPUs.

The ring runs on any `device` with five operations (so the CPU tests drive it with a fake one
whose copies run late, which catches a buffer reused too early):

    alloc(nbytes) -> (writable memoryview, handle)     free(handle)
    copy(dst, handle, nbytes)   record(b)   wait(b)    enqueue(fn)    finish()

`enqueue(fn)` runs fn in stream order (the re-tiling kernel launch after its copies).
`CudaDevice` is numba's stream through cuda.bindings; `DriverDevice` a stream of its own through
ctypes, for the upload that starts before numba is imported (nq/runtime/preload.py).
"""
from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor

CHUNK = 16 << 20        # bytes a buffer: ~0.3 ms of PCIe, ~2 ms of one reader
BUFFERS = 8             # pinned: 128 MB, allocated once an upload
READERS = min(8, os.cpu_count() or 1)   # H200 host, upload alone (scripts/start_probe.py,
# 2026-12-01): 1 reader 4.3 GB/s, 2 8.8, 4 12.1, 8 21.0 (16 MB x 8 buffers)


@dataclasses.dataclass(frozen=True)
class Copy:
    offset: int         # in the file
    nbytes: int
    dst: int            # device address (an offset into the fake device's memory in tests)


def pieces(items, chunk: int):
    """Split each Copy into chunk-sized pieces; callables pass through in order."""
    for it in items:
        if callable(it):
            yield it
            continue
        for at in range(0, it.nbytes, chunk):
            n = min(chunk, it.nbytes - at)
            yield Copy(it.offset + at, n, it.dst + at)


def run(path, items, device, chunk: int | None = None, buffers: int | None = None,
        readers: int | None = None) -> int:
    """Copy every `Copy` of items from the file at path to the device, and enqueue every
    callable item after the copies listed before it; returns the bytes copied.  The copies
    are complete only once the device's stream is (`device.finish()` is called here).
    chunk, buffers, readers: the module's CHUNK, BUFFERS, READERS unless given."""
    chunk, buffers = chunk or CHUNK, buffers or BUFFERS
    readers = readers or READERS
    if buffers < 2:
        raise ValueError(f"staging.run: {buffers} buffers; the ring needs at least 2")
    seq = list(pieces(items, chunk))
    copies = [p for p in seq if not callable(p)]
    if not copies:
        for p in seq:
            device.enqueue(p)
        device.finish()
        return 0
    size = min(chunk, max(p.nbytes for p in copies))
    bufs = [device.alloc(size) for _ in range(min(buffers, len(copies)))]
    k = len(bufs)
    fd = os.open(path, os.O_RDONLY)
    pool = ThreadPoolExecutor(max_workers=max(1, readers), thread_name_prefix="nq-read")

    def read(j: int) -> None:
        p = copies[j]
        view = bufs[j % k][0]
        got = 0
        while got < p.nbytes:
            r = os.preadv(fd, [view[got:p.nbytes]], p.offset + got)
            if r <= 0:
                raise ValueError(f"{path}: ended at byte {p.offset + got}, expected "
                               f"{p.offset + p.nbytes}; the file changed while it was read")
            got += r

    finished = False
    try:
        futures = {j: pool.submit(read, j) for j in range(k)}
        j = 0
        for p in seq:
            if callable(p):
                device.enqueue(p)
                continue
            futures.pop(j).result()
            device.copy(p.dst, bufs[j % k][1], p.nbytes)
            device.record(j % k)
            # the previous piece's copy has had a read's time to run: its buffer takes the
            # piece k ahead of it (waiting on the one just queued would serialise the ring)
            if j >= 1 and j - 1 + k < len(copies):
                device.wait((j - 1) % k)
                futures[j - 1 + k] = pool.submit(read, j - 1 + k)
            j += 1
        device.finish()
        finished = True
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        os.close(fd)
        if not finished:        # an error: no queued copy may still read a buffer freed here
            try:
                device.finish()
            except Exception:   # noqa: BLE001 -- the first error is the one to report
                pass
        for _, handle in bufs:
            device.free(handle)
    return sum(p.nbytes for p in copies)


class CudaDevice:
    """The ring's device on a CUDA stream, through cuda.bindings (the context must be current
    on the calling thread: numba's `cuda.current_context()` makes it so)."""

    def __init__(self, stream):
        from cuda.bindings import driver as cu

        from nq.runtime.graphs import _check, stream_handle
        self.cu, self.check, self.h = cu, _check, stream_handle(stream)
        self.events = {}

    def alloc(self, nbytes: int):
        import ctypes
        ptr = int(self.check(self.cu.cuMemHostAlloc(nbytes, 0)))
        return memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B"), ptr

    def free(self, ptr: int) -> None:
        self.cu.cuMemFreeHost(ptr)

    def copy(self, dst: int, ptr: int, nbytes: int) -> None:
        self.check(self.cu.cuMemcpyHtoDAsync(dst, ptr, nbytes, self.h))

    def record(self, b: int) -> None:
        if b not in self.events:
            flags = int(self.cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
            self.events[b] = self.check(self.cu.cuEventCreate(flags))
        self.check(self.cu.cuEventRecord(self.events[b], self.h))

    def wait(self, b: int) -> None:
        self.check(self.cu.cuEventSynchronize(self.events[b]))

    def enqueue(self, fn) -> None:
        fn()

    def finish(self) -> None:
        self.check(self.cu.cuStreamSynchronize(self.h))
        for ev in self.events.values():
            self.cu.cuEventDestroy(ev)
        self.events.clear()


class DriverDevice:
    """The ring's device through libcuda by ctypes (nq/gpu_start.LibCuda), on a stream of its
    own: the upload that runs while numba imports (nq/runtime/preload.py).  The stream is
    non-blocking, so the main thread's work on the legacy default stream never waits for these
    copies.  The context must be current on the calling thread (cuCtxSetCurrent)."""

    def __init__(self, cu):
        import ctypes
        self.cu, self.c = cu, ctypes
        self.h = ctypes.c_void_p()
        cu("cuStreamCreate", ctypes.byref(self.h), 1)      # 1: CU_STREAM_NON_BLOCKING
        self.events = {}

    def alloc(self, nbytes: int):
        c = self.c
        p = c.c_void_p()
        self.cu("cuMemHostAlloc", c.byref(p), nbytes, 0)
        return memoryview((c.c_char * nbytes).from_address(p.value)).cast("B"), p.value

    def free(self, ptr: int) -> None:
        self.cu.lib.cuMemFreeHost(self.c.c_void_p(ptr))    # unchecked, as CudaDevice.free

    def copy(self, dst: int, ptr: int, nbytes: int) -> None:
        self.cu("cuMemcpyHtoDAsync_v2", dst, ptr, nbytes, self.h)

    def record(self, b: int) -> None:
        if b not in self.events:
            ev = self.c.c_void_p()
            self.cu("cuEventCreate", self.c.byref(ev), 2)  # 2: CU_EVENT_DISABLE_TIMING
            self.events[b] = ev
        self.cu("cuEventRecord", self.events[b], self.h)

    def wait(self, b: int) -> None:
        self.cu("cuEventSynchronize", self.events[b])

    def enqueue(self, fn) -> None:
        fn()

    def finish(self) -> None:
        self.cu("cuStreamSynchronize", self.h)
        for ev in self.events.values():
            self.cu.lib.cuEventDestroy_v2(ev)
        self.events.clear()

    def close(self) -> None:
        self.cu.lib.cuStreamDestroy_v2(self.h)
