"""What every kernel family shares: the shared-memory limits, launcher argument checks, the
dynamic shared-memory opt-in, and the device-function bodies (warp butterflies, RMSNorm's
block tail, the fp16 and int8 lm_heads' row loads: `row_chunk_loads`; the fp16 head's staging and
row dot, which its INT4 sibling's rescoring shares: `head_parts`).

Limits (sm_90):
    STATIC_SMEM_LIMIT  48 KiB: static shared memory numba can give a block (no opt-in exists
                       for static arrays), and dynamic memory a launch gets without opting in
    SMEM_OPTIN_LIMIT   227 KiB: static + dynamic shared memory of one block once the kernel
                       has opted in (`allow_smem`)

The device bodies:

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

import numpy as np
from numba import cuda, float32

from nq.ptx import SIMULATOR, ld_global_nc_v4_u32, ld_shared_v4_f32, unpack_f16x2_to_f32

try:  # numba warns on every launch of a grid under 128 blocks, building the message each time;
    # nq's small grids (embed, argmax, attention at short context, a short prompt's GEMMs) are
    # that size on purpose, and the warning reached users' terminals (its ANSI-coloured text
    # escaped cli.py's filter).  Off for the process, which also spares the launch path.
    from numba.cuda.core import config as _numba_config
    _numba_config.CUDA_LOW_OCCUPANCY_WARNINGS = 0
except ImportError:  # another numba-cuda layout: the warning stays, harmless
    pass

FULL = 0xFFFFFFFF
STATIC_SMEM_LIMIT = 48 * 1024
SMEM_OPTIN_LIMIT = 227 * 1024


# ---- launcher helpers ---------------------------------------------------------------------------

def device_addr(a) -> int:
    """The address a (device or simulator) array's data starts at."""
    cai = getattr(a, "__cuda_array_interface__", None)
    return cai["data"][0] if cai else np.asarray(getattr(a, "_ary", a)).ctypes.data


def need(a, what, dtype, shape, align=16) -> None:
    """Refuse an argument whose dtype, shape, contiguity or alignment a kernel cannot take."""
    if a.dtype != np.dtype(dtype) or tuple(a.shape) != tuple(shape):
        raise ValueError(f"{what}: expected {np.dtype(dtype)} {tuple(shape)}, got {a.dtype} {tuple(a.shape)}")
    contig = a.is_c_contiguous() if hasattr(a, "is_c_contiguous") else a.flags.c_contiguous
    if not contig:
        raise ValueError(f"{what}: must be C-contiguous")
    if device_addr(a) % align:
        raise ValueError(f"{what}: device address must be {align}-byte aligned")


def allow_smem(kernel, nbytes: int) -> None:
    """Opt the kernel into more than 48 KiB of dynamic shared memory (cuFuncSetAttribute);
    a no-op under the simulator."""
    if SIMULATOR:
        return
    if nbytes > SMEM_OPTIN_LIMIT:
        raise ValueError(f"{nbytes} bytes of shared memory: more than sm_90's {SMEM_OPTIN_LIMIT}")
    from numba.cuda.cudadrv import driver as drv
    from numba.cuda.cudadrv.driver import binding
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    kernel.nq_smem_bytes = int(nbytes)   # a kernel still compiling (build.parallel_compiles)
    for k in kernel.overloads.values():  # gets it when it is loaded
        fn = k._codelibrary.get_cufunc()
        drv.driver.cuKernelSetAttribute(attr, int(nbytes), fn.handle, fn.device.id)


def sm_count() -> int:
    """The current device's SM count; the H200's 132 where there is none (simulator, offline)."""
    try:
        return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
    except Exception:  # noqa: BLE001 -- no GPU here
        return 132


# ---- device-function bodies ----------------------------------------------------------------------

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


def loop_chunks(n_chunks: int, unroll: int) -> int:
    """How many 16-byte chunks a row's lane loop can name: `for c0 in range(0, ceil(n_chunks /
    32), unroll)` reaches chunk (c0 + u) * 32 + lane for u < unroll.  The chunks past n_chunks
    are skipped by a branch (row_chunk_loads' loads, the heads' shared reads), but the compiler
    may hoist a loop-invariant shared load above its branch (the H200 faulted on a 656-wide
    int8 head at unroll 8), so a staged copy of the activations needs room for all of them;
    their values are never used, so the padding needs no zeros."""
    per_lane = -(-n_chunks // 32)
    return -(-per_lane // unroll) * unroll * 32


def row_chunk_loads(n_chunks: int, unroll: int, per_chunk: int):
    """The device function load_u(weight, row, lane, c0) of a head whose rows are n_chunks
    16-byte chunks of per_chunk elements (fp16: 8, int8: 16): the 4-word loads of chunks
    (c0 + u) * 32 + lane for u < unroll (1..8), zeros past the row's end, as 8 tuples."""
    CH, U, E = n_chunks, unroll, per_chunk
    z = np.uint32(0)

    def load1(weight, row, c):
        if c < CH:
            return ld_global_nc_v4_u32(weight, (row, c * E))
        return (z, z, z, z)

    load1 = dev(load1)

    def load_u(weight, row, lane, c0):
        # written out for literal indices
        b = c0 * 32 + lane
        l0 = load1(weight, row, b)
        l1 = load1(weight, row, b + 32) if U > 1 else l0
        l2 = load1(weight, row, b + 64) if U > 2 else l0
        l3 = load1(weight, row, b + 96) if U > 3 else l0
        l4 = load1(weight, row, b + 128) if U > 4 else l0
        l5 = load1(weight, row, b + 160) if U > 5 else l0
        l6 = load1(weight, row, b + 192) if U > 6 else l0
        l7 = load1(weight, row, b + 224) if U > 7 else l0
        return l0, l1, l2, l3, l4, l5, l6, l7

    return dev(load_u)


def head_parts(k: int, threads: int, unroll: int):
    """The fp16 head's device functions, shared with the INT4 head's exact rescoring
    (lm_head_rescore.py), whose logits must be these bit for bit: (SH, stage, row_dot).

    stage(x, norm_w, hA, hB, red, eps, inv_k) -> h = rmsnorm(x) * norm_w in fp32 shared
    memory (SH floats in each of hA, hB; red: a float a warp), the block synced after;
    row_dot(weight, row, lane, hA, hB) -> the row's dot with h, summed over the warp (every
    lane gets it)."""
    if k % 8 or threads % 32:
        raise ValueError(f"lm_head: hidden={k} must be a multiple of 8, threads of 32")
    if not 1 <= unroll <= 8:
        raise ValueError("lm_head: unroll must be 1..8")
    CH = k // 8                  # 16-byte chunks per row
    NCL = -(-CH // 32)           # chunks per lane
    U = unroll
    # floats in each of hA, hB: 4 a chunk the lane loop can name (common.loop_chunks); the
    # 7B's 448 chunks are 14 x 32 with unroll 7, so its kernel is unchanged
    SH = loop_chunks(CH, U) * 4
    if 2 * SH * 4 + 64 > STATIC_SMEM_LIMIT:
        raise ValueError(f"lm_head: hidden={k} needs {2 * SH * 4} bytes of shared memory at "
                         f"unroll {unroll}; use a smaller unroll")
    WARPS = threads // 32

    def dot_chunk(w0, w1, w2, w3, hA, hB, c, acc):
        a0, a1, a2, a3 = ld_shared_v4_f32(hA, c * 4)
        b0, b1, b2, b3 = ld_shared_v4_f32(hB, c * 4)
        p0, p1 = unpack_f16x2_to_f32(w0)
        p2, p3 = unpack_f16x2_to_f32(w1)
        p4, p5 = unpack_f16x2_to_f32(w2)
        p6, p7 = unpack_f16x2_to_f32(w3)
        acc += p0 * a0 + p1 * a1 + p2 * a2 + p3 * a3
        return acc + (p4 * b0 + p5 * b1 + p6 * b2 + p7 * b3)

    dot_chunk, wsum, rstd_of = dev(dot_chunk), dev(warp_sum), dev(block_rstd)
    load_u = row_chunk_loads(CH, U, 8)

    def dot1(w, hA, hB, c, acc):
        if c < CH:
            return dot_chunk(w[0], w[1], w[2], w[3], hA, hB, c, acc)
        return acc

    def dot_u(ws, hA, hB, lane, c0, acc):
        b = c0 * 32 + lane
        l0, l1, l2, l3, l4, l5, l6, l7 = ws
        acc = dot1(l0, hA, hB, b, acc)
        if U > 1:
            acc = dot1(l1, hA, hB, b + 32, acc)
        if U > 2:
            acc = dot1(l2, hA, hB, b + 64, acc)
        if U > 3:
            acc = dot1(l3, hA, hB, b + 96, acc)
        if U > 4:
            acc = dot1(l4, hA, hB, b + 128, acc)
        if U > 5:
            acc = dot1(l5, hA, hB, b + 160, acc)
        if U > 6:
            acc = dot1(l6, hA, hB, b + 192, acc)
        if U > 7:
            acc = dot1(l7, hA, hB, b + 224, acc)
        return acc

    dot1, dot_u = dev(dot1), dev(dot_u)

    def x_rstd(x, red, eps, inv_k):
        tid = cuda.threadIdx.x
        ss = float32(0.0)
        for e in range(tid, k, threads):
            v = x[e]
            ss += v * v
        ss = wsum(ss)
        if (tid & 31) == 0:
            red[tid >> 5] = ss
        cuda.syncthreads()
        return rstd_of(red, WARPS, inv_k, eps)

    x_rstd = dev(x_rstd)

    def stage(x, norm_w, hA, hB, red, eps, inv_k):
        tid = cuda.threadIdx.x
        rstd = x_rstd(x, red, eps, inv_k)
        for e in range(tid, k, threads):
            h = (x[e] * rstd) * float32(norm_w[e])
            c = e >> 3
            if (e & 7) < 4:
                hA[c * 4 + (e & 3)] = h
            else:
                hB[c * 4 + (e & 3)] = h
        cuda.syncthreads()

    def row_dot(weight, row, lane, hA, hB):
        acc = float32(0.0)
        for c0 in range(0, NCL, U):
            # issue up to U 16-byte loads, then the math (U words x 4 in registers)
            ws = load_u(weight, row, lane, c0)
            acc = dot_u(ws, hA, hB, lane, c0, acc)
        return wsum(acc)

    return SH, dev(stage), dev(row_dot)
