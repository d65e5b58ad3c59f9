"""attn_combine: merge the split kernel's partials (flash-decoding) into o, fp16.

Grid (num_heads,), block head_dim * GROUPS: thread (group, dim) merges dim `dim` of the splits
group, group + GROUPS, ...  After griddepcontrol.wait the kernel waits only on loads from L2,
so its shape is set by how many dependent round trips it leaves on the step's critical path.
The split plan is read before the wait (nothing in the step writes `state`); each thread then
loads, at once, the m, l and acc[dim] of every split of the plan it owns -- up to `chunk_rows`
of them (the 7B's 66 splits / 8 groups: 9), further ones a round trip a chunk -- merges them
against their own max, and the groups meet once in shared memory, each rescaled by
exp2(m_group - max m).  Fixed order throughout, so a graph replay equals an eager launch bit
for bit.  o (num_heads*head_dim,) is the o_proj GEMV's input.

Measured in the 7B step on the H200 (2026-12-02, scripts/step_variants.py, ms a step at 512 /
8K / 32K): against the form before it -- warp 0 reading the length, then the m's, then the
l's, then ceil(n_splits / 16) rounds of acc, each after the one before -- -0.003 / -0.007 /
-0.006 (and -0.036 at 512, +0.018 / +0.024 at 8K / 32K when every row up to max_splits was
loaded, valid or not, before the plan was known); 4 groups instead of 8, +0.023 / +0.012 /
+0.012.  The chain form is in git history (f2f7242).

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

GROUPS = 8   # split groups a head (block head_dim * GROUPS: 9 splits a thread at 66)
COMBINE_SIG = "void(int32[::1], float32[:, :, ::1], float32[:, :, ::1], float16[::1])"


def chunk_rows(head_dim: int, groups: int) -> int:
    """Splits a thread loads at once: 3 registers each, so that a block of 1024 threads stays
    under 64 registers (launch_bounds caps them there)."""
    return 9 if head_dim * groups > 512 else 16


@functools.cache
def combine_body(head_dim: int, max_splits: int, min_pps: int, groups: int = GROUPS):
    """The kernel body for one (head_dim, max_splits, min_pps); the plan's two numbers must be
    the split kernel's (nq/kernels/attention/plan.py).  groups: split groups a head (the
    block is head_dim * groups threads; GROUPS in the engine, others in tests).  Legend: D
    head_dim, MAXS / MINP max_splits / min_pps, G split groups, RED floats of the groups'
    sums, R splits a thread may own, RC of them loaded at once, CHUNKS rounds of RC."""
    from nq.ptx import griddepcontrol_launch_dependents, griddepcontrol_wait

    D, MAXS, MINP = head_dim, max_splits, min_pps
    G = groups
    NEG = float32(NEG_BIG)
    ZERO = float32(0.0)
    RED = G * head_dim
    R = -(-MAXS // G)                          # splits a thread may own
    RC = min(R, chunk_rows(head_dim, groups))  # of them, loaded at once (registers: 3 RC)
    CHUNKS = -(-R // RC)

    def attn_combine(state, part_acc, part_ml, o):
        # part_acc (max_splits, Hq, D) f32; part_ml (max_splits, Hq, 2) f32; o (Hq*D,) f16
        red = cuda.shared.array(RED, float32)      # each group's sum of acc_s w_s, per dim
        gm = cuda.shared.array(G, float32)         # each group's max m
        gl = cuda.shared.array(G, float32)         # each group's sum of l_s w_s
        ms = cuda.local.array(RC, float32)
        ls = cuda.local.array(RC, float32)
        xs = cuda.local.array(RC, float32)
        h = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        d = tid % D
        group = tid // D
        # The plan before the wait: state is written by nothing in the step (attn_split's
        # EARLY reads it there too, decode.py), so the loads below go out as the wait ends.
        length = state[STATE_POS] + 1
        n_pages = (length + PAGE - 1) // PAGE
        pps = max(MINP, (n_pages + MAXS - 1) // MAXS)
        n_splits = (n_pages + pps - 1) // pps
        # PDL: trigger before waiting -- this kernel is tiny, so o_proj (next) is scheduled at
        # once and streams its first weights while the merge runs.
        griddepcontrol_launch_dependents()
        griddepcontrol_wait()
        # Every load of a chunk at once: of this thread's splits group, group + G, ...
        # (those of the plan only), each one's m, l and acc[d]; a chunk is every split the
        # thread owns up to max_splits / G = RC (the 7B: 66 / 8), so one round trip.
        mx = NEG
        a = ZERO
        den = ZERO
        for c in range(CHUNKS):
            for i in range(RC):
                split = group + (c * RC + i) * G
                ms[i] = NEG                  # no split: weight exp2(NEG - max) = 0 below
                ls[i] = ZERO
                xs[i] = ZERO
                if split < n_splits:
                    ms[i] = part_ml[split, h, 0]
                    ls[i] = part_ml[split, h, 1]
                    xs[i] = part_acc[split, h, d]
            top = mx
            for i in range(RC):
                top = max(top, ms[i])
            k = math.exp2(mx - top)          # the earlier chunks' sums to the new max
            a *= k
            den *= k
            for i in range(RC):
                w = math.exp2(ms[i] - top)
                a += xs[i] * w
                den += ls[i] * w
            mx = top
        red[tid] = a
        if d == 0:
            gm[group] = mx
            gl[group] = den
        cuda.syncthreads()
        if group == 0:
            top = gm[0]
            for g in range(1, G):
                top = max(top, gm[g])
            t = ZERO
            den = ZERO
            for g in range(G):   # group order: the same sums every run
                w = math.exp2(gm[g] - top)   # 0 for a group with no split (its max NEG)
                t += red[g * D + d] * w
                den += gl[g] * w
            o[h * D + d] = float16(t / den)

    return attn_combine


def combine_name(head_dim: int, max_splits: int, min_pps: int, groups: int = GROUPS) -> str:
    return kernel_name("attn_combine", d=head_dim, splits=max_splits, minpps=min_pps, g=groups)


@functools.cache
def combine_kernel(head_dim: int, max_splits: int, min_pps: int, groups: int = GROUPS):
    """attn_combine compiled for sm_90, launched as [num_heads, head_dim * groups]."""
    return compile_kernel(combine_body(head_dim, max_splits, min_pps, groups), COMBINE_SIG,
                          combine_name(head_dim, max_splits, min_pps, groups),
                          launch_bounds=(head_dim * groups,), fastmath=True)
