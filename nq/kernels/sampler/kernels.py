"""The sampler's kernels: `penalize` (pass A), `select` (pass B, launched NPASS times) and the
history upkeep kernels.  nq/kernels/sampler/__init__.py explains the algorithm; this module is
its device code.  Names of the constants (all baked in by the factory):

    V, VALID   padded vocabulary (logits length, a multiple of 4) and the tokenizer's size
    NB, T      blocks of every grid pass and threads a block
    BITS       radix digit: NBINS = 2^BITS histogram bins, also CAP, the candidate capacity
    IDXB       bits of a token id in the composite key; W = 32 + IDXB bits in all
    RING       length of the context token ring (positions modulo RING)

The shared state (ctl) and the helpers both passes use live in plan.py.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda
from numba.cuda.types import float32, float64, int32, int64

from nq.kernels.build import compile_kernel, kernel_name
# the ctl layout and plan helpers, re-exported: the launcher, tests and bench read them here
from nq.kernels.sampler.plan import (C_BEST, C_CAND_N, C_CNT_ABOVE, C_DEPTH, C_HIST_LEN,  # noqa: F401
                                     C_KEYMAX, C_MASS_ABOVE, C_MKEY, C_MODE, C_PREFIX,
                                     C_TICKET_A, C_TICKET_B, C_Z, CTL_LEN, MODE_BOUNDARY,
                                     MODE_COMPACT, MODE_DONE, MODE_LEVEL, _device_functions,
                                     ctl_initial, n_levels, n_select_passes)
from nq.kernels.sampler.params import (P_FREQUENCY, P_LOG_MIN_P, P_PRESENCE, P_REPEAT,
                                       P_SEED_HI, P_SEED_LO, P_TEMPERATURE, P_TOP_K, P_TOP_P,
                                       P_WINDOW)
from nq.kernels.sampler.reference import idx_bits
from nq.paged import STATE_POS, STATE_STEP, STATE_TOKEN
from nq.ptx import griddepcontrol_launch_dependents, griddepcontrol_wait

PENALIZE_SIG = ("void(float32[::1], int32[::1], int32[::1], int32[::1], int32[::1], "
                "float32[::1], int64[::1], int32[::1])")
SELECT_SIG = ("void(float32[::1], int32[::1], int32[::1], int32[::1], int64[::1], "
              "int32[::1], int64[::1], int64[::1])")
HISTORY_SIG = "void(int32[::1], int32[::1], int64[::1], int32[::1], int32)"


def select_smem_bytes(bits: int) -> int:
    """Dynamic shared memory of the select kernel: two int64 arrays of 2^bits."""
    return 16 << bits


def _constants(vocab, valid, nb, threads, bits, ring):
    if vocab % 4 or not 0 < valid <= vocab:
        raise ValueError(f"sampler: vocab {vocab} must be a multiple of 4 and valid_vocab "
                         f"{valid} in (0, vocab]")
    per_block = -(-(vocab // 4) // (nb * threads)) * threads * 4
    if per_block > 4096:
        raise ValueError(f"sampler: {nb} blocks of {threads} threads give a block {per_block} "
                         "ids; at most 4096 keep a bin's 20-bit mass parts below 2^32")
    nbins = 1 << bits
    if threads % 32 or nbins % threads or threads > nbins:
        raise ValueError(f"sampler: {threads} threads must be a multiple of 32 dividing the "
                         f"{nbins} bins")
    return vocab, valid, nb, threads, bits, ring


@functools.cache
def penalize_kernel(V, VALID, NB, T, BITS, RING):
    """Pass A: penalties -> pen, the step's max, the top digit's count histogram (top-k on),
    and in its last block the history commit and the first plan."""
    f = _device_functions(V, VALID, T, BITS, RING)
    key_of, block_scan, plan_level, param_f32 = (f["key_of"], f["block_scan"], f["plan_level"],
                                                 f["param_f32"])
    block_max = f["block_max"]
    NBINS = 1 << BITS
    E = NBINS // T
    NG = V // 4
    L1_SHIFT = 32 - BITS
    NEG_INF = float32(-np.inf)
    INF64 = float64(np.inf)

    def penalize(logits, state, params, counts, ctx, pen, ctl, hist_cnt):
        # logits (V,) f32 from lm_head; pen (V,) f32 out (ids < VALID); counts (V,) int32 and
        # ctx (RING,) int32: the penalty history; ctl (CTL_LEN,) int64; hist_cnt (NBINS,) int32
        h = cuda.shared.array(NBINS, int32)
        tot = cuda.shared.array(T, int32)
        res = cuda.shared.array(4, int32)
        red = cuda.shared.array(T, int64)
        last = cuda.shared.array(1, int32)
        tid = cuda.threadIdx.x
        b = cuda.blockIdx.x
        for r in range(tid, NBINS, T):
            h[r] = 0
        griddepcontrol_wait()  # PDL: logits come from lm_head, state from the step so far
        griddepcontrol_launch_dependents()
        # the step's history change (the input token enters at its position; with a window,
        # the token N positions back leaves), applied here as +-1 and committed by the last
        # block once every block has read the table
        tok = state[STATE_TOKEN]
        pos = int64(state[STATE_POS])
        window = params[P_WINDOW]
        enter = pos == ctl[C_HIST_LEN]
        add_id = tok if (enter and window != 0) else -1
        drop_id = -1
        if enter and window > 0 and pos >= window:
            drop_id = ctx[(pos - window) % RING]
        top_k = params[P_TOP_K]
        rp = param_f32(params, P_REPEAT)
        presence = param_f32(params, P_PRESENCE)
        frequency = param_f32(params, P_FREQUENCY)
        cuda.syncthreads()
        kmax = int64(0)
        for g in range(b * T + tid, NG, NB * T):
            for e in range(4):
                i = 4 * g + e
                if i < VALID:
                    v = logits[i]
                    c = counts[i] + (1 if i == add_id else 0) - (1 if i == drop_id else 0)
                    if c > 0:
                        v = v * rp if v <= float32(0) else v / rp
                        v = v - (float32(c) * frequency + presence)
                    if v != v:
                        v = NEG_INF
                    pen[i] = v
                    k = key_of(v)
                    kmax = max(kmax, k)
                    if top_k > 0:
                        cuda.atomic.add(h, int32(k >> L1_SHIFT), 1)
        kmax = block_max(red, kmax, tid, T)
        if top_k > 0:
            for r in range(tid, NBINS, T):
                if h[r] != 0:
                    cuda.atomic.add(hist_cnt, r, h[r])
        if tid == 0:
            cuda.atomic.max(ctl, C_KEYMAX, kmax)
        cuda.threadfence()
        cuda.syncthreads()
        if tid == 0:
            last[0] = cuda.atomic.add(ctl, C_TICKET_A, 1) == NB - 1
        cuda.syncthreads()
        if not last[0]:
            return
        if tid == 0:
            ctl[C_TICKET_A] = 0
            ctl[C_MKEY] = cuda.atomic.exch(ctl, C_KEYMAX, 0)
            ctl[C_CNT_ABOVE] = 0
            ctl[C_MASS_ABOVE] = 0
            if enter:
                if tok >= 0 and tok < V:
                    ctx[pos % RING] = tok
                    if window != 0:
                        counts[tok] += 1
                if drop_id >= 0:
                    counts[drop_id] -= 1
                ctl[C_HIST_LEN] = pos + 1
            if top_k <= 0:
                no_cut = (param_f32(params, P_TOP_P) >= float32(1)
                          and param_f32(params, P_LOG_MIN_P) == NEG_INF)
                # top-k off: the first level needs masses, so pass B histograms it again;
                # with nothing to cut, every id survives: one Gumbel-max pass
                ctl[C_DEPTH] = 0
                ctl[C_PREFIX] = -1 if no_cut else 0
                ctl[C_MODE] = MODE_BOUNDARY if no_cut else MODE_LEVEL
        if top_k > 0:
            cuda.syncthreads()
            for j in range(E):
                r = tid * E + j
                h[r] = cuda.atomic.exch(hist_cnt, NBINS - 1 - r, 0)   # top bin first
            cuda.syncthreads()
            block_scan(h, E, tot, tid, T)
            plan_level(h, h, tot, tot, res, ctl, 0, int64(0), top_k, INF64, int64(-1), True, tid)

    return penalize


@functools.cache
def select_kernel(V, VALID, NB, T, BITS, RING):
    """Pass B: whatever ctl's plan says (see the package doc): a histogram level, the final
    compaction, the boundary compaction with the Gumbel-max of the ids above it, or nothing."""
    f = _device_functions(V, VALID, T, BITS, RING)
    key_of, value_of, block_scan, bitonic = f["key_of"], f["value_of"], f["block_scan"], f["bitonic"]
    shift_at, mass, param_f32, plan_level = f["shift_at"], f["mass"], f["param_f32"], f["plan_level"]
    score, score_of, philox = f["score"], f["score_of"], f["philox"]
    block_max = f["block_max"]
    NBINS = 1 << BITS
    CAP = NBINS
    E = NBINS // T
    NG = V // 4
    IDXB = idx_bits(V)
    IDXMASK = (1 << IDXB) - 1
    NEG_INF = float32(-np.inf)
    INF64 = float64(np.inf)
    # dynamic shared memory (select_smem_bytes): int64 [0, CAP) the candidates (final) or a
    # level's mass scan, int64 [CAP, 2 CAP) the final mass scan; during a level's histogram the
    # second half holds two int32 arrays instead, the high and low 20-bit parts of each bin's
    # mass, because 64-bit shared atomics are compare-and-swap loops on sm_90 (a level with
    # top-k off took 22 us with them) and 32-bit ones are native
    HI, LO = 2 * CAP, 3 * CAP      # int32 indices of the second half
    LOW20 = (1 << 20) - 1

    def select(pen, state, params, out_ids, ctl, hist_cnt, hist_mass, cand_g):
        # pen (V,) f32; out_ids (ring,) int32; ctl (CTL_LEN,) int64; hist_cnt (NBINS,) int32,
        # hist_mass (NBINS,) int64, cand_g (CAP,) int64: zero / unused between passes
        hc = cuda.shared.array(NBINS, int32)
        dyn64 = cuda.shared.array(0, int64)
        dyn32 = cuda.shared.array(0, int32)
        cand = dyn64[0:CAP]
        hm = dyn64[CAP:2 * CAP]
        tot32 = cuda.shared.array(T, int32)
        tot64 = cuda.shared.array(T, int64)
        res = cuda.shared.array(4, int32)
        last = cuda.shared.array(1, int32)
        tid = cuda.threadIdx.x
        b = cuda.blockIdx.x
        griddepcontrol_wait()
        griddepcontrol_launch_dependents()
        mode = ctl[C_MODE]
        if mode == MODE_DONE:
            return
        depth = ctl[C_DEPTH]
        prefix = ctl[C_PREFIX]
        s0 = shift_at(depth)
        s1 = shift_at(depth + 1)
        top_k = params[P_TOP_K]
        k_on = top_k > 0
        top = value_of(ctl[C_MKEY])
        temp = param_f32(params, P_TEMPERATURE)
        step = int64(state[STATE_STEP]) & 0xFFFFFFFF
        pos = int64(state[STATE_POS]) & 0xFFFFFFFF
        seed_lo = int64(params[P_SEED_LO]) & 0xFFFFFFFF
        seed_hi = int64(params[P_SEED_HI]) & 0xFFFFFFFF
        if mode == MODE_LEVEL:
            for r in range(tid, NBINS, T):
                hc[r] = 0
                dyn32[HI + r] = 0
                dyn32[LO + r] = 0
            cuda.syncthreads()
            digit = (int64(1) << (s0 - s1)) - 1
            for g in range(b * T + tid, NG, NB * T):
                for e in range(4):
                    i = 4 * g + e
                    if i < VALID:
                        v = pen[i]
                        c = (key_of(v) << IDXB) | (IDXMASK - i)
                        if (c >> s0) == prefix:
                            r = int32((c >> s1) & digit)
                            cuda.atomic.add(hc, r, 1)
                            if not k_on:
                                q = mass(v, top)
                                cuda.atomic.add(dyn32, HI + r, int32(q >> 20))
                                cuda.atomic.add(dyn32, LO + r, int32(q & LOW20))
            cuda.syncthreads()
            for r in range(tid, NBINS, T):
                if hc[r] != 0:
                    cuda.atomic.add(hist_cnt, r, hc[r])
                    if not k_on:   # both parts are sums below 2^32: read them unsigned
                        cuda.atomic.add(hist_mass, r,
                                        ((int64(dyn32[HI + r]) & 0xFFFFFFFF) << 20)
                                        + (int64(dyn32[LO + r]) & 0xFFFFFFFF))
        else:
            cuda.syncthreads()
            boundary = mode == MODE_BOUNDARY
            best = int64(-1)
            for g in range(b * T + tid, NG, NB * T):
                above = False
                for e in range(4):
                    i = 4 * g + e
                    if i < VALID:
                        c = (key_of(pen[i]) << IDXB) | (IDXMASK - i)
                        t = c >> s0
                        if t == prefix or (t > prefix and not boundary):
                            cand_g[cuda.atomic.add(ctl, C_CAND_N, 1)] = c
                        elif t > prefix:
                            above = True
                if above:  # ids above the boundary bin all survive: their Gumbel-max here
                    x0, x1, x2, x3 = philox(int64(g), step, pos, int64(0), seed_lo, seed_hi)
                    for e in range(4):
                        i = 4 * g + e
                        if i < VALID:
                            v = pen[i]
                            c = (key_of(v) << IDXB) | (IDXMASK - i)
                            if (c >> s0) > prefix:
                                x = x0 if e == 0 else (x1 if e == 1 else (x2 if e == 2 else x3))
                                best = max(best, score_of(v, int64(i), x, temp))
            if boundary:
                best = block_max(tot64, best, tid, T)
                if tid == 0 and best >= 0:
                    cuda.atomic.max(ctl, C_BEST, best)
        cuda.threadfence()
        cuda.syncthreads()
        if tid == 0:
            last[0] = cuda.atomic.add(ctl, C_TICKET_B, 1) == NB - 1
        cuda.syncthreads()
        if not last[0]:
            return
        if tid == 0:
            ctl[C_TICKET_B] = 0
        if mode == MODE_LEVEL:
            nb = int64(1) << (s0 - s1)
            for j in range(E):
                r = tid * E + j
                if r < nb:
                    hc[r] = cuda.atomic.exch(hist_cnt, nb - 1 - r, 0)   # top bin first
                    hm[r] = cuda.atomic.exch(hist_mass, nb - 1 - r, 0) if not k_on else 0
                else:
                    hc[r] = 0
                    hm[r] = 0
            cuda.syncthreads()
            block_scan(hc, E, tot32, tid, T)
            block_scan(hm, E, tot64, tid, T)
            if tid == 0 and depth == 0 and not k_on:
                ctl[C_Z] = hm[NBINS - 1]          # every id's mass: top-p's denominator
            cuda.syncthreads()
            top_p = param_f32(params, P_TOP_P)
            lmp = param_f32(params, P_LOG_MIN_P)
            p_target = float64(top_p) * float64(ctl[C_Z]) if top_p < float32(1) else INF64
            t_m = (key_of(top + lmp) << IDXB) if lmp != NEG_INF else int64(-1)
            plan_level(hc, hm, tot32, tot64, res, ctl, depth, prefix, top_k, p_target, t_m,
                       k_on, tid)
            return
        # ---- the final block: every candidate (COMPACT) or the boundary bin (BOUNDARY) ----
        boundary = mode == MODE_BOUNDARY
        if tid == 0:
            res[3] = int32(cuda.atomic.exch(ctl, C_CAND_N, 0))
        cuda.syncthreads()
        n = res[3]
        npow = 1
        while npow < n:
            npow *= 2
        for r in range(tid, CAP, T):
            cand[r] = cuda.atomic.add(cand_g, r, 0) if r < n else -1
        cuda.syncthreads()
        bitonic(cand, npow, tid, T)
        for j in range(E):
            r = tid * E + j
            hm[r] = mass(value_of(cand[r] >> IDXB), top) if r < n else 0
        cuda.syncthreads()
        block_scan(hm, E, tot64, tid, T)
        k_lim = min(top_k, n) if k_on else n
        base = ctl[C_MASS_ABOVE] if boundary else int64(0)
        z = hm[k_lim - 1] if k_on else ctl[C_Z]
        top_p = param_f32(params, P_TOP_P)
        p_target = float64(top_p) * float64(z) if top_p < float32(1) else INF64
        th = top + param_f32(params, P_LOG_MIN_P)
        if tid == 0:
            res[0] = k_lim      # top-p keeps this many
            res[1] = k_lim      # min-p keeps this many
        cuda.syncthreads()
        for j in range(E):
            r = tid * E + j
            if r < k_lim:
                m_prev = float64(base + hm[r - 1]) if r > 0 else float64(base)
                if float64(base + hm[r]) >= p_target and m_prev < p_target:
                    res[0] = r + 1
                v_prev = value_of(cand[r - 1] >> IDXB) if r > 0 else -NEG_INF
                if value_of(cand[r] >> IDXB) < th and v_prev >= th:
                    res[1] = r
        cuda.syncthreads()
        n_keep = min(res[0], res[1])
        best = int64(-1)
        for r in range(tid, n_keep, T):
            c = cand[r]
            best = max(best, score(value_of(c >> IDXB), IDXMASK - (c & IDXMASK), temp, step,
                                   pos, seed_lo, seed_hi))
        best = block_max(tot64, best, tid, T)
        if tid == 0:
            if boundary:
                best = max(best, cuda.atomic.exch(ctl, C_BEST, -1))
            tok = int32(IDXMASK - (best & IDXMASK))
            s = state[STATE_STEP]
            out_ids[s % out_ids.shape[0]] = tok
            state[STATE_TOKEN] = tok
            state[STATE_POS] += 1
            state[STATE_STEP] = s + 1
            ctl[C_MODE] = MODE_DONE

    return select


@functools.cache
def history_kernel(V, RING):
    """op 0: counts[:] = 0; op 1: counts += the ring's tokens at positions [lo, hist_len)
    (lo from the window), with atomics: one launch per history rebuild, never in the step."""
    def history(counts, ctx, ctl, params, op):
        gid = cuda.grid(1)
        stride = cuda.gridsize(1)
        if op == 0:
            for i in range(gid, V, stride):
                counts[i] = 0
            return
        end = ctl[C_HIST_LEN]
        window = params[P_WINDOW]
        lo = int64(0) if window < 0 else (end if window == 0 else max(int64(0), end - window))
        for p in range(lo + gid, end, stride):
            t = ctx[p % RING]
            if t >= 0 and t < V:
                cuda.atomic.add(counts, t, 1)

    return history


def compiled(vocab, valid, nb, threads, bits, ring):
    """(penalize, select, history) compiled through build.py, named by every constant."""
    c = _constants(vocab, valid, nb, threads, bits, ring)
    names = dict(v=vocab, valid=valid, nb=nb, t=threads, bits=bits, ring=ring)
    opts = {} if threads is None else {"launch_bounds": (threads,)}
    return (compile_kernel(penalize_kernel(*c), PENALIZE_SIG,
                           kernel_name("sampler_penalize", **names), **opts),
            compile_kernel(select_kernel(*c), SELECT_SIG,
                           kernel_name("sampler_select", **names), **opts),
            compile_kernel(history_kernel(vocab, ring), HISTORY_SIG,
                           kernel_name("sampler_history", v=vocab, ring=ring)))
