"""The device-side contract between kernels and runtime: the KV page pool's layout and the
decode `state` scalars.  Kernels (rope_kv, attention, the qkv_rope GEMV, feed, embed, argmax)
and the runtime (nq/runtime/kv_cache.py, engine) both read this module; it imports nothing
of either, so kernels never depend on the orchestrator.
Pool layout (decided here, cited by the kernels that touch pages):

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

import numpy as np

from nq.config import ModelConfig

PAGE = 16  # tokens per page

STATE_TOKEN, STATE_POS, STATE_STEP = 0, 1, 2
STATE_LEN = 4  # one spare int32 keeps the array 16 bytes long



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
