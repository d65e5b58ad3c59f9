"""cp.async (sm_80+): 16-byte global -> shared copies that do not pass through registers.

A tensor-core GEMM keeps two or three k-slices of its tiles in flight: while the warps multiply
slice s out of shared memory, slice s + 2 is already on its way.  `cp.async` issues a copy and
goes on (no register holds the data, so no registers are spent on loads in flight);
`commit_group` closes the copies a thread issued since its last commit into one group, and
`wait_group n` blocks until at most the n most recent groups of *this thread* are still
pending.  Another thread sees the bytes only after a barrier (`cuda.syncthreads()`) that comes
after its own wait: the usual ring is

    for s in range(steps):
        cp_async_wait_group(STAGES - 2)   # slice s (this thread's copies) has landed
        cuda.syncthreads()                # ... everyone's; slice s - 1's buffer is free again
        issue slice s + STAGES - 1 into that buffer; cp_async_commit_group()
        compute slice s

`.cg` caches the copy in L2 only: the tiles are read once per block from shared memory, so
L1 would only hold bytes nobody reads again.

The twins model the asynchrony, not just the result: a copy's bytes are taken from global
memory when it is issued (the kernels never write what they copy) but land in shared memory
only when a `wait_group` of the issuing thread retires its group, so a simulated kernel that
reads a slice before waiting for it reads stale bytes and fails its test.
"""
from __future__ import annotations

import threading

import numpy as np

from nq.ptx import _sim
from nq.ptx._asm import ptx
from nq.ptx.memory import _bytes_at

_state = threading.local()     # the simulator runs each GPU thread as a Python thread


def _queues():
    if not hasattr(_state, "open"):
        _state.open = []        # copies issued since the last commit: [(dst, bytes)]
        _state.groups = []      # committed groups, oldest first
    return _state


def _land(group):
    for dst, data in group:
        _sim.shared_bytes(dst, len(data))[:] = data


@ptx("cp.async.cg.shared.global [%0], [%1], 16;", args=("u32", "arr", "idx"), effect="memory")
def cp_async_cg_shared_global_16(dst, src, src_idx):
    """`cp.async.cg.shared.global [dst], [&src[src_idx]], 16;` -- copy 16 bytes from global
    memory to the shared address dst (cvta_to_shared_u32 + offset) without waiting.

    Both addresses must be 16-byte aligned (the GPU faults on a misaligned one).  The bytes are
    there for this thread after a cp_async_wait_group that retires the copy's group, and for
    the others after a barrier that follows it.
    """
    dst = int(dst)
    assert dst % 16 == 0, "cp.async: the shared destination must be 16-byte aligned"
    _sim.shared_bytes(dst, 16)     # the destination must be a registered shared array
    _queues().open.append((dst, _bytes_at(src, src_idx, 16).copy()))


@ptx("cp.async.cg.shared.global [%0], [%1], 16, %3;", args=("u32", "arr", "idx", "u32"),
     effect="memory")
def cp_async_cg_shared_global_16_zfill(dst, src, src_idx, src_bytes):
    """`cp.async.cg.shared.global [dst], [&src[src_idx]], 16, src_bytes;` -- the same copy, of
    which only the first src_bytes (0 or 16 in practice) come from global memory and the rest
    of the 16 are zero-filled.  src_bytes = 0 writes a zero chunk and reads nothing: prefill
    attention clears the K/V tile slots past the end of the context this way, without a branch
    (stale pool slots may hold NaN, and 0 x NaN is NaN in the tensor core too).
    """
    _queue_zfill(dst, src_bytes, lambda: _bytes_at(src, src_idx, 16, align=16))


@ptx("{ .reg .u64 nq_a; add.u64 nq_a, %1, %2; cp.async.cg.shared.global [%0], [nq_a], 16, %3; }",
     args=("u32", "base", "u64", "u32"), effect="memory")
def cp_async_cg_shared_global_16_zfill_off(dst, src, byte_offset, src_bytes):
    """cp_async_cg_shared_global_16_zfill with the source named by a byte offset from src's
    element 0 instead of an index: `add.u64 a, &src[0], byte_offset; cp.async.cg.shared.global
    [dst], [a], 16, src_bytes;`.

    An N-d index costs a multiply by a run-time stride per dimension (numba's arrays carry
    their shape at run time); a kernel that knows the strides at compile time (prefill
    attention's paged K/V pool: page, head, K/V, row) writes the offset as a constant plus one
    multiply, and ptxas folds the constant parts into the address.  Same alignment, zero fill
    and landing rules as the indexed form.
    """
    off = int(byte_offset)
    a = np.asarray(getattr(src, "_ary", src))
    assert a.flags.c_contiguous, "the twins model C-contiguous arrays only"
    assert (a.ctypes.data + off) % 16 == 0, "16-byte access at a misaligned address"

    def source():
        assert 0 <= off and off + 16 <= a.nbytes, "cp.async: source past the array"
        return a.reshape(-1).view(np.uint8)[off:off + 16]
    _queue_zfill(dst, src_bytes, source)


def _queue_zfill(dst, src_bytes, source):
    """The zero-filling copies' twin: 16 bytes to land at dst, the first src_bytes of them
    from source() (read only when src_bytes > 0), the rest zeros."""
    dst, n = int(dst), int(src_bytes)
    assert dst % 16 == 0 and 0 <= n <= 16, "cp.async: 16-byte aligned dst, src_bytes <= 16"
    _sim.shared_bytes(dst, 16)
    data = np.zeros(16, np.uint8)
    if n:
        data[:n] = source()[:n]
    _queues().open.append((dst, data))


@ptx("cp.async.commit_group;", effect="memory")
def cp_async_commit_group():
    """`cp.async.commit_group;` -- close this thread's copies issued since its last commit into
    one group (an empty group if there were none: the ring commits every step, so that
    wait_group's count stays a count of steps)."""
    q = _queues()
    q.groups.append(q.open)
    q.open = []


@ptx("cp.async.wait_group %0;", args=("imm",), effect="memory")
def cp_async_wait_group(n):
    """`cp.async.wait_group n;` -- wait until at most the n most recent committed groups of
    this thread are pending (n a compile-time constant; 0 waits for all of them)."""
    q = _queues()
    while len(q.groups) > int(n):
        _land(q.groups.pop(0))


def pending_groups() -> int:
    """Twins only (tests): how many committed groups of the calling thread have not landed."""
    return len(_queues().groups)

