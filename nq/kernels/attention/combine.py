"""attn_combine: merge the split kernel's partials (flash-decoding) into o, fp16.

Grid (num_heads,), block head_dim * SPLIT_GROUPS.  Warp 0 computes each split's weight
exp2(m_split - max m) and 1/sum(l_split * weight) (a fixed butterfly: every run adds in the
same order); then thread (group, dim) sums acc_split * weight over splits group,
group + SPLIT_GROUPS, ... with 4 loads in flight a round, and the groups are added in group
order.  SPLIT_GROUPS x 4 loads in flight keep the merge from being one long chain of dependent
L2 round trips; the fixed order makes a graph replay equal an eager launch bit for bit.  o
(num_heads*head_dim,) is the o_proj GEMV's input.

Epitaph: the combine fused into the split kernel's last CTA of each kv head (an atomic counter
a kv head, the same merge in split order, o bit for bit this kernel's) cost +0.35 / +0.46 /
+0.47 ms a step at 512 / 8K / 32K (+0.17..0.25 with 4 merge-only warps): one CTA reading 114 KB
of partials is a serial L2-latency chain longer than the kernel boundary it saves (commit
13c221c, nq/kernels/attn_mma.py, `counters=`).
"""
from __future__ import annotations

import functools
import math

from numba import cuda  # a module global: the simulator swaps it for its fake module
from numba.cuda.types import float16, float32

from nq.kernels.attention.plan import NEG_BIG
from nq.kernels.build import compile_kernel, kernel_name
from nq.paged import PAGE, STATE_POS

SPLIT_GROUPS = 4  # split groups a head (block head_dim * SPLIT_GROUPS)
COMBINE_SIG = "void(int32[::1], float32[:, :, ::1], float32[:, :, ::1], float16[::1])"


@functools.cache
def combine_body(head_dim: int, max_splits: int, min_pps: int):
    """The kernel body for one (head_dim, max_splits, min_pps); the plan's two numbers must be
    the split kernel's (nq/kernels/attention/plan.py).  Legend: D head_dim, MAXS / MINP
    max_splits / min_pps, GROUPS split groups, RED floats of the groups' sums."""
    from nq.kernels.common import dev, warp_max, warp_sum
    from nq.ptx import griddepcontrol_launch_dependents, griddepcontrol_wait

    D, MAXS, MINP = head_dim, max_splits, min_pps
    GROUPS = SPLIT_GROUPS
    NEG = float32(NEG_BIG)
    wsum, wmax = dev(warp_sum), dev(warp_max)   # nq/kernels/common.py
    RED = GROUPS * head_dim

    def attn_combine(state, part_acc, part_ml, o):
        # part_acc (max_splits, Hq, D) f32; part_ml (max_splits, Hq, 2) f32; o (Hq*D,) f16
        wts = cuda.shared.array(MAXS, float32)     # exp2(m_split - max m) per split
        red = cuda.shared.array(RED, float32)      # per split group sums
        inv = cuda.shared.array(1, float32)        # 1 / sum of l_split * wts[split]
        # PDL: trigger before waiting -- this kernel is tiny, so o_proj (next) is scheduled at
        # once and streams its weights into L2 while the merge runs.
        griddepcontrol_launch_dependents()
        griddepcontrol_wait()
        h = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        d = tid % D
        group = tid // D
        length = state[STATE_POS] + 1
        n_pages = (length + PAGE - 1) // PAGE
        pps = max(MINP, (n_pages + MAXS - 1) // MAXS)
        n_splits = (n_pages + pps - 1) // pps
        if tid < 32:
            mx = NEG
            for split in range(tid, n_splits, 32):
                mx = max(mx, part_ml[split, h, 0])
            mx = wmax(mx)
            den = float32(0.0)
            for split in range(tid, n_splits, 32):
                w = math.exp2(part_ml[split, h, 0] - mx)
                wts[split] = w
                den += part_ml[split, h, 1] * w
            # Fixed butterfly: every lane ends with the same sum, the same every run.
            den = wsum(den)
            if tid == 0:
                inv[0] = float32(1.0) / den
        cuda.syncthreads()
        # This group sums splits group, group + GROUPS, ...; 4 loads in flight a round.  Rows
        # past n_splits (clamped, never written: maybe NaN) are dropped by select, not by weight.
        a = float32(0.0)
        for split0 in range(group, n_splits, 4 * GROUPS):
            for u in range(4):
                split = split0 + u * GROUPS
                row = min(split, MAXS - 1)
                x = part_acc[row, h, d] * wts[row]
                a += x if split < n_splits else float32(0.0)
        red[group * D + d] = a
        cuda.syncthreads()
        if group == 0:
            t = red[d]
            for other in range(1, GROUPS):
                t += red[other * D + d]
            o[h * D + d] = float16(t * inv[0])

    return attn_combine


def combine_name(head_dim: int, max_splits: int, min_pps: int) -> str:
    return kernel_name("attn_combine", d=head_dim, splits=max_splits, minpps=min_pps)


@functools.cache
def combine_kernel(head_dim: int, max_splits: int, min_pps: int):
    """attn_combine compiled for sm_90, launched as [num_heads, head_dim * SPLIT_GROUPS]."""
    return compile_kernel(combine_body(head_dim, max_splits, min_pps), COMBINE_SIG,
                          combine_name(head_dim, max_splits, min_pps), fastmath=True)
