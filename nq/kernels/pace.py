"""l2_pace: ask L2 for the head of each of gate_up's weight tiles, a few at a time, while the
attention chain of the same layer runs.

Why.  A layer's qkv_rope, attn_split, attn_combine and o_proj take ~17.6 us at 512 tokens
for ~16 MB of bytes: DRAM idles for most of it, then gate_up streams 69 MB.  Earlier prefetches
of gate_up's weights into that window (docs/PERF.md 0.8, 0.9) asked for 20-40 MB at once from
a kernel on the critical path and lost: DRAM serves requests roughly in order, so the chain's
own latency-bound loads queued behind the whole burst.  Here one warp of its own, on a side
stream forked after the previous layer's down and joined before gate_up, issues one
`cp.async.bulk.prefetch.L2` a lane -- 32 tile heads a batch -- and then waits `cycles` SM
cycles (`clock64`) before the next batch, so the queue it adds stays short.

What it reads: gate_up's weights in the tensor-core layout (nq/kernels/int4/layout.py:
[tile][group][lane][8 words], a 16-row tile's group 1 KB), gate tiles first, then the up
tiles; the first `groups` groups of a tile are what gate_up's two warps a tile read first.
Batch b's lane i asks for pair b * 16 + i // 2: its gate tile (i even) or its up tile, so the
two halves of a block's rows arrive together.

The reference (`pace_ranges`) is the list of byte ranges the kernel asks for, in order; it
writes nothing, so the step's results are the same with it or without it.
"""
from __future__ import annotations

import functools

from numba import cuda, uint64  # cuda: a module global the simulator swaps for its fake

from nq.config import GROUP_SIZE
from nq.kernels.build import compile_kernel, kernel_name
from nq.ptx import clock64, cp_async_bulk_prefetch_l2

LANES = 32            # one warp; a lane a tile head a batch
GROUP_BYTES = 1024    # a 16-row tile's group of 128 weights (INT4)


def pace_ranges(n_tiles: int, k: int, groups: int) -> list[tuple[int, int]]:
    """(byte offset, bytes) of each prefetch, in issue order (batch by batch, lane by lane), for
    gate_up's [gate; up] weights of n_tiles 16-row tiles each (2 * n_tiles in the array) and K
    = k; groups: the head of a tile, in 1 KB groups."""
    tile_bytes = k // GROUP_SIZE * GROUP_BYTES
    out = []
    for b in range(-(-2 * n_tiles // LANES)):
        for lane in range(LANES):
            pair = b * (LANES // 2) + lane // 2
            if pair < n_tiles:
                tile = pair + (lane % 2) * n_tiles
                out.append((tile * tile_bytes, groups * GROUP_BYTES))
    return out


def pace_name(n_tiles: int, k: int, groups: int, cycles: int, ctas: int = 1) -> str:
    return kernel_name("l2_pace", tiles=n_tiles, k=k, groups=groups, cycles=cycles, ctas=ctas)


@functools.cache
def pace_kernel(n_tiles: int, k: int, groups: int, cycles: int, ctas: int = 1):
    """l2_pace compiled for gate_up's n_tiles tiles (of gate; as many of up) at K = k, the first
    `groups` groups of each, a batch of 32 every `cycles` cycles a CTA; launched [ctas, 32]
    (CTA c takes batches c, c + ctas, ...: one SM's bulk-prefetch unit moves ~0.3 TB/s)."""
    tile_groups = k // GROUP_SIZE
    if not 1 <= groups <= tile_groups:
        raise ValueError(f"l2_pace: groups={groups} must be 1..{tile_groups} (a tile's groups "
                         f"at K={k})")
    if cycles < 0:
        raise ValueError(f"l2_pace: cycles={cycles} must be >= 0")
    TILE_WORDS = tile_groups * GROUP_BYTES // 4
    HEAD = groups * GROUP_BYTES
    ALL_BATCHES = -(-2 * n_tiles // LANES)
    BATCHES = -(-ALL_BATCHES // ctas)    # a CTA's: batches c, c + ctas, ...
    CTAS = ctas
    HALF = LANES // 2
    CYCLES = uint64(cycles)

    def l2_pace(qw):
        # qw (2 * n_tiles * TILE_WORDS,) uint32: gate_up's uploaded weights, flat
        lane = cuda.threadIdx.x
        t0 = clock64()
        for b in range(BATCHES):
            pair = (b * CTAS + cuda.blockIdx.x) * HALF + lane // 2
            if pair < n_tiles:
                tile = pair + (lane % 2) * n_tiles
                cp_async_bulk_prefetch_l2(qw, tile * TILE_WORDS, HEAD)
            # the next batch's slot; a warp's lanes read the same clock
            target = t0 + CYCLES * uint64(b + 1)
            while clock64() < target:
                pass

    return compile_kernel(l2_pace, "void(uint32[::1])",
                          pace_name(n_tiles, k, groups, cycles, ctas), launch_bounds=(LANES,))


def pace_launcher(gu_w, k: int, groups: int, cycles: int, side, ctas: int = 1):
    """(fork, join): fork(stream) makes the side stream wait for what `stream` has enqueued,
    then launches l2_pace on it over gate_up's uploaded weights gu_w ((2I, K/8) uint32, the
    tensor-core layout); join(stream) makes `stream` wait for it (before gate_up)."""
    n_rows = gu_w.shape[0]
    if gu_w.ndim != 2 or n_rows % 32 or gu_w.shape[1] * 8 != k:
        raise ValueError(f"l2_pace: gate_up weights {gu_w.shape} are not (2I, K/8) with I a "
                         f"multiple of 16 and K={k}")
    kern = pace_kernel(n_rows // 32, k, groups, cycles, ctas)
    flat = gu_w.reshape(gu_w.size)
    before, done = cuda.event(timing=False), cuda.event(timing=False)

    def fork(stream):
        before.record(stream)
        before.wait(side)
        kern[ctas, LANES, side](flat)
        done.record(side)

    def join(stream):
        done.wait(stream)

    return fork, join
