"""One warpgroup, one 64 x N x 32 product through nq/ptx/wgmma.py (two k16 wgmmas into the same
accumulators), for the GPU test, the simulator test and the compile test.

The host lays A (64 x 32) and B (N x 32, K-major) out in a shared-memory image exactly as
`nq.ptx.wgmma.smem_offset` models the descriptor's layout (swizzle none or 128B), the kernel
copies the image verbatim to a 1024-byte-aligned spot of shared memory and issues:

    fence; wgmma(k 0..15, scale_d = 0); wgmma(k 16..31, scale_d = 1); commit; wait 0

with accumulators initialised to 1e6 (scale_d = 0 must ignore them).  The second k16 step
advances each descriptor's start by STEP bytes (32 inside a 128B-swizzled row; two core
matrices = 2 LBO without swizzle).  Values are multiples of 1/8 in [-1, 1]: every product and
sum is exact in fp32, so the result must equal NumPy's bit for bit.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint32, uint64

from nq.ptx import cvta_to_shared_u32, fence_proxy_async_shared
from nq.ptx.wgmma import (SWIZZLE_128B, SWIZZLE_NONE, a_fragment_coords, d_coords, desc_hi,
                          smem_offset, wgmma_commit_group, wgmma_fence_acc, wgmma_rs, wgmma_ss,
                          wgmma_wait_group_acc)

K = 32


def layout(swizzle, rows):
    """(lbo, sbo, step bytes, bytes) of a K-major rows x 32 fp16 operand in the probe."""
    if swizzle == SWIZZLE_NONE:
        # core matrix (8 rows x 8 k) = 128 contiguous bytes; the 4 along K adjacent (LBO 128),
        # the next 8 rows 512 bytes on (SBO)
        return 128, 512, 256, rows * K * 2
    assert swizzle == SWIZZLE_128B
    # rows of 128 bytes (64 k, of which the probe fills 32), 8-row atoms of 1024 bytes
    return 16, 1024, 32, rows * 128


def build_kernel(n: int, form: str, swizzle: int):
    """The probe kernel for width n, A from registers ("rs") or shared memory ("ss")."""
    NA = n // 2
    RS = form == "rs"
    mma = wgmma_rs(n) if RS else wgmma_ss(n)
    fence = wgmma_fence_acc(NA)
    wait = wgmma_wait_group_acc(NA)
    lbo, sbo, STEP, _ = layout(swizzle, n)
    HI = desc_hi(lbo, sbo, swizzle)

    def probe(img, a_regs, b_off, a_off, d):
        sm = cuda.shared.array(0, uint32)
        base = cvta_to_shared_u32(sm)
        pad = ((base + 1023) & 0xFFFFFC00) - base          # 1024-aligned image
        tid = cuda.threadIdx.x
        for i in range(tid, img.size, 128):
            sm[pad // 4 + i] = img[i]
        fence_proxy_async_shared()                          # st.shared -> the async proxy
        cuda.syncthreads()
        acc = cuda.local.array(NA, float32)
        for j in range(NA):
            acc[j] = float32(1e6)
        a0 = a_regs[tid, 0]
        a1 = a_regs[tid, 1]
        a2 = a_regs[tid, 2]
        a3 = a_regs[tid, 3]
        a4 = a_regs[tid, 4]
        a5 = a_regs[tid, 5]
        a6 = a_regs[tid, 6]
        a7 = a_regs[tid, 7]
        sb = base + pad + b_off
        sa = base + pad + a_off
        db0 = uint64(HI) | uint64((sb >> 4) & 0x3FFF)
        db1 = uint64(HI) | uint64(((sb + STEP) >> 4) & 0x3FFF)
        da0 = uint64(HI) | uint64((sa >> 4) & 0x3FFF)
        da1 = uint64(HI) | uint64(((sa + STEP) >> 4) & 0x3FFF)
        fence(acc)
        if RS:
            mma(acc, a0, a1, a2, a3, db0, 0)
            mma(acc, a4, a5, a6, a7, db1, 1)
        else:
            mma(acc, da0, db0, 0)
            mma(acc, da1, db1, 1)
        wgmma_commit_group()
        wait(acc, 0)
        for j in range(NA):
            d[tid, j] = acc[j]

    sig = "void(uint32[::1], uint32[:, ::1], uint32, uint32, float32[:, ::1])"
    return probe, sig


def operands(n: int, seed: int):
    rng = np.random.default_rng(seed)
    a = (rng.integers(-8, 9, (64, K)) / 8).astype(np.float16)
    b = (rng.integers(-8, 9, (n, K)) / 8).astype(np.float16)
    return a, b


def host_inputs(n: int, swizzle: int, a, b):
    """(image uint32, a_regs (128, 8) uint32, b_off, a_off): B at 0, A after it."""
    _, _, step, bbytes = layout(swizzle, n)
    lbo, sbo, _, abytes = layout(swizzle, 64)
    a_off = -(-bbytes // 1024) * 1024
    img = np.zeros(a_off + abytes, np.uint8)
    for mat, start, rows in ((b, 0, n), (a, a_off, 64)):
        bits = mat.view(np.uint16)
        for s in range(2):
            r, k = np.meshgrid(np.arange(rows), np.arange(16), indexing="ij")
            addr = smem_offset(r, k, lbo, sbo, swizzle, start + s * step)
            v = bits[:, 16 * s:16 * s + 16]
            img[addr] = (v & 0xFF).astype(np.uint8)
            img[addr + 1] = (v >> 8).astype(np.uint8)
    regs = np.zeros((128, 8), np.uint32)
    bits = a.view(np.uint16)
    for th in range(128):
        for s in range(2):
            for reg in range(4):
                lo = bits[a_fragment_coords(th, reg, 0)[0], 16 * s + a_fragment_coords(th, reg, 0)[1]]
                hi = bits[a_fragment_coords(th, reg, 1)[0], 16 * s + a_fragment_coords(th, reg, 1)[1]]
                regs[th, 4 * s + reg] = int(lo) | (int(hi) << 16)
    return img.view(np.uint32).copy(), regs, 0, a_off


def to_matrix(d, n: int) -> np.ndarray:
    """(128, N/2) accumulators by thread -> the 64 x N D."""
    out = np.zeros((64, n), np.float32)
    for th in range(128):
        for j in range(n // 2):
            out[d_coords(th, j)] = d[th, j]
    return out


def run(n: int, form: str, swizzle: int, seed: int = 0):
    """(got, want) 64 x N on the current target (GPU, or the simulator)."""
    from nq.kernels.build import compile_kernel
    from nq.kernels.common import allow_smem
    body, sig = build_kernel(n, form, swizzle)
    kern = compile_kernel(body, sig, f"wgmma_probe_n{n}_{form}_sw{swizzle}",
                          launch_bounds=(128,))
    a, b = operands(n, seed)
    img, regs, b_off, a_off = host_inputs(n, swizzle, a, b)
    smem = img.nbytes + 1024
    allow_smem(kern, smem)
    d = cuda.device_array((128, n // 2), np.float32)
    kern[1, 128, 0, smem](cuda.to_device(img), cuda.to_device(regs), np.uint32(b_off),
                          np.uint32(a_off), d)
    got = to_matrix(d.copy_to_host(), n)
    want = (a.astype(np.float64) @ b.astype(np.float64).T).astype(np.float32)
    return got, want


def describe_mismatch(got, want, limit=8) -> str:
    bad = np.argwhere(got != want)
    lines = [f"{len(bad)} of {got.size} elements differ; first ones (row = A row m, col = "
             f"B row n):"]
    for m, c in bad[:limit]:
        lines.append(f"  D[{m}, {c}] = {got[m, c]!r}, want {want[m, c]!r}")
    return "\n".join(lines)
