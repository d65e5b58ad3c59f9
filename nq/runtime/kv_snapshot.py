"""Host copies of the GPU engine's sequence: the `snapshot()` / `restore()` that let `nq serve
--cache-slots K` keep K-1 conversations besides the one on the GPU (nq/serve/prompt_cache.py).

The engine holds one sequence: its KV pages in the pool (nq/paged.py's layout) and `_pos`, the
tokens they hold.  Everything else a continuation reads (`state`, `feed_meta`, the block table)
is written afresh by the next prefill or decode, so a snapshot is the pages and the length:

    host  (num_layers, capacity, num_kv_heads, 2, PAGE, head_dim) fp16   pages in token order

Pages are copied by logical position, so a restored sequence may sit in other page ids than it
was saved from (attention reads through the block table): after a restore, decoding continues
bit for bit as in an engine that never left the conversation (tests/runtime/test_kv_snapshot_gpu.py).
Each copy is one call a layer and a run of consecutive page ids (a sequence's pages are one
run unless something else held pages when it grew), enqueued on the engine's stream: a
snapshot overlaps whatever the GPU still runs, and a restore is ordered before the next step.

Cost (7B shape: 28 layers x 4 KV heads x 128 dims): 56 KiB a token, 224 MiB for a 4K context.
Host buffers are pinned (`cuda.pinned_array`: copies at PCIe speed, asynchronous); pinning is
slow (tens of ms for 224 MiB), so a buffer holds a whole context (`capacity` = the engine's
pages) and is recycled: `discard(snap)` gives it back, and `HostBuffers` never holds more than
`limit` of them, so K-1 slots pin at most (K-1) x `snapshot_bytes` of host memory.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from nq.paged import pages_for


class SnapshotLimit(RuntimeError):
    """Every host buffer is held by a live snapshot; discard one first."""


@dataclasses.dataclass
class KVSnapshot:
    length: int               # tokens held
    host: np.ndarray          # (L, capacity, Hkv, 2, PAGE, D) fp16; pages [0, pages_for(length))
    ms: float = 0.0           # host time to enqueue the copy (the copy itself is asynchronous)
    ids: np.ndarray | None = None  # the cached token ids, as the engine's host mirror knew them

    @property
    def nbytes(self) -> int:
        """Bytes the snapshot's pages hold (the buffer may be larger)."""
        return int(self.host[:, :pages_for(self.length)].nbytes)


def page_runs(pages) -> list[tuple[int, int, int]]:
    """(logical page, first page id, count) for each run of consecutive ids in `pages`."""
    runs: list[tuple[int, int, int]] = []
    for i, p in enumerate(int(p) for p in pages):
        if runs and runs[-1][1] + runs[-1][2] == p:
            at, first, n = runs[-1]
            runs[-1] = (at, first, n + 1)
        else:
            runs.append((i, p, 1))
    return runs


class HostBuffers:
    """Pinned host buffers of one pool shape, recycled; at most `limit` exist at once."""

    def __init__(self, shape: tuple[int, ...], limit: int | None = None, pinned: bool = True):
        self.shape, self.limit, self.pinned = tuple(shape), limit, pinned
        self.free: list[np.ndarray] = []
        self.count = 0  # buffers alive, free or held

    @property
    def buffer_bytes(self) -> int:
        return int(np.prod(self.shape)) * 2

    def take(self) -> np.ndarray:
        if self.free:
            return self.free.pop()
        if self.limit is not None and self.count >= self.limit:
            raise SnapshotLimit(f"{self.count} KV snapshots of {self.buffer_bytes / 2**20:.0f} MiB "
                                "are held; discard one before taking another")
        buf = None
        if self.pinned:
            from numba import cuda
            try:
                buf = cuda.pinned_array(self.shape, np.float16)
            except Exception:  # noqa: BLE001 -- pinned memory exhausted: pageable still works
                buf = None
        if buf is None:
            buf = np.empty(self.shape, np.float16)
        self.count += 1
        return buf

    def give(self, buf: np.ndarray) -> None:
        self.free.append(buf)


def save(kv, pages, length: int, buffers: HostBuffers, stream) -> KVSnapshot:
    """Enqueue the copy of the first `length` tokens' pages of kv (L, n_pages, ...) to a host
    buffer; `pages`: the sequence's page ids in token order."""
    import time
    t = time.perf_counter()
    n = pages_for(length)
    if n > len(pages):
        raise ValueError(f"snapshot of {length} tokens: the sequence holds {len(pages)} pages")
    host = buffers.take()
    if n > host.shape[1]:
        buffers.give(host)
        raise ValueError(f"snapshot of {n} pages: the buffers hold {host.shape[1]}")
    for at, first, count in page_runs(pages[:n]):
        for layer in range(host.shape[0]):
            kv[layer, first:first + count].copy_to_host(host[layer, at:at + count], stream=stream)
    return KVSnapshot(int(length), host, 1e3 * (time.perf_counter() - t))


def load(snap: KVSnapshot, kv, pages, stream) -> None:
    """Enqueue the copy of snap's pages into the page ids `pages` (reserved, in token order)."""
    n = pages_for(snap.length)
    if n > len(pages):
        raise ValueError(f"restore of {snap.length} tokens: {len(pages)} pages reserved")
    for at, first, count in page_runs(pages[:n]):
        for layer in range(snap.host.shape[0]):
            kv[layer, first:first + count].copy_to_device(snap.host[layer, at:at + count],
                                                          stream=stream)
