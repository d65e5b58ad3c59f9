"""Thread block clusters (sm_90): a CTA's rank in its cluster, the cluster-wide barrier, and
reads of another CTA's shared memory (distributed shared memory, DSMEM).

A kernel launched with cluster dimensions (cuda.core's LaunchConfig(cluster=...); numba's
launcher cannot pass them) has its CTAs co-scheduled on one GPC, where each may read the
others' shared memory: `mapa` turns an address in this CTA's shared window into the same
offset in the window of the CTA of a given rank, and `ld.shared::cluster` reads it.  The
barrier orders those reads: writes made before `barrier.cluster.arrive.release` are seen by
loads after the matching `wait.acquire`, and a CTA whose shared memory others read must not
exit before they have read it (a second barrier).

The twins model a cluster of one CTA (what the simulator launches): rank 0, `mapa` to rank 0
is the address itself, the barrier is the CTA's barrier, and the load reads the simulator's
shared memory (nq/ptx/_sim.py).
"""
from __future__ import annotations

import numpy as np

from nq.ptx import _sim
from nq.ptx._asm import ptx


@ptx("mov.u32 %0, %cluster_ctarank;", out="u32")
def cluster_ctarank():
    """`mov.u32 r, %cluster_ctarank;` -- this CTA's rank in its cluster (0 .. cluster size - 1;
    0 without cluster dimensions).  Ranks follow blockIdx.x first within the cluster."""
    return np.uint32(0)


@ptx("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;",
     effect="memory")
def barrier_cluster_sync():
    """`barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;` -- every
    thread of every CTA of the cluster meets here (a __syncthreads across the cluster), with
    release/acquire order for shared memory.  `.aligned`: the whole warp executes it together,
    so call it where no branch has split a warp; a thread that has exited never arrives."""
    import threading
    threading.current_thread().syncthreads()   # the simulator's thread: its CTA barrier


@ptx("mapa.shared::cluster.u32 %0, %1, %2;", out="u32", args=("u32", "u32"))
def mapa_shared_cluster_u32(addr, rank):
    """`mapa.shared::cluster.u32 d, addr, rank;` -- the shared::cluster address of the byte at
    this CTA's shared address `addr` in the CTA of cluster rank `rank` (read it with
    ld_shared_cluster_f32)."""
    if int(rank) != 0:
        raise IndexError(f"mapa: rank {int(rank)} in a simulated cluster of one CTA")
    return np.uint32(addr)


@ptx("ld.shared::cluster.f32 %0, [%1];", out="f32", args=("u32",), effect="load")
def ld_shared_cluster_f32(addr):
    """`ld.shared::cluster.f32 f, [addr];` -- a float32 of the shared memory of the cluster's
    CTA that mapa_shared_cluster_u32 addressed (4-byte aligned)."""
    return _sim.shared_bytes(addr, 4).view(np.float32)[0]
