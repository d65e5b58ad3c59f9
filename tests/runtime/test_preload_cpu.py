"""nq/runtime/preload.py on the CPU, against a fake libcuda: the arena's layout is every weight
tensor once, stacked as the GEMVs read them, 256-byte aligned; the preload thread copies the
file into it through the pinned ring (staging.DriverDevice) and books itself on the timeline;
it starts nothing, or stands aside, where it must (NQ_PRELOAD=0, no context, too little free
memory), and a failed copy is kept for upload to redo."""
import ctypes
import gc
import sys

import numpy as np
import pytest

from nq import gpu_start
from nq.loader.format import NanoqwenFile
from nq.runtime import preload
from nq.timeline import Timeline
from test_gpu_start import FakeCuda

BASE = 1 << 32          # the fake device's first address: above 32 bits, as a real one is


class FakeMemCuda(FakeCuda):
    """FakeCuda with device memory (a bytearray at BASE), pinned host buffers (real ctypes
    buffers) and streams whose copies run at once."""

    def __init__(self, free=1 << 40, fail_copy=False):
        super().__init__()
        self.mem, self.free, self.fail_copy = bytearray(), free, fail_copy
        self.host, self.freed = {}, []

    def cuCtxSetCurrent(self, ctx):
        assert ctx.value == self.context
        return self._result("cuCtxSetCurrent")

    def cuMemGetInfo_v2(self, free, total):
        free._obj.value, total._obj.value = self.free, 2 * self.free
        return self._result("cuMemGetInfo_v2")

    def cuMemAlloc_v2(self, ptr, nbytes):
        self.mem = bytearray(nbytes)
        ptr._obj.value = BASE
        return self._result("cuMemAlloc_v2")

    def cuMemFree_v2(self, ptr):
        self.freed.append(ptr)
        return 0

    def cuMemHostAlloc(self, ptr, nbytes, flags):
        buf = ctypes.create_string_buffer(nbytes)
        ptr._obj.value = ctypes.addressof(buf)
        self.host[ptr._obj.value] = buf
        return self._result("cuMemHostAlloc")

    def cuMemFreeHost(self, ptr):
        del self.host[ptr.value]
        return 0

    def cuMemcpyHtoDAsync_v2(self, dst, src, nbytes, stream):
        if self.fail_copy:
            return 1                                # CUDA_ERROR_INVALID_VALUE
        self.mem[dst - BASE: dst - BASE + nbytes] = ctypes.string_at(src, nbytes)
        return 0

    def cuStreamCreate(self, h, flags):
        assert flags == 1                           # non-blocking: never waits on stream 0
        h._obj.value = 0x77
        return 0

    def cuEventCreate(self, ev, flags):
        ev._obj.value = 0x88
        return 0

    def cuGetErrorName(self, r, s):
        s._obj.value = b"CUDA_ERROR_INVALID_VALUE"
        return 0

    def _ok(self, *args):
        return 0

    cuStreamSynchronize = cuStreamDestroy_v2 = cuEventRecord = _ok
    cuEventSynchronize = cuEventDestroy_v2 = _ok


@pytest.fixture
def fresh(monkeypatch):
    for k in ("NQ_DRIVER_THREAD", "NUMBA_DISABLE_CUDA", "NUMBA_ENABLE_CUDASIM", "NQ_PRELOAD"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(gpu_start, "_RETAINED", [])
    monkeypatch.setattr(gpu_start, "_DRIVER", [])
    monkeypatch.setattr(preload, "_PENDING", [])


def retain(lib):
    assert gpu_start.init_driver(lambda name: lib) is not None


def stacked(nf, b) -> bytes:
    """The file's bytes of buffer b's parts, stacked."""
    return b"".join(np.ascontiguousarray(nf.array(p)).tobytes() for p in b.parts)


def test_the_arena_holds_every_tensor_once_aligned(tiny_nanoqwen):
    nf = NanoqwenFile(tiny_nanoqwen)
    bufs = preload.buffers(nf)
    parts = [p for b in bufs for p in b.parts]
    assert sorted(parts) == sorted(n for n in nf.names() if not n.startswith("meta/"))
    for b, nxt in zip(bufs, bufs[1:] + [None]):
        assert b.offset % preload.ALIGN == 0
        assert b.nbytes == int(np.prod(b.shape)) * b.dtype.itemsize
        assert nxt is None or nxt.offset >= b.offset + b.nbytes
    by = {b.name: b for b in bufs}
    c = nf.config
    assert by["layers.1.qkv.qweight"].shape == (c.qkv_size, c.hidden_size // 8)
    assert by["layers.0.gate_up.scales"].parts == ("layers.0.gate_proj.scales",
                                                   "layers.0.up_proj.scales")
    assert by["layers.0.qkv.bias"].shape == (c.qkv_size,)


def test_the_preload_copies_the_file_into_the_arena(fresh, tiny_nanoqwen, monkeypatch):
    lib = FakeMemCuda()
    retain(lib)
    nf = NanoqwenFile(tiny_nanoqwen)
    tl = Timeline()
    switch = sys.getswitchinterval()
    p = preload.start(nf, tl)
    assert p is not None and preload.start(nf) is None      # one preload a process
    assert preload.take(NanoqwenFile(tiny_nanoqwen)) is None  # another file object: not this
    assert preload.take(nf) is p and preload.take(nf) is None  # handed out once
    assert p.wait() and p.error is None and p.ptr == BASE
    assert sys.getswitchinterval() == switch                 # restored after the ring
    for b in p.bufs:
        assert lib.mem[b.offset: b.offset + b.nbytes] == stacked(nf, b), b.name
    assert lib.host == {}                                    # the pinned ring is freed
    (name, sec), = tl.side
    assert name.startswith(preload.PART) and sec > 0 and tl.total() == 0
    del p
    gc.collect()
    assert lib.freed == [BASE]                               # the arena dies with its owner


def test_nothing_starts_when_unwanted(fresh, tiny_nanoqwen, monkeypatch):
    nf = NanoqwenFile(tiny_nanoqwen)
    for k in ("NQ_PRELOAD", "NQ_DRIVER_THREAD", "NUMBA_ENABLE_CUDASIM"):
        with monkeypatch.context() as m:
            m.setenv(k, "0" if k != "NUMBA_ENABLE_CUDASIM" else "1")
            assert preload.start(nf) is None
    assert preload.take(nf) is None


@pytest.mark.parametrize("case", ["no context", "no room"])
def test_it_stands_aside_without_a_context_or_room(fresh, tiny_nanoqwen, case):
    lib = FakeMemCuda(free=1 << 20)                 # the tiny model needs ~3 MB + MARGIN
    if case == "no room":
        retain(lib)
    nf = NanoqwenFile(tiny_nanoqwen)
    p = preload.start(nf)
    assert preload.take(nf) is None and not p.wait() and p.error is None
    assert "cuMemAlloc_v2" not in lib.calls


def test_a_failed_copy_is_kept_for_upload_to_redo(fresh, tiny_nanoqwen):
    lib = FakeMemCuda(fail_copy=True)
    retain(lib)
    nf = NanoqwenFile(tiny_nanoqwen)
    tl = Timeline()
    preload.start(nf, tl)
    p = preload.take(nf)
    assert p is not None and p.ptr == BASE               # the arena stays: upload fills it
    assert not p.wait() and "cuMemcpyHtoDAsync_v2 failed: CUDA_ERROR_INVALID_VALUE" in str(p.error)
    assert "failed" in tl.side[0][0] and lib.host == {}
