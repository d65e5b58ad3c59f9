"""Programmatic dependent launch (PDL): let the next kernel start before this one ends.

In a CUDA graph whose kernel-to-kernel edges are *programmatic* (nq/runtime/graphs.py makes them so),
a kernel's CTAs may be scheduled while its predecessor is still running: as soon as every CTA
of the predecessor has executed `griddepcontrol.launch_dependents` (or exited).  The early
kernel may do anything that does not depend on the predecessor -- issue its weight loads,
prefetch weights into L2, initialise barriers -- and must execute `griddepcontrol.wait` before
it reads anything the predecessor wrote or writes anything the predecessor reads.  That wait
returns once the predecessor grids have completed and their memory is visible.

For the decode step this hides each kernel's launch latency and DRAM ramp behind the tail of
the kernel before it (200 kernels a token for the 7B).  Launched without a programmatic edge
(eager launches, a plain stream), both instructions are no-ops, so the kernels stay correct
everywhere.  The twins do nothing: the simulator runs kernels one after another.
"""
from __future__ import annotations

from nq.ptx._asm import ptx


@ptx("griddepcontrol.wait;", effect="memory")
def griddepcontrol_wait():
    """`griddepcontrol.wait;` -- block until the prerequisite grids have completed and their
    writes are visible.  Every kernel of the decode graph calls it before its first read of
    data produced upstream (and before its first global write)."""


@ptx("griddepcontrol.launch_dependents;", effect="memory")
def griddepcontrol_launch_dependents():
    """`griddepcontrol.launch_dependents;` -- this CTA no longer holds back the dependent grid:
    once every CTA of this grid has executed it (or exited), the next kernel may be scheduled."""
