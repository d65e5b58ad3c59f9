"""Greedy argmax over fp32 logits (vocab,) that also advances the decode state.

One kernel, two stages: NB blocks each reduce a strided slice to (max, lowest index) and
publish it; the last block to finish (an atomic ticket) reduces the NB partials and writes
    state[STATE_TOKEN] = token;  out_ids[state[STATE_STEP] % len(out_ids)] = token
    state[STATE_POS] += 1;       state[STATE_STEP] += 1
then re-arms the ticket for the next replay.  One block would read 600 KiB through one SM
(several microseconds); 128 blocks read it at full-chip bandwidth.

Ties break to the lowest index, as numpy.argmax.  NaN logits are not handled (a NaN never
compares greater, so it is skipped; numpy would return it).
The partials are read back with atomics (atomic.add of 0), which go to L2: plain loads could
in principle hit a stale L1 line, and 256 atomics cost nothing.
"""
from __future__ import annotations

import functools

import numpy as np

from nq.kernels.build import compile_kernel, kernel_name
from nq.paged import STATE_POS, STATE_STEP, STATE_TOKEN

NB = 128
THREADS = 256


def argmax_reference(logits, state: np.ndarray, out_ids: np.ndarray) -> int:
    """The kernel's effect on host copies of state and out_ids; returns the token."""
    tok = int(np.argmax(np.asarray(logits, np.float32)))
    out_ids[state[STATE_STEP] % len(out_ids)] = tok
    state[STATE_TOKEN] = tok
    state[STATE_POS] += 1
    state[STATE_STEP] += 1
    return tok


@functools.cache
def argmax_body(vocab: int):
    """The kernel body for a vocabulary of `vocab` logits."""
    from numba import cuda
    from numba.cuda.types import float32, int32

    from nq.ptx import griddepcontrol_launch_dependents, griddepcontrol_wait

    V, NW = vocab, THREADS // 32
    NEG = float32(-3.4e38)

    def argmax(logits, state, out_ids, part_val, part_idx, ticket):
        # logits (V,) f32; state int32; out_ids (ring,) int32
        # part_val (NB,) f32, part_idx (NB,) int32; ticket (1,) int32, zero between launches
        sv = cuda.shared.array(NW, float32)
        si = cuda.shared.array(NW, int32)
        last = cuda.shared.array(1, int32)
        griddepcontrol_wait()  # PDL: logits come from lm_head
        griddepcontrol_launch_dependents()
        tid = cuda.threadIdx.x
        b = cuda.blockIdx.x
        bv = NEG
        bi = int32(V)
        for i in range(b * THREADS + tid, V, NB * THREADS):
            v = logits[i]
            if v > bv:  # i increases along the loop: '>' keeps the first of equal values
                bv = v
                bi = i
        for off in (16, 8, 4, 2, 1):
            ov = cuda.shfl_xor_sync(0xFFFFFFFF, bv, off)
            oi = cuda.shfl_xor_sync(0xFFFFFFFF, bi, off)
            if ov > bv or (ov == bv and oi < bi):
                bv = ov
                bi = oi
        if tid % 32 == 0:
            sv[tid // 32] = bv
            si[tid // 32] = bi
        cuda.syncthreads()
        if tid == 0:
            for j in range(1, NW):
                if sv[j] > bv or (sv[j] == bv and si[j] < bi):
                    bv = sv[j]
                    bi = si[j]
            part_val[b] = bv
            part_idx[b] = bi
            cuda.threadfence()
            last[0] = cuda.atomic.add(ticket, 0, 1) == NB - 1
        cuda.syncthreads()
        if last[0] and tid < 32:
            bv = NEG
            bi = int32(V)
            for j in range(tid, NB, 32):
                v = cuda.atomic.add(part_val, j, float32(0.0))
                k = cuda.atomic.add(part_idx, j, int32(0))
                if v > bv or (v == bv and k < bi):
                    bv = v
                    bi = k
            for off in (16, 8, 4, 2, 1):
                ov = cuda.shfl_xor_sync(0xFFFFFFFF, bv, off)
                oi = cuda.shfl_xor_sync(0xFFFFFFFF, bi, off)
                if ov > bv or (ov == bv and oi < bi):
                    bv = ov
                    bi = oi
            if tid == 0:
                step = state[STATE_STEP]
                out_ids[step % out_ids.shape[0]] = bi
                state[STATE_TOKEN] = bi
                state[STATE_POS] += 1
                state[STATE_STEP] = step + 1
                ticket[0] = 0

    return argmax


ARGMAX_SIG = "void(float32[::1], int32[::1], int32[::1], float32[::1], int32[::1], int32[::1])"


@functools.cache
def argmax_kernel(vocab: int):
    """argmax compiled for sm_90, named argmax_v{vocab}."""
    return compile_kernel(argmax_body(vocab), ARGMAX_SIG, kernel_name("argmax", v=vocab))


def argmax_workspace():
    """Device scratch: part_val (NB,) f32, part_idx (NB,) int32, ticket (1,) int32 = 0."""
    from numba import cuda
    return (cuda.device_array(NB, np.float32), cuda.device_array(NB, np.int32),
            cuda.to_device(np.zeros(1, np.int32)))


def argmax_launcher(logits, state, out_ids, workspace):
    """Check shapes once; return `launch(stream=0)` (see the module doc for its effect)."""
    if logits.dtype != np.float32 or len(logits.shape) != 1:
        raise ValueError(f"argmax: logits is {logits.dtype}{tuple(logits.shape)}, want float32 (vocab,)")
    if state.dtype != np.int32 or out_ids.dtype != np.int32:
        raise ValueError("argmax: state and out_ids must be int32")
    part_val, part_idx, ticket = workspace
    kern = argmax_kernel(int(logits.shape[0]))

    def launch(stream=0):
        kern[NB, THREADS, stream](logits, state, out_ids, part_val, part_idx, ticket)

    return launch
