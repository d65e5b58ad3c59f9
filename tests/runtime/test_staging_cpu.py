"""nq/runtime/staging.py on the CPU: the pinned ring against a fake device whose copies run
late (as a stream's do), so a buffer refilled before its copy ran would show as wrong bytes."""
import os

import numpy as np
import pytest

from nq.runtime import staging


class LateDevice:
    """Device memory is a bytearray; copy/enqueue are queued and run only when an event is
    waited on or the stream finishes, reading the host buffer as it is *then*."""

    def __init__(self, size):
        self.mem = bytearray(size)
        self.queue = []          # ("copy", dst, buf, n) | ("call", fn) | ("mark", b)
        self.bufs = {}
        self.calls = []          # (fn's tag, bytes of mem at that moment)
        self.allocated = self.freed = 0

    def alloc(self, nbytes):
        buf = bytearray(nbytes)
        self.bufs[id(buf)] = buf
        self.allocated += 1
        return memoryview(buf), id(buf)

    def free(self, handle):
        self.freed += 1

    def copy(self, dst, handle, nbytes):
        self.queue.append(("copy", dst, handle, nbytes))

    def record(self, b):
        self.queue.append(("mark", b))

    def enqueue(self, fn):
        self.queue.append(("call", fn))

    def _run_until(self, pred):
        while self.queue:
            op = self.queue.pop(0)
            if op[0] == "copy":
                _, dst, h, n = op
                self.mem[dst:dst + n] = self.bufs[h][:n]
            elif op[0] == "call":
                op[1]()
            elif pred(op):
                return

    def wait(self, b):
        # run the queue up to the *last* mark of buffer b (a stream runs in order)
        last = max((i for i, op in enumerate(self.queue) if op == ("mark", b)), default=-1)
        for _ in range(last + 1):
            self._run_until(lambda op: True)

    def finish(self):
        self._run_until(lambda op: False)


@pytest.fixture
def blob(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 3_000_017, dtype=np.uint8).tobytes()
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    return path, data


@pytest.mark.parametrize("chunk, buffers, readers", [(4096, 2, 1), (65_536, 3, 4), (1 << 20, 8, 4),
                                                     (999, 5, 2)])
def test_the_ring_copies_every_byte_where_it_belongs(blob, chunk, buffers, readers):
    path, data = blob
    # tensors of odd sizes at odd offsets, copied to shuffled places; calls between them
    spans = [(0, 1), (1, 100_000), (100_001, 7), (200_000, 1_500_000), (1_700_000, 1_300_017)]
    order = [3, 0, 4, 2, 1]
    dst, at = {}, 0
    for i in order:
        dst[i] = at
        at += spans[i][1] + 13
    dev = LateDevice(at)
    items, seen = [], []
    for n, i in enumerate(order):
        off, size = spans[i]
        items.append(staging.Copy(off, size, dst[i]))
        # a "kernel" that runs in stream order: it must see every copy queued before it
        items.append(lambda i=i: seen.append((i, bytes(dev.mem[dst[i]:dst[i] + spans[i][1]]))))
    copied = staging.run(path, items, dev, chunk=chunk, buffers=buffers, readers=readers)
    assert copied == sum(s for _, s in spans)
    for i in order:
        off, size = spans[i]
        assert dev.mem[dst[i]:dst[i] + size] == data[off:off + size], f"span {i}"
    assert [i for i, _ in seen] == order
    for i, got in seen:
        off, size = spans[i]
        assert got == data[off:off + size], f"the call after span {i} ran before its copies"
    assert dev.allocated == dev.freed <= buffers


def test_a_short_file_is_an_error_and_frees_the_buffers(blob):
    path, data = blob
    dev = LateDevice(1 << 22)
    with pytest.raises(ValueError, match="ended at byte"):
        staging.run(path, [staging.Copy(len(data) - 10, 4096, 0)], dev, chunk=1024)
    assert dev.allocated == dev.freed > 0


def test_the_ring_needs_two_buffers(blob):
    with pytest.raises(ValueError, match="at least 2"):
        staging.run(blob[0], [staging.Copy(0, 10, 0)], LateDevice(10), buffers=1)


def test_pieces_split_at_chunk_boundaries():
    got = list(staging.pieces([staging.Copy(10, 25, 100)], 10))
    assert got == [staging.Copy(10, 10, 100), staging.Copy(20, 10, 110), staging.Copy(30, 5, 120)]
    assert os.cpu_count()


UPLOAD_SIM = r"""
from nq.loader.format import NanoqwenFile
from nq.runtime.weights import upload, upload_mismatches
nf = NanoqwenFile(PATH)
print("mismatches", len(upload_mismatches(nf, upload(nf))))
"""


@pytest.mark.slow
def test_upload_under_the_simulator_is_exact(tiny_nanoqwen):
    """runtime.weights.upload's plan (every buffer allocated first, then copied and re-tiled in
    stream order) on the simulator's plain copies: every tensor as the host reference has it."""
    from ptx_util import run_under_simulator
    errs, out = run_under_simulator(UPLOAD_SIM.replace("PATH", repr(str(tiny_nanoqwen))), timeout=600)
    assert errs == {"mismatches": 0.0}, out
