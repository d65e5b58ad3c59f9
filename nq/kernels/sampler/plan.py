"""The sampler's shared state and the device helpers its passes share: the ctl layout and
plan modes, masses, Gumbel scores, and `plan_level`, which turns a scanned histogram into the
next pass's plan (nq/kernels/sampler/__init__.py explains the algorithm).

ctl (int64, CTL_LEN) is the passes' shared state, written only by the last block of a pass
(or with atomics): the plan for the next pass and the step's running totals.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda
from numba.cuda.types import float32, float64, int32, int64

from nq.kernels.common import dev
from nq.kernels.philox import philox4x32_10, uniform_open01
from nq.kernels.sampler import blockops
from nq.kernels.sampler.reference import MASS_BITS, idx_bits
from nq.ptx import mov_b32_f32_from_u32

# ctl words
C_TICKET_A, C_TICKET_B, C_MODE, C_DEPTH, C_PREFIX = 0, 1, 2, 3, 4
C_CNT_ABOVE, C_MASS_ABOVE, C_Z, C_KEYMAX, C_MKEY = 5, 6, 7, 8, 9
C_CAND_N, C_BEST, C_HIST_LEN = 10, 11, 12
CTL_LEN = 16
# modes of the select pass
MODE_DONE, MODE_LEVEL, MODE_COMPACT, MODE_BOUNDARY = 0, 1, 2, 3


def ctl_initial() -> np.ndarray:
    """ctl between steps: every ticket and accumulator armed, no history."""
    c = np.zeros(CTL_LEN, np.int64)
    c[C_BEST] = -1
    return c


def n_levels(vocab: int, bits: int) -> int:
    """Radix levels of the composite key: ceil((32 + idx_bits) / bits)."""
    return -(-(32 + idx_bits(vocab)) // bits)


def n_select_passes(vocab: int, bits: int) -> int:
    """Select launches a step needs at worst: k on resolves one level in pass A and at most
    n_levels - 1 more, then compacts; k off resolves at most n_levels - 1 (the last level's
    bins hold at most 2^bits ids, which always fit) and then finishes."""
    return n_levels(vocab, bits)


@functools.cache
def _device_functions(V, VALID, T, BITS, RING):
    """The device helpers shared by the passes, closed over the constants."""
    NBINS = 1 << BITS
    CAP = NBINS
    E = NBINS // T                      # histogram / candidate entries a thread owns in scans
    IDXB = idx_bits(V)
    IDXMASK = (1 << IDXB) - 1
    W = 32 + IDXB
    TWO_MASS = float32(2.0 ** MASS_BITS)
    key_of = dev(blockops.key_of)
    value_of = dev(blockops.value_of)
    block_scan = dev(blockops.block_scan)
    bitonic = dev(blockops.bitonic_sort_desc)
    block_max = dev(blockops.block_max)
    philox = dev(philox4x32_10)
    uniform = dev(uniform_open01)

    @dev
    def shift_at(depth):
        """Bits below the prefix once `depth` digits are resolved."""
        s = W - BITS * depth
        return s if s > 0 else 0

    @dev
    def mass(v, top):
        """Quantised exp(v - top) (MASS_BITS fraction bits), exact to add in any order."""
        return int64(math.exp(v - top) * TWO_MASS)

    @dev
    def param_f32(params, i):
        return mov_b32_f32_from_u32(params[i])

    @dev
    def score_of(v, idx, x, temp):
        """Composite of v / T + Gumbel(x) for token idx (x: its Philox word): the draw is the
        survivors' maximum (Gumbel-max), ties to the lower id."""
        g = -math.log(-math.log(uniform(x)))
        return (key_of(v / temp + g) << IDXB) | (IDXMASK - idx)

    @dev
    def score(v, idx, temp, step, pos, seed_lo, seed_hi):
        """score_of with the token's own Philox word (counter: idx / 4, step, pos, 0)."""
        x0, x1, x2, x3 = philox(int64(idx >> 2), step, pos, int64(0), seed_lo, seed_hi)
        e = idx & 3
        x = x0 if e == 0 else (x1 if e == 1 else (x2 if e == 2 else x3))
        return score_of(v, idx, x, temp)

    @dev
    def plan_level(hc, hm, tot32, tot64, res, ctl, depth, prefix, top_k, p_target, t_m,
                   k_on, tid):
        """After a histogram of the digit below `prefix` at `depth` (global hc/hm -> the caller
        loaded them into smem top bin first and scanned them): pick the bin holding the cut,
        fold the bins above it into the running totals and write the next plan.  Whole block."""
        s0 = shift_at(depth)
        s1 = shift_at(depth + 1)
        width = s0 - s1
        nb = int32(1) << width
        cnt_above = ctl[C_CNT_ABOVE]
        mass_above = ctl[C_MASS_ABOVE]
        if tid < 3:
            res[tid] = NBINS
        cuda.syncthreads()
        for j in range(E):
            r = tid * E + j
            if r < nb:
                c_in = cnt_above + hc[r]
                c_prev = cnt_above + (hc[r - 1] if r > 0 else 0)
                if k_on and c_in >= top_k and c_prev < top_k:
                    res[0] = r
                m_in = float64(mass_above + hm[r])
                m_prev = float64(mass_above + (hm[r - 1] if r > 0 else 0))
                if (not k_on) and m_in >= p_target and m_prev < p_target:
                    res[1] = r
        if tid == 0 and (not k_on) and t_m >= 0:
            tp = t_m >> s0
            if tp == prefix:
                res[2] = nb - 1 - int32((t_m >> s1) & (nb - 1))
        cuda.syncthreads()
        if tid == 0:
            r = min(res[0], min(res[1], res[2]))
            if r >= nb:
                r = nb - 1                       # no cut inside: the whole range survives
            c_above = cnt_above + (hc[r - 1] if r > 0 else 0)
            m_above = mass_above + (hm[r - 1] if r > 0 else 0)
            c_bin = hc[r] - (hc[r - 1] if r > 0 else 0)
            ctl[C_CNT_ABOVE] = c_above
            ctl[C_MASS_ABOVE] = m_above
            ctl[C_PREFIX] = (prefix << width) | (nb - 1 - r)
            ctl[C_DEPTH] = depth + 1
            if c_above + c_bin <= CAP:
                ctl[C_MODE] = MODE_COMPACT
            elif (not k_on) and c_bin <= CAP:
                ctl[C_MODE] = MODE_BOUNDARY
            else:
                ctl[C_MODE] = MODE_LEVEL
        cuda.syncthreads()

    return dict(key_of=key_of, value_of=value_of, block_scan=block_scan, bitonic=bitonic,
                block_max=block_max,
                shift_at=shift_at, mass=mass, param_f32=param_f32, score=score,
                score_of=score_of, philox=philox,
                plan_level=plan_level)
