"""Device-function bodies every kernel family shares: warp butterflies and RMSNorm's block tail.

They are plain Python bodies; a kernel builder wraps them with `dev` (numba device functions,
force-inlined outside the simulator), so each kernel gets its own inlined copy and the PTX is
what the body would be written in place.  `block_rstd` takes the block's shape as arguments;
after inlining they are the builder's constants again.

RMSNorm in a decode kernel's prologue: each thread squares its share of x, `warp_sum` adds a
warp's 32 partials (every lane gets the total), lane 0 writes it to `red[warp]`, the block
syncs, and `block_rstd` adds the warp sums in warp order (deterministic: every block of every
kernel computes the same rstd for the same x) into 1/sqrt(mean + eps).
"""
from __future__ import annotations

import functools
import math

from numba import cuda, float32

from nq.ptx import SIMULATOR

FULL = 0xFFFFFFFF

# numba device functions, force-inlined on the device (the simulator refuses forceinline=)
dev = functools.partial(cuda.jit, device=True, **({} if SIMULATOR else {"forceinline": True}))


def warp_sum(v):
    """v summed over the warp's 32 lanes by xor butterflies; every lane returns the total."""
    v += cuda.shfl_xor_sync(FULL, v, 16)
    v += cuda.shfl_xor_sync(FULL, v, 8)
    v += cuda.shfl_xor_sync(FULL, v, 4)
    v += cuda.shfl_xor_sync(FULL, v, 2)
    v += cuda.shfl_xor_sync(FULL, v, 1)
    return v


def warp_max(v):
    """max of v over the warp's 32 lanes; every lane returns it."""
    v = max(v, cuda.shfl_xor_sync(FULL, v, 16))
    v = max(v, cuda.shfl_xor_sync(FULL, v, 8))
    v = max(v, cuda.shfl_xor_sync(FULL, v, 4))
    v = max(v, cuda.shfl_xor_sync(FULL, v, 2))
    v = max(v, cuda.shfl_xor_sync(FULL, v, 1))
    return v


def block_rstd(red, nwarps, inv_k, eps):
    """RMSNorm's 1/sqrt(sum(x^2)/K + eps) from the per-warp sums of squares in shared `red`
    (after the block's __syncthreads), added in warp order; inv_k = fp32 1/K."""
    tot = float32(0.0)
    for w in range(nwarps):
        tot += red[w]
    return float32(1.0) / math.sqrt(tot * inv_k + eps)
