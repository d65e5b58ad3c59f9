"""Blocks of one grid meeting each other: a counter that many blocks add to, the loads and
stores that publish and observe it, a gpu-wide fence, coherent loads of data other blocks of
the same kernel wrote, and a short sleep for a spinning thread.

A grid barrier is these in a row: each block's thread 0 adds one to a counter
(`atom_add_acq_rel_gpu_u32`: release orders the block's stores before it, acquire the other
blocks' after it), the last to arrive publishes a new generation (`st_release_gpu_u32`), the
others spin on it (`ld_acquire_gpu_u32`, `nanosleep_u32` between tries); or, leaner, each
arrives with `red_release_gpu_add_u32` (no old value to wait for) on a counter that only grows
and spins until it reaches the barrier's count; the data the other
blocks wrote is then read with `ld_global_cg_v4_u32` (L2, coherent across SMs), never `.nc`,
whose read-only path may hold what it held before they wrote.  Every block of such a grid must
be resident at once.  The first user, a layer's MLP in one kernel (gate_up, the barrier, down;
bc19524), lost to the two kernels it replaced and was retired (docs/PERF.md 0.18); the
instructions stay, tested, for the next kernel that needs blocks to meet (a persistent step).

The twins read and write the array; the simulator runs a grid's blocks one after another, so
nothing there may spin on another block (bc19524's fused kernel ran its two phases as two
launches there).
"""
from __future__ import annotations

import threading
import time

import numpy as np

from nq.ptx._asm import ptx
from nq.ptx.memory import _u32x4

_LOCK = threading.Lock()   # the simulator's threads of a block run at once


def _flat(arr):
    return np.asarray(getattr(arr, "_ary", arr)).reshape(-1)


@ptx("atom.add.acq_rel.gpu.global.u32 %0, [%1], %3;", out="u32", args=("arr", "idx", "u32"),
     effect="memory")
def atom_add_acq_rel_gpu_u32(arr, idx, v):
    """`atom.add.acq_rel.gpu.global.u32 old, [&arr[idx]], v;` -- add v, return the value before;
    release (this thread's earlier writes, and those it has seen, are visible to whoever
    acquires the new value) and acquire (what the earlier adders published is visible after)."""
    with _LOCK:
        a = _flat(arr)
        old = np.uint32(a[idx])
        a[idx] = np.uint32((int(old) + int(v)) & 0xFFFFFFFF)
    return old


@ptx("ld.acquire.gpu.global.u32 %0, [%1];", out="u32", args=("arr", "idx"), effect="memory")
def ld_acquire_gpu_u32(arr, idx):
    """`ld.acquire.gpu.global.u32 d, [&arr[idx]];` -- read a flag another block publishes; what
    that block wrote before its release is visible after.  Volatile: a spin loop re-reads it."""
    return np.uint32(_flat(arr)[idx])


@ptx("st.release.gpu.global.u32 [%0], %2;", args=("arr", "idx", "u32"), effect="memory")
def st_release_gpu_u32(arr, idx, v):
    """`st.release.gpu.global.u32 [&arr[idx]], v;` -- publish v after every write this thread
    made or observed before it."""
    _flat(arr)[idx] = np.uint32(v)


@ptx("red.release.gpu.global.add.u32 [%0], %2;", args=("arr", "idx", "u32"), effect="memory")
def red_release_gpu_add_u32(arr, idx, v):
    """`red.release.gpu.global.add.u32 [&arr[idx]], v;` -- add v and return nothing: an arrival
    that publishes this thread's earlier writes without waiting for the counter's old value, so
    a barrier's arrival costs one release, not an atomic's round trip (scripts/bench_boundary.py
    measures the two forms against a kernel boundary)."""
    with _LOCK:
        a = _flat(arr)
        a[idx] = np.uint32((int(a[idx]) + int(v)) & 0xFFFFFFFF)


@ptx("red.relaxed.gpu.global.add.u64 [%0], %2;", args=("arr", "idx", "u64"), effect="memory")
def red_relaxed_gpu_add_u64(arr, idx, v):
    """`red.relaxed.gpu.global.add.u64 [&arr[idx]], v;` -- add the 64-bit v (two's complement:
    the same bits for a signed int64) to the 8 bytes at &arr[idx] (arr's element idx and, for a
    uint32 array, idx + 1 above it; 8-byte aligned), returning nothing.  Integer adds commute,
    so blocks adding in any order leave the same bits: attn_o_proj's fixed-point sums."""
    with _LOCK:
        a = _flat(arr)
        if a.dtype.itemsize == 4:
            old = int(a[idx]) | (int(a[idx + 1]) << 32)
            new = (old + int(np.uint64(v))) & 0xFFFFFFFFFFFFFFFF
            a[idx], a[idx + 1] = np.uint32(new & 0xFFFFFFFF), np.uint32(new >> 32)
        else:
            a[idx] = a.dtype.type((int(np.uint64(a[idx])) + int(np.uint64(v)))
                                  & 0xFFFFFFFFFFFFFFFF)


@ptx("fence.acq_rel.gpu;", effect="memory")
def fence_acq_rel_gpu():
    """`fence.acq_rel.gpu;` (CUDA's __threadfence): order this thread's memory accesses before
    and after it as seen from the whole GPU."""


@ptx("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];", out=("u32",) * 4, args=("arr", "idx"),
     effect="memory")
def ld_global_cg_v4_u32(arr, idx):
    """`ld.global.cg.v4.u32 {d0..d3}, [&arr[idx]];` -- 16 bytes cached in L2 only (coherent
    across SMs): for data another block of the same kernel wrote.  16-byte aligned."""
    return _u32x4(arr, idx)


@ptx("nanosleep.u32 %0;", args=("u32",), effect="memory")
def nanosleep_u32(ns):
    """`nanosleep.u32 ns;` -- suspend this thread about ns nanoseconds (at most 1 ms), so that
    a spinning thread leaves its issue slots to the warps with work."""
    time.sleep(0)
