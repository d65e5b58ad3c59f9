"""cp.async.bulk: the Hopper bulk copy engine (TMA without a tensor map), global -> shared.

One thread issues a copy of up to ~1 MB of contiguous bytes; the copy engine moves it while
the issuing warp goes on, and signals the mbarrier's transaction count as bytes land.  For the
GEMV this replaces 16-byte loads by every lane (and the registers they hold in flight) with a
few instructions per stage of a shared-memory pipeline.

Rules (the GPU faults or corrupts silently otherwise): dst and src 16-byte aligned, nbytes a
multiple of 16, the barrier's expect_tx announced for these bytes in the same phase.  If the
destination was last touched by ordinary loads/stores, issue fence_proxy_async_shared() first.
"""
from __future__ import annotations

from nq.ptx import _sim
from nq.ptx._asm import ptx
from nq.ptx.memory import _bytes_at


def _copy_and_signal(dst, src, src_idx, nbytes, bar):
    dst, nbytes = int(dst), int(nbytes)
    assert dst % 16 == 0 and nbytes % 16 == 0 and nbytes > 0, \
        "cp.async.bulk needs a 16-byte aligned destination and a size that is a multiple of 16"
    _sim.shared_bytes(dst, nbytes)[:] = _bytes_at(src, src_idx, nbytes, align=16)
    _sim.locked(lambda: _sim.mbarrier(bar).complete_tx(nbytes))


@ptx("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %3, [%4];",
     args=("u32", "arr", "idx", "u32", "u32"), effect="memory")
def cp_async_bulk_g2s(dst, src, src_idx, nbytes, bar):
    """`cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [&src[src_idx]], nbytes, [bar];`

    Copy nbytes from global &src[src_idx] to shared address dst (cvta_to_shared_u32 + offset);
    completion counts nbytes off bar's transaction count.  In a one-CTA launch the CTA's own
    shared memory is its cluster's, so the `.shared::cluster` destination is plain shared memory.
    """
    _copy_and_signal(dst, src, src_idx, nbytes, bar)


@ptx("cp.async.bulk.prefetch.L2.global [%0], %2;", args=("arr", "idx", "u32"), effect="memory")
def cp_async_bulk_prefetch_l2(src, src_idx, nbytes):
    """`cp.async.bulk.prefetch.L2.global [&src[src_idx]], nbytes;` -- start pulling nbytes into
    L2 and go on; nothing waits for it.  One thread asks for a whole block's weight slice, so a
    GEMV launched early (programmatic dependent launch) streams its weights into L2 while the
    kernel before it still runs.  Volatile so it is not deleted (it has no result); the twin
    only checks the rules (16-byte aligned, a multiple of 16 bytes)."""
    from nq.ptx.memory import _bytes_at
    assert int(nbytes) % 16 == 0 and int(nbytes) > 0, "bulk prefetch size: a multiple of 16"
    assert len(_bytes_at(src, src_idx, int(nbytes), align=16)) == int(nbytes), \
        "bulk prefetch: the range runs past the end of the array"


@ptx("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
     "[%0], [%1], %3, [%4], %5;",
     args=("u32", "arr", "idx", "u32", "u32", "u64"), effect="memory")
def cp_async_bulk_g2s_hint(dst, src, src_idx, nbytes, bar, policy):
    """cp_async_bulk_g2s with `.L2::cache_hint` and a policy from createpolicy_evict_first_b64:
    streamed weights leave L2 first."""
    _copy_and_signal(dst, src, src_idx, nbytes, bar)
