"""attn_split in thread block clusters: the split partials merged through distributed shared
memory, so the decode attention is one kernel a layer (no attn_combine, no partials in global
memory).  Opt-in (`decode_launcher(cluster=16)`, the step's `attn.cluster`), for short
contexts.

Why.  Inside the 7B step at 512 tokens (H200, 2026-12-02, scripts/step_timeline.py) a layer's
attention costs 6.6 us of attn_split and 4.2 us of attn_combine on the critical path: the
combine is one more kernel boundary (the split's grid drains, its partials go to L2, the
combine starts, reads them back) for 114 KB of partials.  A cluster's CTAs can read each
other's shared memory, so the merge can happen inside the split kernel, in parallel, with no
serial chain (the merge by the last CTA of each kv head lost for that reason: KERNELS_ATTN.md).

What.  The grid is (C, num_kv) CTAs in clusters of C along x: the C splits of one kv head form
one cluster (max_splits = C, so the split plan is plan.py's with C splits).  Each CTA runs
decode.py's split (split_main) with its partial (m, l, acc of the GQA heads) left in its own
shared memory instead of global memory; CTAs past the plan's n_splits do no attention but
still merge.  Then:

    griddepcontrol.wait (the idle CTAs never waited); launch_dependents (o_proj may start)
    barrier.cluster (every partial is written: release / acquire)
    CTA of rank r, thread i: outputs r*T + i, r*T + i + C*T, ... of the kv head's G x D
        mx = max_s m_s; o = sum_s acc_s exp2(m_s - mx) / sum_s l_s exp2(m_s - mx)
        reading every rank's m, l and acc through mapa + ld.shared::cluster first (3C loads
        in flight), then summing s = 0 .. n_splits-1 in order (deterministic: the same sums
        every run, as attn_combine)
    barrier.cluster (no CTA leaves while a peer still reads its shared memory)

At 512 tokens and C = 16 the plan is the step's (min_pps 2: 16 splits of 2 pages).  At longer
contexts the C splits hold more pages each than the 66-split kernel's, so this loses there;
on the H200 it lost at 512 too, with the merge's loads issued first (+0.027 ms a step,
2026-12-02, docs/KERNELS_ATTN.md), so the engine keeps split + combine at every length.

C > 8 is a non-portable cluster size: the launcher opts the kernel in
(CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED) before its first launch.  Launched through
cuda.core (fastlaunch.FastLaunch with cluster dims): numba's launcher has no cluster argument.
"""
from __future__ import annotations

import math

from numba import cuda  # a module global: the simulator swaps it for its fake module
from numba.cuda.types import float16, float32

from nq.kernels.attention.plan import NEG_BIG, plan_body
from nq.kernels.common import dev
from nq.paged import STATE_POS

ROWS = 8         # exchange rows: a GQA group's heads, padded as the mma fragment's rows 0-7


def cluster_tail(split_main, gqa: int, head_dim: int, consumers: int, max_splits: int,
                 min_pps: int, cluster: int):
    """The cluster kernel around decode.py's split_main (module doc): attn_split(q, state,
    table, kv, o)."""
    from nq.ptx import (barrier_cluster_sync, cluster_ctarank, cvta_to_shared_u32_at,
                        griddepcontrol_launch_dependents, griddepcontrol_wait,
                        ld_shared_cluster_f32, mapa_shared_cluster_u32)
    if max_splits != cluster:
        raise ValueError(f"attention cluster={cluster}: max_splits must be the cluster size "
                         f"(got {max_splits})")
    GQA, D, C = gqa, head_dim, cluster
    plan = dev(plan_body(max_splits, min_pps))   # (n_pages, pps, n_splits) of a length
    THREADS = (consumers + 1) * 32
    OUTS = GQA * D
    NEG = float32(NEG_BIG)

    def merge_out(xacc, xml, o, state):
        griddepcontrol_wait()                 # idle CTAs have not waited; o is written below
        griddepcontrol_launch_dependents()    # o_proj may load its weights meanwhile
        barrier_cluster_sync()                # every CTA's partial is in its shared memory
        kvh = cuda.blockIdx.y
        length = state[STATE_POS] + 1
        n_pages, pps, n_splits = plan(length)
        acc0 = cvta_to_shared_u32_at(xacc, (0, 0, 0))
        ml0 = cvta_to_shared_u32_at(xml, (0, 0, 0))
        for i in range(cluster_ctarank() * THREADS + cuda.threadIdx.x, OUTS, C * THREADS):
            g = i // D
            # every rank's m, l and acc loaded first, C loads of each in flight (a loop over
            # n_splits with its loads in it waited a DSMEM round trip a split); ranks past
            # n_splits hold no partial (maybe NaN): dropped by select, never by weight
            ms = cuda.local.array(C, float32)
            ls = cuda.local.array(C, float32)
            xs = cuda.local.array(C, float32)
            for s in range(C):
                ml = mapa_shared_cluster_u32(ml0 + 8 * g, s)
                ms[s] = ld_shared_cluster_f32(ml)
                ls[s] = ld_shared_cluster_f32(ml + 4)
                xs[s] = ld_shared_cluster_f32(mapa_shared_cluster_u32(acc0 + 4 * i, s))
            mx = NEG
            for s in range(C):
                mx = max(mx, ms[s] if s < n_splits else NEG)
            den = float32(0.0)
            num = float32(0.0)
            for s in range(C):
                w = math.exp2(ms[s] - mx)
                den += ls[s] * w if s < n_splits else float32(0.0)
                num += xs[s] * w if s < n_splits else float32(0.0)
            o[kvh * OUTS + i] = float16(num / den)
        cuda.syncwarp(0xFFFFFFFF)             # converged for the .aligned barrier
        barrier_cluster_sync()                # peers are done reading this CTA's partial

    merge_out = dev(merge_out)

    def attn_split(q, state, table, kv, o):
        xacc = cuda.shared.array((1, ROWS, D), float32)   # this split's acc, rows = heads
        xml = cuda.shared.array((1, ROWS, 2), float32)    # its (m, l) a head
        split_main(q, state, table, kv, xacc, xml, table)
        merge_out(xacc, xml, o, state)

    return attn_split


def check_cluster(cluster: int) -> None:
    if cluster not in (1, 2, 4, 8, 16):
        raise ValueError(f"attention cluster={cluster}: 1, 2, 4, 8 or 16 CTAs a cluster (16 "
                         f"is sm_90's largest, non-portable)")


def cluster_launcher(cfg, kern, q, state, table, kv_layer, o, *, cluster: int, consumers: int,
                     nstage: int, rows_per_copy: int):
    """decode_launcher's cluster form (module doc): `launch(stream=0)` runs kern, the cluster
    kernel launch.split_kernel(..., cluster=cluster) compiled, in clusters of `cluster`."""
    from nq.kernels.attention.plan import barrier_bytes, smem_bytes
    from nq.kernels.common import STATIC_SMEM_LIMIT, allow_smem
    from nq.kernels.fastlaunch import FastLaunch
    check_cluster(cluster)
    hkv = cfg.num_kv_heads
    nbytes = smem_bytes(cfg.head_dim, consumers, nstage, rows_per_copy)
    exchange = 4 * ROWS * (cfg.head_dim + 2)
    if nbytes + barrier_bytes(nstage) + exchange > STATIC_SMEM_LIMIT:
        allow_smem(kern, nbytes)
    threads = (consumers + 1) * 32
    fl = FastLaunch(kern, q, state, table, kv_layer, o)
    opted = []

    def launch(stream=0):
        if not opted:
            if cluster > 8:
                allow_large_cluster(kern)
            opted.append(True)
        fl((1, hkv), threads, stream, nbytes, cluster=(cluster, 1, 1))

    return launch


def allow_large_cluster(kernel) -> None:
    """Opt a loaded kernel into cluster sizes above the portable 8 (a no-op under the
    simulator, which launches no clusters)."""
    from nq.ptx import SIMULATOR
    if SIMULATOR:
        return
    from numba.cuda.cudadrv import driver as drv
    from numba.cuda.cudadrv.driver import binding
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
    for k in kernel.overloads.values():
        fn = k._codelibrary.get_cufunc()
        drv.driver.cuKernelSetAttribute(attr, 1, fn.handle, fn.device.id)
