"""Memory: 16-byte global loads (read-only path) and stores, L2 policies, shared addresses.

A GEMV streams each weight byte exactly once, so what matters is bytes in flight per
instruction: one `ld.global.nc.v4.u32` moves 16 bytes (32 INT4 weights).  numba's array
indexing emits 4-byte scalar loads and cannot promise the non-coherent (read-only, `.nc`)
path; these wrappers can.  The address is `arr[idx]` of any array (1-d: an int index, N-d: a
tuple) and must be 16-byte aligned -- for a uint32 array, idx a multiple of 4 from a
128-byte-aligned base (every .nanoqwen tensor and every numba device allocation is).

`.nc` loads are emitted as read-only asm (effect="load"): LLVM may merge duplicates but
never moves them across a store or barrier.  Never use `.nc` on memory that the same kernel
(or a concurrent one) writes: the read-only path is not coherent with those writes.
"""
from __future__ import annotations

import numpy as np

from nq.ptx import _sim
from nq.ptx._asm import ptx

# createpolicy's result is an opaque 64-bit descriptor; the twin's stand-in value.
_TWIN_POLICY_EVICT_FIRST = np.uint64(0x10E0_0000_0000_0000)


def _bytes_at(arr, idx, n=16, align=None):
    """Writable uint8 view of the n bytes from arr[idx] on (twins only; arr C-contiguous),
    checking the alignment the instruction needs (n bytes unless given)."""
    a = np.asarray(getattr(arr, "_ary", arr))  # the simulator wraps arrays in FakeCUDAArray
    assert a.flags.c_contiguous, "the twins model C-contiguous arrays only"
    off = int(np.ravel_multi_index(idx if isinstance(idx, tuple) else (idx,), a.shape))
    off *= a.itemsize
    align = n if align is None else align
    assert (a.ctypes.data + off) % align == 0, f"{align}-byte access at a misaligned address"
    return a.reshape(-1).view(np.uint8)[off:off + n]


def _u32x4(arr, idx):
    w = _bytes_at(arr, idx).view(np.uint32)
    return (w[0], w[1], w[2], w[3])


@ptx("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];",
     out=("u32",) * 4, args=("arr", "idx"), effect="load")
def ld_global_nc_v4_u32(arr, idx):
    """`ld.global.nc.v4.u32 {d0, d1, d2, d3}, [&arr[idx]];` -- 16 bytes via the read-only path.

    Returns 4 uint32 in memory order.  &arr[idx] must be 16-byte aligned (misaligned
    addresses fault on the GPU with "misaligned address").
    """
    return _u32x4(arr, idx)


@ptx("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];",
     out=("u32",) * 4, args=("arr", "idx"), effect="load")
def ld_global_nc_na_v4_u32(arr, idx):
    """`ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {d0..d3}, [&arr[idx]];` -- streaming load.

    Same result as ld_global_nc_v4_u32.  `.L1::no_allocate` keeps weights that are read once
    from evicting the activations in L1; `.L2::256B` asks L2 to fetch the whole 256-byte
    sector group, which a warp reading consecutive 16-byte chunks uses entirely (sm_80+).
    """
    return _u32x4(arr, idx)


@ptx("ld.global.nc.v2.u32 {%0, %1}, [%2];", out=("u32",) * 2, args=("arr", "idx"), effect="load")
def ld_global_nc_v2_u32(arr, idx):
    """`ld.global.nc.v2.u32 {d0, d1}, [&arr[idx]];` -- 8 bytes (four fp16), 8-byte aligned."""
    w = _bytes_at(arr, idx, 8).view(np.uint32)
    return (w[0], w[1])


@ptx("ld.global.nc.u32 %0, [%1];", out="u32", args=("arr", "idx"), effect="load")
def ld_global_nc_u32(arr, idx):
    """`ld.global.nc.u32 d, [&arr[idx]];` -- 4 bytes (two fp16), 4-byte aligned, read-only:
    a pair where the 8-byte load's neighbours are not wanted (gemv_digits' norm weights and
    fp16 activations, pairs 4 apart)."""
    return _bytes_at(arr, idx, 4).view(np.uint32)[0]


@ptx("ld.global.nc.v4.f32 {%0, %1, %2, %3}, [%4];", out=("f32",) * 4, args=("arr", "idx"),
     effect="load")
def ld_global_nc_v4_f32(arr, idx):
    """`ld.global.nc.v4.f32 {f0..f3}, [&arr[idx]];` -- four float32, 16-byte aligned, read-only."""
    w = _bytes_at(arr, idx).view(np.float32)
    return (w[0], w[1], w[2], w[3])


@ptx("ld.global.nc.v2.f32 {%0, %1}, [%2];", out=("f32",) * 2, args=("arr", "idx"), effect="load")
def ld_global_nc_v2_f32(arr, idx):
    """`ld.global.nc.v2.f32 {f0, f1}, [&arr[idx]];` -- two float32, 8-byte aligned, read-only."""
    w = _bytes_at(arr, idx, 8).view(np.float32)
    return (w[0], w[1])


@ptx("ld.global.nc.u16 %0, [%1];", out="u16", args=("arr", "idx"), effect="load")
def ld_global_nc_u16(arr, idx):
    """`ld.global.nc.u16 h, [&arr[idx]];` -- 2 bytes (an fp16's bits) via the read-only path,
    without numba's negative-index wraparound code."""
    return _bytes_at(arr, idx, 2).view(np.uint16)[0]


@ptx("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;", out="u64")
def createpolicy_evict_first_b64():
    """`createpolicy.fractional.L2::evict_first.b64 policy, 1.0;` -- an L2 policy descriptor.

    For ld_global_nc_hint_v4_u32: weights marked evict_first leave L2 before the KV cache and
    activations do.  Create it once per thread outside the loop (it is one instruction, but the
    64-bit result costs two registers).  The twin's value is a stand-in: the encoding is opaque.
    """
    return _TWIN_POLICY_EVICT_FIRST


@ptx("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %6;",
     out=("u32",) * 4, args=("arr", "idx", "u64"), effect="load")
def ld_global_nc_hint_v4_u32(arr, idx, policy):
    """`ld.global.nc.L2::cache_hint.v4.u32 {d0..d3}, [&arr[idx]], policy;` -- load with an L2 policy.

    Same result as ld_global_nc_v4_u32; policy comes from createpolicy_evict_first_b64.
    """
    return _u32x4(arr, idx)


@ptx("st.global.v4.u32 [%0], {%2, %3, %4, %5};",
     args=("arr", "idx", "u32", "u32", "u32", "u32"), effect="memory")
def st_global_v4_u32(arr, idx, a, b, c, d):
    """`st.global.v4.u32 [&arr[idx]], {a, b, c, d};` -- one 16-byte store.

    &arr[idx] must be 16-byte aligned.  The four words land in memory order; arr may be of
    any dtype (a float32 array receives the bit patterns).
    """
    words = np.array([int(v) & 0xFFFFFFFF for v in (a, b, c, d)], dtype=np.uint32)
    _bytes_at(arr, idx)[:] = words.view(np.uint8)


@ptx("st.global.u16 [%0], %2;", args=("arr", "idx", "u16"), effect="memory")
def st_global_u16(arr, idx, h):
    """`st.global.u16 [&arr[idx]], h;` -- store fp16 bits (from cvt_rn_f16_f32) into any array
    (an fp16 array included, which numba would otherwise convert the value for)."""
    _bytes_at(arr, idx, 2).view(np.uint16)[0] = np.uint16(int(h) & 0xFFFF)


@ptx("{ .reg .u64 nq_sa; cvta.to.shared.u64 nq_sa, %4; "
     "ld.shared.v4.u32 {%0, %1, %2, %3}, [nq_sa]; }",
     out=("u32",) * 4, args=("arr", "idx"), effect="load")
def ld_shared_v4_u32(arr, idx):
    """`cvta.to.shared.u64 a, &arr[idx]; ld.shared.v4.u32 {d0..d3}, [a];` -- 16 bytes of shared.

    arr must be a cuda.shared.array and &arr[idx] 16-byte aligned.  numba's indexing emits
    four 4-byte loads (NVVM cannot always prove the alignment); a GEMV reads its activations
    from shared once per 8 weights, so the width matters.  Read-only asm: order it after the
    stores with cuda.syncthreads() (LLVM never moves it across one).
    """
    return _u32x4(arr, idx)


@ptx("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];", out=("u32",) * 4, args=("u32",), effect="load")
def ld_shared_v4_u32_at(addr):
    """`ld.shared.v4.u32 {d0..d3}, [addr];` -- ld_shared_v4_u32 at a 32-bit shared address.

    addr comes from cvta_to_shared_u32(arr) plus a byte offset (16-byte aligned).  The address
    arithmetic stays 32-bit, so ptxas folds a constant offset into the load (`LDS.128 R, [R+imm]`):
    with &arr[idx], each load paid a 64-bit add (3 instructions), 48 of down's ~380 a step.
    """
    return tuple(_sim.shared_bytes(addr, 16).view(np.uint32))


@ptx("st.shared.u8 [%0], %1;", args=("u32", "u16"), effect="memory")
def st_shared_u8_at(addr, b):
    """`st.shared.u8 [addr], b;` -- one byte (b's low 8 bits) at a 32-bit shared address, from
    cvta_to_shared_u32(arr) plus a byte offset: whatever arr's element type (the tensor-core
    GEMV's digits, gemv_mma "i8", land in a word array)."""
    _sim.shared_bytes(addr, 1)[0] = np.uint8(int(b) & 0xFF)


@ptx("ld.shared.v2.u32 {%0, %1}, [%2];", out=("u32",) * 2, args=("u32",), effect="load")
def ld_shared_v2_u32_at(addr):
    """`ld.shared.v2.u32 {d0, d1}, [addr];` -- 8 bytes of shared at a 32-bit address (8-aligned):
    the tensor-core GEMV's B fragment (two fp16 pairs) in one load."""
    return tuple(_sim.shared_bytes(addr, 8).view(np.uint32))


@ptx("{ .reg .u64 nq_sa; cvta.to.shared.u64 nq_sa, %4; "
     "ld.shared.v4.f32 {%0, %1, %2, %3}, [nq_sa]; }",
     out=("f32",) * 4, args=("arr", "idx"), effect="load")
def ld_shared_v4_f32(arr, idx):
    """`cvta.to.shared.u64 a, &arr[idx]; ld.shared.v4.f32 {f0..f3}, [a];` -- four float32 of shared.

    The fp32 twin of ld_shared_v4_u32, for the lm_head, which keeps its staged activations in
    fp32; same alignment and ordering rules.
    """
    w = _bytes_at(arr, idx).view(np.float32)
    return (w[0], w[1], w[2], w[3])


@ptx("{ .reg .u64 nq_s; cvta.to.shared.u64 nq_s, %1; cvt.u32.u64 %0, nq_s; }",
     out="u32", args=("base",))
def cvta_to_shared_u32(arr):
    """`cvta.to.shared.u64 s, &arr[0]; cvt.u32.u64 d, s;` -- arr's address in the shared window.

    arr must be a cuda.shared.array (or a slice of one).  mbarrier, cp.async.bulk and ldmatrix
    address shared memory by this 32-bit offset; add byte offsets to it for other elements.
    Compute it once per kernel: it costs two instructions.  Under the simulator it is a
    stand-in address that the other twins map back to the numpy buffer (nq/ptx/_sim.py).
    """
    return _sim.shared_address(arr)


@ptx("{ .reg .u64 nq_s; cvta.to.shared.u64 nq_s, %1; cvt.u32.u64 %0, nq_s; }",
     out="u32", args=("arr", "idx"))
def cvta_to_shared_u32_at(arr, idx):
    """cvta_to_shared_u32 for element arr[idx] (an int, or a tuple for an N-d shared array)."""
    a = np.asarray(getattr(arr, "_ary", arr))
    off = int(np.ravel_multi_index(idx if isinstance(idx, tuple) else (idx,), a.shape))
    return np.uint32(int(_sim.shared_address(arr)) + off * a.itemsize)
