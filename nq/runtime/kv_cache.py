"""Paged KV cache bookkeeping on the host: the page allocator, per-sequence block tables and
their device mirrors, and the device `state` array's constructor.

Pure Python + NumPy (CPU-testable); the device side is two small mirrors (`DeviceBlockTable`,
`make_state`) that import numba.cuda lazily.  The pool layout and the meaning of each `state`
scalar are the kernels' contract too, so they live below both, in nq/paged.py.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from nq.paged import PAGE, STATE_LEN, STATE_POS, STATE_STEP, STATE_TOKEN, pages_for

class KVCacheFull(RuntimeError):
    """The page pool cannot hold what was asked; the message says how to make room."""


class PageAllocator:
    """Free list over page ids 0..n_pages-1.  Allocation never happens on the decode path:
    the engine `reserve`s pages for the whole generation before it starts replaying."""

    def __init__(self, n_pages: int):
        if n_pages <= 0:
            raise ValueError(f"PageAllocator needs at least one page, got {n_pages}")
        self.n_pages = int(n_pages)
        # Popped from the end: low ids first, which keeps a fresh sequence's pages ascending.
        self._free = list(range(self.n_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_used(self) -> int:
        return len(self._used)

    def alloc(self, n: int) -> list[int]:
        """n page ids, or KVCacheFull (nothing is taken when the request cannot be met)."""
        n = int(n)
        if n < 0:
            raise ValueError(f"alloc({n})")
        if n > len(self._free):
            raise KVCacheFull(
                f"KV cache full: {self.n_used} pages of {PAGE} tokens in use, {self.n_free} free, "
                f"{n} more needed (pool of {self.n_pages} pages = {self.n_pages * PAGE} tokens); "
                f"raise -c / free a sequence")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages) -> None:
        """Return pages to the pool; freeing a page that is not in use is a bug and raises."""
        pages = [int(p) for p in pages]
        bad = [p for p in pages if p not in self._used]
        if bad or len(set(pages)) != len(pages):
            raise ValueError(f"free: pages {bad or pages} are not all in use (double free?)")
        self._used.difference_update(pages)
        self._free.extend(reversed(pages))


@dataclasses.dataclass
class Sequence:
    """One sequence's pages, in token order, and its host block table.

    table: int32 (max_pages,) -- table[i] is the page holding tokens i*PAGE .. i*PAGE+15;
    entries past len(pages) are 0 (a valid page id, never read: attention and rope_kv only
    touch pages below pages_for(pos + 1)).
    """
    max_pages: int
    pages: list[int] = dataclasses.field(default_factory=list)
    table: np.ndarray = None  # (max_pages,) int32
    dirty: bool = True  # table changed since the device mirror last copied it

    def __post_init__(self):
        if self.table is None:
            self.table = np.zeros(self.max_pages, np.int32)

    @property
    def capacity(self) -> int:
        """Tokens the reserved pages hold."""
        return len(self.pages) * PAGE

    def slot(self, pos: int) -> tuple[int, int]:
        """(page id, slot) of position pos."""
        if not 0 <= pos < self.capacity:
            raise IndexError(f"position {pos} outside the {self.capacity} reserved tokens")
        return self.pages[pos // PAGE], pos % PAGE


def reserve(alloc: PageAllocator, seq: Sequence, n_tokens: int) -> None:
    """Make seq hold at least n_tokens tokens (allocating ahead, so decode never allocates)."""
    need = pages_for(n_tokens)
    if need > seq.max_pages:
        raise KVCacheFull(f"KV cache full: a sequence of {n_tokens} tokens needs {need} pages of "
                          f"{PAGE}, the block table holds {seq.max_pages}; raise -c")
    extra = need - len(seq.pages)
    if extra > 0:
        new = alloc.alloc(extra)
        seq.table[len(seq.pages):need] = new
        seq.pages.extend(new)
        seq.dirty = True


def release(alloc: PageAllocator, seq: Sequence) -> None:
    """Give all of seq's pages back and empty it."""
    alloc.free(seq.pages)
    seq.pages.clear()
    seq.table[:] = 0
    seq.dirty = True


# ---- device mirrors ---------------------------------------------------------------------------

class DeviceBlockTable:
    """A fixed device int32 (max_pages,) mirror of one Sequence's table.

    Its address never changes, so captured graphs keep pointing at it; `sync` copies the host
    table (outside any graph, before replay) only when `reserve` changed it.
    """

    def __init__(self, max_pages: int, stream=0):
        from numba import cuda
        self.d_table = cuda.to_device(np.zeros(max_pages, np.int32), stream=stream)  # (max_pages,) int32

    def sync(self, seq: Sequence, stream=0) -> None:
        if seq.dirty:
            if seq.table.shape != self.d_table.shape:
                raise ValueError(f"block table of {seq.table.shape[0]} pages, mirror of "
                                 f"{self.d_table.shape[0]}")
            self.d_table.copy_to_device(seq.table, stream=stream)
            seq.dirty = False


def make_state(token: int = 0, pos: int = 0, step: int = 0, stream=0):
    """Device int32 (STATE_LEN,) state with the given token / position / step."""
    from numba import cuda
    host = np.zeros(STATE_LEN, np.int32)
    host[STATE_TOKEN], host[STATE_POS], host[STATE_STEP] = token, pos, step
    return cuda.to_device(host, stream=stream)
