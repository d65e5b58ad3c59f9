"""What the twins of shared-memory and warp-collective instructions need under the simulator.

The CUDA simulator runs each thread as a Python thread with shared arrays as numpy arrays,
and has no shared-memory addresses, mbarriers or warps.  This module models the three:

* shared addresses: `shared_address(arr)` hands out a stable 32-bit stand-in address for a
  numpy buffer (1 KiB-aligned regions from 0x400, reused once the buffer is freed, so they
  stay inside the 256 KiB a wgmma descriptor can name), and `shared_bytes(addr, n)` maps one
  back to a writable uint8 view, so kernels can do address arithmetic exactly as on the GPU;
* mbarriers: the phase / pending-arrival / transaction-count state machine of the PTX ISA,
  kept beside the memory (the 8 bytes of the barrier itself are not touched);
* warps: `warp_exchange(value)` is a rendezvous of the 32 lanes of the calling thread's warp
  that returns every lane's value, which is all ldmatrix and mma.sync need.

Nothing here is used on the GPU target.
"""
from __future__ import annotations

import threading
import time
import weakref

import numpy as np

_lock = threading.RLock()
# live regions, one a shared array: (host start, nbytes, base, weak reference to the array)
_regions: list[tuple[int, int, int, "weakref.ref"]] = []
_views: dict[int, np.ndarray] = {}   # base -> the region's bytes, cached until the next region
FIRST_BASE = 0x400
WINDOW = 1 << 18   # wgmma descriptors carry 14 bits of (address >> 4): 256 KiB, as an SM's
_barriers: dict[int, "Mbarrier"] = {}
WARP_TIMEOUT_S = 60.0  # a lane that never arrives is a bug in the kernel: fail, do not hang


def _host_view(arr) -> np.ndarray:
    a = np.asarray(getattr(arr, "_ary", arr))
    assert a.flags.c_contiguous, "simulated shared memory must be C-contiguous"
    return a.reshape(-1).view(np.uint8)


def _owner(arr) -> np.ndarray:
    """The numpy array that owns arr's memory (the root of its .base chain): it lives exactly
    as long as the memory, where a view handed to cvta may be a temporary."""
    a = np.asarray(getattr(arr, "_ary", arr))
    while True:
        b = a.base
        if isinstance(b, memoryview):   # np.frombuffer (the simulator's dynamic shared memory:
            b = b.obj                   # a new array a call over one buffer of the block's)
        if not isinstance(b, np.ndarray):
            return a
        a = b


def _prune() -> list:
    """Drop the regions whose memory is freed (a finished block's shared arrays: their
    addresses are given out again, so the window stays as small as a CTA's), forget their
    mbarriers, and the byte views cached since the last allocation (they alone would keep a
    finished block's arrays alive).  Called when a new region is made; returns the live ones."""
    _views.clear()
    dead = [r for r in _regions if r[3]() is None]
    if dead:
        _regions[:] = [r for r in _regions if r[3]() is not None]
        for _, size, base, _ in dead:
            for a in [a for a in _barriers if base <= a < base + size]:
                del _barriers[a]
    return _regions


def shared_address(arr) -> np.uint32:
    """A 32-bit stand-in shared-memory address for element 0 of arr.  The region given out is
    the whole of the array owning arr's memory (so every view of one shared array maps into
    one range), at the lowest free 1 KiB-aligned place among the live regions: addresses stay
    below 256 KiB (what a wgmma descriptor can name) however many blocks a run goes through."""
    p = _host_view(arr).ctypes.data
    with _lock:
        for rs, size, base, ref in _regions:
            if (rs <= p < rs + size or (size == 0 and p == rs)) and ref() is not None:
                return np.uint32(base + (p - rs))
        owner = _owner(arr)
        start, n = owner.ctypes.data, owner.nbytes
        base = FIRST_BASE
        for _, size, b, _ in sorted(_prune(), key=lambda r: r[2]):
            if base + n <= b:
                break
            base = max(base, (b + max(size, 1) + 0x3FF) & ~0x3FF)
        assert base + n <= WINDOW, "simulated shared window exhausted (live arrays over 256 KiB)"
        _regions.append((start, n, base, weakref.ref(owner)))
        return np.uint32(base + (p - start))


def shared_bytes(addr, n: int) -> np.ndarray:
    """Writable uint8 view of n bytes of simulated shared memory at addr."""
    addr = int(addr)
    with _lock:
        for _, size, base, ref in _regions:
            if base <= addr and addr + n <= base + size:
                raw = _views.get(base)
                if raw is None:
                    owner = ref()
                    if owner is None:
                        continue
                    raw = _views[base] = owner.reshape(-1).view(np.uint8)
                return raw[addr - base: addr - base + n]
    raise IndexError(f"simulated shared address 0x{addr:x} (+{n}) is not in any shared array "
                     "that went through cvta_to_shared_u32")


# ---- mbarrier ---------------------------------------------------------------------------------
class Mbarrier:
    """PTX mbarrier: a phase completes when its pending arrivals and its tx-count both reach 0;
    then the phase flips and the arrival count is re-armed."""

    def __init__(self, count: int):
        assert 1 <= count < 2**20, "mbarrier arrival count is 1 .. 2^20-1"
        self.expected = count
        self.pending = count
        self.tx = 0
        self.phase = 0

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase ^= 1
            self.pending = self.expected

    def arrive(self, count=1) -> int:
        old = self.phase
        assert self.pending >= count, "more arrivals than the barrier expects this phase"
        self.pending -= count
        self._maybe_complete()
        return old

    def expect_tx(self, nbytes: int):
        self.tx += nbytes

    def complete_tx(self, nbytes: int):
        self.tx -= nbytes
        self._maybe_complete()


def mbarrier(addr) -> Mbarrier:
    with _lock:
        try:
            return _barriers[int(addr)]
        except KeyError:
            raise RuntimeError(f"mbarrier at 0x{int(addr):x} used before mbarrier_init") from None


def mbarrier_new(addr, count):
    shared_bytes(addr, 8)  # the barrier must live in a registered shared array
    assert int(addr) % 8 == 0, "an mbarrier is 8-byte aligned"
    with _lock:
        _barriers[int(addr)] = Mbarrier(int(count))


def locked(fn, *args):
    with _lock:
        return fn(*args)


def spin():
    """Give other simulator threads the GIL while a lane polls a barrier."""
    time.sleep(0)


# ---- warps ------------------------------------------------------------------------------------
class _Exchange:
    def __init__(self, lanes):
        self.barrier = threading.Barrier(lanes, timeout=WARP_TIMEOUT_S)
        self.slots = [None] * lanes


def warp_exchange(value, size: int = 32) -> list:
    """Rendezvous of the caller's warp in the simulator: every lane's value, by lane.  size=128
    is the warpgroup (wgmma): four consecutive warps, threads 128j .. 128j+127."""
    t = threading.current_thread()
    try:
        tid, manager, block = t.thread_id, t._manager, tuple(t.blockIdx)
    except AttributeError:
        raise RuntimeError("warp-collective twins run only inside a simulated kernel") from None
    nthreads = int(np.prod(manager._block_dim))
    warp, lane = divmod(tid, size)
    lanes = min(size, nthreads - size * warp)
    # The rendezvous lives on the launch's block manager, not in a table keyed by id(manager):
    # a later launch's manager can reuse a freed one's id, and with another block size its
    # partial warp would meet a stale barrier sized for the old lane count and never complete.
    with _lock:
        warps = manager.__dict__.setdefault("_nq_exchanges", {})
        ex = warps.setdefault((block, warp, size), _Exchange(lanes))
    ex.slots[lane] = value
    ex.barrier.wait()
    values = list(ex.slots)
    ex.barrier.wait()  # nobody overwrites a slot before every lane has read them all
    return values


def lane_id() -> int:
    return threading.current_thread().thread_id % 32
