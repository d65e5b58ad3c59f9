"""Block-wide building blocks of the sampler's last blocks: key transforms, an inclusive scan,
a first-crossing search and a bitonic sort, all in shared memory.

Plain Python bodies wrapped by the kernel factory with `dev` (force-inlined device functions).
They use shared memory and __syncthreads only (no warp shuffles), so the CUDA simulator runs
them unchanged; they run in one block a step, where a shuffle version would save ~1 us.
Every one is called by all threads of the block, with the same arguments where they say so.
"""
from __future__ import annotations

from numba import cuda
from numba.cuda.types import int64

from nq.ptx import mov_b32_f32_from_u32, mov_b32_u32_from_f32

SIGN = 0x80000000
MASK32 = 0xFFFFFFFF


def key_of(x):
    """fp32 -> order-preserving 32-bit key in an int64 (-0.0 read as +0.0; x is not NaN)."""
    b = int64(mov_b32_u32_from_f32(x))
    if b == SIGN:
        b = 0
    return MASK32 - b if b >= SIGN else b + SIGN


def value_of(k):
    """The fp32 a key came from."""
    b = k - SIGN if k >= SIGN else MASK32 - k
    return mov_b32_f32_from_u32(b)


def block_scan(buf, n_per, tot, tid, nthreads):
    """In-place inclusive prefix sum of buf[0 : n_per * nthreads] (int32 or int64 smem); tot is
    a scratch smem array of nthreads of the same dtype.  Thread t owns n_per consecutive
    entries: a sequential scan of its own, a Hillis-Steele scan of the thread totals, then its
    exclusive offset added back."""
    base = tid * n_per
    acc = buf[base]
    for j in range(1, n_per):
        acc += buf[base + j]
        buf[base + j] = acc
    tot[tid] = acc
    cuda.syncthreads()
    off = 1
    while off < nthreads:
        v = tot[tid - off] if tid >= off else tot[tid] * 0
        cuda.syncthreads()
        tot[tid] += v
        cuda.syncthreads()
        off *= 2
    if tid > 0:
        add = tot[tid - 1]
        for j in range(n_per):
            buf[base + j] += add
    cuda.syncthreads()


def block_max(buf, v, tid, nthreads):
    """max of v over the block (every thread gets it): a shared-memory tree over buf (smem of
    nthreads, a power of two).  64-bit shared atomics are compare-and-swap loops on sm_90: 256
    threads racing on one word cost ~10 us, the tree ~0.3 us."""
    buf[tid] = v
    cuda.syncthreads()
    half = nthreads >> 1
    while half > 0:
        if tid < half:
            buf[tid] = max(buf[tid], buf[tid + half])
        cuda.syncthreads()
        half >>= 1
    out = buf[0]
    cuda.syncthreads()
    return out


def bitonic_sort_desc(buf, n, tid, nthreads):
    """Sort buf[0:n] (int64 smem, n a power of two, same n in every thread) into descending
    order: log2(n) * (log2(n) + 1) / 2 compare-exchange stages, one __syncthreads each."""
    size = 2
    while size <= n:
        stride = size // 2
        while stride > 0:
            low = stride - 1                 # stride is a power of two: no integer division
            for t in range(tid, n >> 1, nthreads):
                i = ((t & ~low) << 1) | (t & low)
                j = i + stride
                a = buf[i]
                b = buf[j]
                # blocks with (i & size) == 0 go descending, the others ascending; the last
                # merge (size == n) is all descending
                if (a < b) == ((i & size) == 0):
                    buf[i] = b
                    buf[j] = a
            cuda.syncthreads()
            stride >>= 1
        size <<= 1
