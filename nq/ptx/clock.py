"""The SM's cycle counter, for kernels that keep time themselves.

`l2_pace` (nq/kernels/pace.py) issues its L2 prefetches one batch every so many cycles so that
the queue it adds in front of the decode step's latency-bound kernels stays short; it needs a
clock that only this SM reads and that nothing reorders.  The twin is the host's monotonic
nanosecond clock (the simulator runs kernels one thread at a time, so any monotonic count will
do there).
"""
from __future__ import annotations

import time

from nq.ptx._asm import ptx


@ptx("mov.u64 %0, %clock64;", out="u64", effect="memory")
def clock64():
    """`mov.u64 d, %clock64;` -- this SM's 64-bit cycle counter.  Volatile ("memory"), so two
    reads are never merged and a read is never hoisted out of the loop that spins on it."""
    return time.perf_counter_ns()
