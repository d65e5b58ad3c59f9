"""mbarrier: the shared-memory barrier that bulk copies signal when their bytes have landed.

One 8-byte barrier in shared memory (a uint64 cuda.shared.array element, 8-byte aligned),
addressed by its 32-bit shared-window address (cvta_to_shared_u32).  A phase completes when
the expected number of threads have arrived AND the transaction count (bytes announced with
expect_tx, counted down by cp.async.bulk's complete_tx) is back to zero; then the phase bit
flips.  Consumers wait on the parity of the phase they need, so a double-buffered pipeline
waits on parity (iteration // n_buffers) & 1.

All of these are volatile with a memory clobber: a wait must be re-executed every time and
nothing may be read from the guarded buffer before it.  The twins run the same state machine
(nq/ptx/_sim.py) on stand-in addresses.
"""
from __future__ import annotations

import numpy as np

from nq.ptx import _sim
from nq.ptx._asm import ptx


@ptx("mbarrier.init.shared::cta.b64 [%0], %1;", args=("u32", "u32"), effect="memory")
def mbarrier_init(bar, count):
    """`mbarrier.init.shared::cta.b64 [bar], count;` -- arm the barrier for `count` arrivals.

    One thread initialises; then fence_mbarrier_init() and a __syncthreads before anyone uses it.
    """
    _sim.mbarrier_new(bar, count)


@ptx("mbarrier.arrive.shared::cta.b64 %0, [%1];", out="u64", args=("u32",), effect="memory")
def mbarrier_arrive(bar):
    """`mbarrier.arrive.shared::cta.b64 state, [bar];` -- one arrival (release semantics).

    Returns the opaque state token (the twin returns the phase bit it arrived in).
    """
    return np.uint64(_sim.locked(lambda: _sim.mbarrier(bar).arrive()))


@ptx("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;", args=("u32", "u32"),
     effect="memory")
def mbarrier_arrive_expect_tx(bar, tx_bytes):
    """`mbarrier.arrive.expect_tx.shared::cta.b64 _, [bar], tx_bytes;` -- announce bytes, arrive.

    The producer thread calls this once per phase with the total bytes its cp.async.bulk
    copies into the buffer; the phase cannot complete until those bytes have arrived.
    """
    def go():
        b = _sim.mbarrier(bar)
        b.expect_tx(int(tx_bytes))
        b.arrive()

    _sim.locked(go)


@ptx("{ .reg .pred nq_p; mbarrier.try_wait.parity.shared::cta.b64 nq_p, [%1], %2; "
     "selp.u32 %0, 1, 0, nq_p; }", out="u32", args=("u32", "u32"), effect="memory")
def mbarrier_try_wait_parity(bar, parity):
    """`mbarrier.try_wait.parity.shared::cta.b64 p, [bar], parity;` -- 1 if that phase is done.

    Returns uint32 1 once the phase with the given parity (0 or 1) has completed, else 0 after
    a hardware-chosen time slice of waiting; the caller loops:
        while not mbarrier_try_wait_parity(bar, phase): pass
    Acquire semantics: reads after a successful wait see the bytes the copies delivered.
    """
    done = _sim.locked(lambda: _sim.mbarrier(bar).phase != (int(parity) & 1))
    if not done:
        _sim.spin()
    return np.uint32(done)


@ptx("{ .reg .pred nq_p; nq_wait: mbarrier.try_wait.parity.shared::cta.b64 nq_p, [%0], %1; "
     "@!nq_p bra nq_wait; }", args=("u32", "u32"), effect="memory")
def mbarrier_wait_parity(bar, parity):
    """`L: mbarrier.try_wait.parity.shared::cta.b64 p, [bar], parity; @!p bra L;` -- block.

    mbarrier_try_wait_parity with the loop inside the asm (the label is scoped by the braces,
    so the wrapper can be inlined many times): one branch instead of selp + compare + branch.
    """
    while not mbarrier_try_wait_parity.twin(bar, parity):
        pass
