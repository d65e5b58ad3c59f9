"""Fences that order memory operations across proxies and barrier initialisation.

The TMA-style bulk copy (cp.async.bulk) runs in the *async proxy*: its writes and its
mbarrier updates are not ordered with ordinary (generic-proxy) shared-memory accesses unless a
proxy fence says so.  Both fences are volatile with a memory clobber; their twins do nothing
(the simulator executes everything in one proxy, in program order).
"""
from __future__ import annotations

from nq.ptx._asm import ptx


@ptx("fence.mbarrier_init.release.cluster;", effect="memory")
def fence_mbarrier_init():
    """`fence.mbarrier_init.release.cluster;` -- make mbarrier_init visible to the async proxy.

    Issue it after initialising the barriers (and before the __syncthreads that publishes
    them) so a cp.async.bulk started right after cannot complete_tx on an uninitialised barrier.
    """


@ptx("fence.proxy.async.shared::cta;", effect="memory")
def fence_proxy_async_shared():
    """`fence.proxy.async.shared::cta;` -- order generic-proxy shared accesses with async ones.

    Needed when a buffer that threads wrote (or read) with ordinary instructions is next written
    by cp.async.bulk (or the reverse): without it the bulk copy may see stale data.
    """
