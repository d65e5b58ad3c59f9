"""The SM's cycle counter, for kernels that keep time themselves.

A kernel that paces itself (issues work one batch every so many cycles) needs a clock that only
this SM reads and that nothing reorders; the first user, l2_pace (20358ec), paced L2 prefetches
beside the decode step and was retired (docs/PERF.md 0.15), the instruction kept for the next
(and for timing a loop from inside a kernel).  The twin is the host's monotonic nanosecond
clock (the simulator runs kernels one thread at a time, so any monotonic count will do there).
"""
from __future__ import annotations

import time

from nq.ptx._asm import ptx


@ptx("mov.u64 %0, %clock64;", out="u64", effect="memory")
def clock64():
    """`mov.u64 d, %clock64;` -- this SM's 64-bit cycle counter.  Volatile ("memory"), so two
    reads are never merged and a read is never hoisted out of the loop that spins on it."""
    return time.perf_counter_ns()
