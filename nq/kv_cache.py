"""Paged KV cache bookkeeping: page pool layout, page allocator, per-sequence block tables,
and the device `state` scalars that let one captured decode graph replay at every step.

Pure Python + NumPy (CPU-testable); the device side is two small mirrors (`DeviceBlockTable`,
`make_state`) that import numba.cuda lazily.

Pool layout (decided here, cited by rope_kv.py and attn_decode.py):

    kv_pool  (num_layers, n_pages, num_kv_heads, 2, PAGE, head_dim) fp16     one allocation
    layer l  kv_pool[l]  (n_pages, num_kv_heads, 2, PAGE, head_dim)           contiguous view
    K of (page p, kv head h) = kv_pool[l, p, h, 0]  (PAGE, head_dim); V = kv_pool[l, p, h, 1]

K and V of one (page, kv head) are adjacent, so the attention producer moves both with ONE
cp.async.bulk of 2*16*head_dim*2 B = 8 KiB (head_dim 128) or 4 KiB (64): a multiple of 128 B
and 128-byte aligned when the pool base is (every numba device allocation is 256-byte
aligned).  Heads inside a page, rather than pages inside a head, keep a token's K and V for
all heads of one layer within one 32-64 KiB page block, which is what rope_kv writes.

A token at position `pos` of a sequence lives in page `table[pos // PAGE]`, slot `pos % PAGE`.

Device `state` (int32 (STATE_LEN,)), read and written only by kernels during decode:
    state[STATE_TOKEN]  the token to embed next (argmax writes it; the engine seeds it)
    state[STATE_POS]    its position = number of tokens already in the KV cache; rope_kv
                        writes K/V at this position and attention reads PAGE-paged context
                        of length STATE_POS + 1; argmax advances it by one
    state[STATE_STEP]   decode steps taken; argmax writes the token to out_ids[step % ring]
                        and advances it by one
"""
from __future__ import annotations

import dataclasses

import numpy as np

from nq.config import ModelConfig

PAGE = 16  # tokens per page

STATE_TOKEN, STATE_POS, STATE_STEP = 0, 1, 2
STATE_LEN = 4  # one spare int32 keeps the array 16 bytes long


class KVCacheFull(RuntimeError):
    """The page pool cannot hold what was asked; the message says how to make room."""


def pages_for(n_tokens: int) -> int:
    """Pages needed to hold n_tokens tokens."""
    return -(-int(n_tokens) // PAGE)


def pool_shape(cfg: ModelConfig, n_pages: int) -> tuple[int, ...]:
    """Shape of the one KV allocation for every layer (see the module doc)."""
    return (cfg.num_layers, n_pages, cfg.num_kv_heads, 2, PAGE, cfg.head_dim)


def pool_bytes(cfg: ModelConfig, n_pages: int) -> int:
    return int(np.prod(pool_shape(cfg, n_pages))) * 2


def page_slice_bytes(cfg: ModelConfig) -> int:
    """Bytes of K+V of one (page, kv head): the unit of one bulk copy in attention."""
    return 2 * PAGE * cfg.head_dim * 2


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


# ---- NumPy models of what the kernels do with pages (tests, references) ----------------------

def write_token(pool_layer: np.ndarray, table: np.ndarray, pos: int, k: np.ndarray,
                v: np.ndarray) -> None:
    """pool_layer (n_pages, n_kv, 2, PAGE, D) fp16; k, v (n_kv, D): store the token at pos."""
    page, slot = int(table[pos // PAGE]), pos % PAGE
    pool_layer[page, :, 0, slot] = k
    pool_layer[page, :, 1, slot] = v


def gather_kv(pool_layer: np.ndarray, table: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """K, V (length, n_kv, D) of the first `length` tokens, in position order."""
    n = pages_for(length)
    pages = pool_layer[np.asarray(table[:n], np.int64)]  # (n, n_kv, 2, PAGE, D)
    k = pages[:, :, 0].transpose(0, 2, 1, 3).reshape(n * PAGE, *pages.shape[1:2], -1)[:length]
    v = pages[:, :, 1].transpose(0, 2, 1, 3).reshape(n * PAGE, *pages.shape[1:2], -1)[:length]
    return k, v


def check_paged_args(who: str, cfg: ModelConfig, kv_layer, table, state) -> None:
    """The paged-KV arguments every kernel that reads or writes pages takes (rope_kv,
    attention), checked once at launcher build: kv_layer (n_pages, n_kv, 2, PAGE, head_dim)
    fp16, table and state int32."""
    want = (cfg.num_kv_heads, 2, PAGE, cfg.head_dim)
    if kv_layer.dtype != np.float16 or tuple(kv_layer.shape[1:]) != want:
        raise ValueError(f"{who}: kv_layer is {kv_layer.dtype}{tuple(kv_layer.shape)}, "
                         f"want float16(n_pages, {', '.join(map(str, want))})")
    if table.dtype != np.int32 or state.dtype != np.int32:
        raise ValueError(f"{who}: table and state must be int32")


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
