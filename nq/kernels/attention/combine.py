"""attn_combine: merge the split kernel's partials (flash-decoding) into o, fp16.

Grid (num_heads,), block head_dim / VEC * GROUPS (256 at d128): thread (group, q) merges dims
VEC*q .. VEC*q + 3 of the splits group, group + GROUPS, ...  After griddepcontrol.wait the
kernel waits only on loads from L2, so its shape is set by how many dependent round trips and
how many issue slots it leaves on the step's critical path (it runs between attn_split and
o_proj, and nothing overlaps it).  The split plan is read before the wait (nothing in the step
writes `state`); each thread then loads, at once, every split of the plan it owns -- its (m, l)
as one 8-byte load, its four acc values as one 16-byte load, up to VEC_CHUNK_ROWS splits (the
7B step's 33 splits / 8 groups: 5; 66: 9), further ones a round trip a chunk; rows past the
plan are read from row 0 and weighted 0, so no load sits behind a branch or waits on a select
-- merges them against their own max, and the groups meet once in shared memory, each
rescaled by exp2(m_group - max m).  Fixed order throughout, so a graph replay equals an eager
launch bit for bit.  o (num_heads*head_dim,) is the o_proj GEMV's input.

Measured in the 7B step on the H200 (scripts/step_variants.py, ms a step at 512 / 8K / 32K):
  - (2026-12-02) the plan before the wait and a chunk's loads at once, against warp 0 reading
    the length, then the m's, then the l's, then ceil(n_splits / 16) rounds of acc, each after
    the one before: -0.003 / -0.007 / -0.006 (-0.036 at 512, +0.018 / +0.024 at 8K / 32K when
    every row up to max_splits was loaded before the plan was known); 4 groups instead of 8,
    +0.023 / +0.012 / +0.012.  The chain form is in git history (f2f7242).
  - (2026-12-03) four dims a thread (this form) against one: **-0.015 / -0.043 / -0.044**, o
    bit for bit the same (20 GPU cases, 7B and d64 shapes, 1 to 20000 tokens).  ncu of the one-
    dim form at 32K: 6.2 us for 0.9 MB of partials, its 32 warps an SM issue-bound on
    per-element 64-bit address math (stall math 23 %, not selected 22 %); here 8 warps issue
    a quarter of the instructions.
  - (2026-12-03) a chunk's loads in one round trip (rows past the plan read row 0 instead of
    having their acc zeroed by selects, which ptxas had placed between the loads; flat
    partials; the warp sync): **-0.008 / -0.017 / -0.014**, o bit for bit (docs/PERF.md 0.13).

Epitaphs:
  - One dim a thread (head_dim * GROUPS = 1024 threads a head, a load an element): the form
    above lost 0.015-0.044 ms a step to it (code at a7f8ed5).
  - The combine fused into the split kernel's last CTA of each kv head (an atomic counter a kv
    head, the same merge in split order, o bit for bit this kernel's) cost +0.35 / +0.46 /
    +0.47 ms a step at 512 / 8K / 32K (+0.17..0.25 with 4 merge-only warps): one CTA reading
    114 KB of partials is a serial L2-latency chain longer than the kernel boundary it saves
    (commit 13c221c, nq/kernels/attn_mma.py, `counters=`).
"""
from __future__ import annotations

import functools
import math

from numba import cuda  # a module global: the simulator swaps it for its fake module
from numba.cuda.types import float16, float32

from nq.kernels.attention.plan import NEG_BIG
from nq.kernels.build import compile_kernel, kernel_name
from nq.paged import PAGE, STATE_POS

GROUPS = 8   # split groups a head (block head_dim / VEC * GROUPS: 5 splits a thread at 33)
VEC = 4      # dims a thread: one 16-byte load of a split's acc
VEC_CHUNK_ROWS = 16   # splits a thread loads at once (6 registers each)
COMBINE_SIG = "void(int32[::1], float32[::1], float32[::1], float16[::1])"


def flat_partials(part_acc, part_ml):
    """The partial buffers as attn_combine takes them: flat views of the same memory."""
    return part_acc.reshape(part_acc.size), part_ml.reshape(part_ml.size)


@functools.cache
def combine_body(head_dim: int, max_splits: int, min_pps: int, groups: int = GROUPS):
    """The kernel body for one (head_dim, max_splits, min_pps); the plan's two numbers must be
    the split kernel's (nq/kernels/attention/plan.py).  groups: split groups a head (the block
    is combine_threads(head_dim, groups); GROUPS in the engine, others in tests).  Legend: D
    head_dim, MAXS / MINP max_splits / min_pps, G split groups, QT threads a group, RED floats
    of the groups' sums, R splits a thread may own, RC of them loaded at once, CHUNKS rounds
    of RC."""
    from nq.ptx import (griddepcontrol_launch_dependents, griddepcontrol_wait,
                        ld_global_nc_v2_f32, ld_global_nc_v4_f32)

    D, MAXS, MINP, G = head_dim, max_splits, min_pps, groups
    if D % VEC:
        raise ValueError(f"attn_combine: head_dim {D} is not a multiple of {VEC} (vec={VEC})")
    QT = D // VEC                              # threads a group
    NEG = float32(NEG_BIG)
    ZERO = float32(0.0)
    RED = G * D
    R = -(-MAXS // G)                          # splits a thread may own
    RC = min(R, VEC_CHUNK_ROWS)                # of them, loaded at once (6 registers each)
    CHUNKS = -(-R // RC)

    def attn_combine(state, part_acc, part_ml, o):
        # part_acc (max_splits * Hq * D,) f32 and part_ml (max_splits * Hq * 2,) f32: the
        # split kernel's (max_splits, Hq, D) and (max_splits, Hq, 2) flat (flat_partials), so
        # an address is one 64-bit multiply-add; o (Hq * D,) f16; the grid is Hq blocks
        red = cuda.shared.array(RED, float32)      # each group's sum of acc_s w_s, per dim
        gm = cuda.shared.array(G, float32)         # each group's max m
        gl = cuda.shared.array(G, float32)         # each group's sum of l_s w_s
        ms = cuda.local.array(RC, float32)
        ls = cuda.local.array(RC, float32)
        x0 = cuda.local.array(RC, float32)
        x1 = cuda.local.array(RC, float32)
        x2 = cuda.local.array(RC, float32)
        x3 = cuda.local.array(RC, float32)
        h = cuda.blockIdx.x
        HQ = cuda.gridDim.x
        tid = cuda.threadIdx.x
        d = (tid % QT) * VEC
        group = tid // QT
        # The plan before the wait: state is written by nothing in the step (attn_split's
        # EARLY reads it there too, decode.py), so the loads below go out as the wait ends.
        length = state[STATE_POS] + 1
        # plan_body's arithmetic written out: through the shared device function the compiler
        # lost the splits' sign and added index wrap-around selects (PTX +63 instructions)
        n_pages = (length + PAGE - 1) // PAGE
        pps = max(MINP, (n_pages + MAXS - 1) // MAXS)
        n_splits = (n_pages + pps - 1) // pps
        # PDL: trigger before waiting -- this kernel is tiny, so o_proj (next) is scheduled at
        # once and streams its first weights while the merge runs.
        griddepcontrol_launch_dependents()
        griddepcontrol_wait()
        mx = NEG
        a0 = ZERO                                  # four dims, written out: registers
        a1 = ZERO
        a2 = ZERO
        a3 = ZERO
        den = ZERO
        for c in range(CHUNKS):
            for i in range(RC):
                # every load of the chunk, then (after the warp sync, which ptxas does not
                # schedule across) what uses them: without it ptxas put the first uses
                # between the loads, and the chunk's last loads went out a round trip later
                split = group + (c * RC + i) * G
                row = split if split < n_splits else 0   # past the plan: row 0 (below)
                rh = row * HQ + h
                x0[i], x1[i], x2[i], x3[i] = ld_global_nc_v4_f32(part_acc, rh * D + d)
                ms[i], ls[i] = ld_global_nc_v2_f32(part_ml, rh * 2)
            cuda.syncwarp()
            for i in range(RC):
                # a row past the plan holds row 0's values (finite, so times the weight 0
                # they are 0: o as if they were never read) and m = NEG, so its weight
                # exp2(NEG - max) is 0; a group with no split of the plan leaves max = NEG
                # and weights 1, but the groups' merge below weights it exp2(NEG - max) = 0
                if group + (c * RC + i) * G >= n_splits:
                    ms[i] = NEG
            top = mx
            for i in range(RC):
                top = max(top, ms[i])
            k = math.exp2(mx - top)          # the earlier chunks' sums to the new max
            a0 *= k
            a1 *= k
            a2 *= k
            a3 *= k
            den *= k
            for i in range(RC):
                w = math.exp2(ms[i] - top)
                a0 += x0[i] * w
                a1 += x1[i] * w
                a2 += x2[i] * w
                a3 += x3[i] * w
                den += ls[i] * w
            mx = top
        base = group * D + d
        red[base] = a0
        red[base + 1] = a1
        red[base + 2] = a2
        red[base + 3] = a3
        if d == 0:
            gm[group] = mx
            gl[group] = den
        cuda.syncthreads()
        if group == 0:
            top = gm[0]
            for g in range(1, G):
                top = max(top, gm[g])
            t0 = ZERO
            t1 = ZERO
            t2 = ZERO
            t3 = ZERO
            den = ZERO
            for g in range(G):   # group order: the same sums every run
                w = math.exp2(gm[g] - top)
                t0 += red[g * D + d] * w
                t1 += red[g * D + d + 1] * w
                t2 += red[g * D + d + 2] * w
                t3 += red[g * D + d + 3] * w
                den += gl[g] * w
            out = h * D + d
            o[out] = float16(t0 / den)
            o[out + 1] = float16(t1 / den)
            o[out + 2] = float16(t2 / den)
            o[out + 3] = float16(t3 / den)

    return attn_combine


def combine_threads(head_dim: int, groups: int = GROUPS) -> int:
    """A block's threads: head_dim / VEC a split group."""
    return head_dim // VEC * groups


def combine_name(head_dim: int, max_splits: int, min_pps: int, groups: int = GROUPS) -> str:
    return kernel_name("attn_combine", d=head_dim, splits=max_splits, minpps=min_pps, g=groups,
                       vec=VEC)


@functools.cache
def combine_kernel(head_dim: int, max_splits: int, min_pps: int, groups: int = GROUPS):
    """attn_combine compiled for sm_90, launched as [num_heads, combine_threads(head_dim,
    groups)]."""
    return compile_kernel(combine_body(head_dim, max_splits, min_pps, groups), COMBINE_SIG,
                          combine_name(head_dim, max_splits, min_pps, groups),
                          launch_bounds=(combine_threads(head_dim, groups),), fastmath=True)
