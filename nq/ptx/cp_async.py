"""cp.async (sm_80+): 16-byte global -> shared copies issued by every thread, without registers.

Prefill attention stages K/V tiles of 64 tokens through shared memory and reads them with
ldmatrix, 8 token rows of 256 B (head_dim 128) per phase.  Stored as the pool holds them
(what a cp.async.bulk copy of a page gives), those 8 rows fall in one 16-byte bank group: an
8-way conflict on every ldmatrix.  A per-thread 16-byte copy can put each chunk anywhere, so
the tile is XOR-swizzled (chunk c of row r at chunk c ^ (r % 8)) and ldmatrix is conflict-free
-- the layout FlashAttention-2 uses.  Padding instead needs one bulk copy per row (32 a page),
which decode measured as copy-issue-bound (nq/kernels/attention/decode.py's table).

Protocol: each thread issues its copies, `cp_async_commit_group()` closes a group (one per
pipeline stage, also when the thread issued none, so every thread counts the same groups),
`cp_async_wait_group(n)` waits until at most n of the thread's groups are pending, then a
__syncthreads makes every thread's landed copies visible to the others.  cp.async is the
generic proxy: no proxy fence is needed around ordinary shared accesses.

The twins copy at once (the simulator has no asynchrony): commit and wait do nothing.
"""
from __future__ import annotations

import numpy as np

from nq.ptx import _sim
from nq.ptx._asm import ptx
from nq.ptx.memory import _bytes_at


@ptx("cp.async.cg.shared.global [%0], [%1], 16, %3;", args=("u32", "arr", "idx", "u32"),
     effect="memory")
def cp_async_cg_g2s(dst, src, src_idx, src_bytes):
    """`cp.async.cg.shared.global [dst], [&src[src_idx]], 16, src_bytes;` -- copy 16 bytes.

    The first src_bytes (0 or 16 here) come from global memory, the rest of the 16 are zero
    filled: src_bytes = 0 writes a zero chunk and reads nothing, which is how a tile past the
    end of the context is cleared without a branch (stale slots may hold NaN, and 0 x NaN is
    NaN in the tensor core).  `.cg` caches in L2 only: a K/V tile is read once per CTA.
    dst (a shared address: cvta_to_shared_u32 + offset) and &src[src_idx] 16-byte aligned.
    """
    n = int(src_bytes)
    assert int(dst) % 16 == 0 and 0 <= n <= 16, "cp.async: 16-byte aligned dst, src_bytes <= 16"
    out = _sim.shared_bytes(dst, 16)
    data = _bytes_at(src, src_idx, 16, align=16)
    out[:n] = data[:n]
    out[n:] = np.uint8(0)


@ptx("cp.async.commit_group;", effect="memory")
def cp_async_commit_group():
    """`cp.async.commit_group;` -- close the thread's pending cp.async copies into one group."""


@ptx("cp.async.wait_group %0;", args=("imm",), effect="memory")
def cp_async_wait_group(n):
    """`cp.async.wait_group n;` -- wait until at most n (a compile-time constant) of this
    thread's committed groups are still in flight; follow with a __syncthreads before reading
    other threads' copies."""
    assert int(n) >= 0
