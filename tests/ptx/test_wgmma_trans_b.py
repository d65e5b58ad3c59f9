"""nq/ptx/wgmma.py's trans-b wgmma (`wgmma_rs_tb`: B MN-major, N contiguous) and its layout
model `smem_offset_mn`: the model on its own, a one-warpgroup probe under the simulator (the
twin reads what the host laid out by the model) and compiled for sm_90a with ptxas accepting
it, and the same probe on the GPU (marked gpu), which is what proves the model is the
hardware's: prefill attention's V descriptor (LBO = the next 64 dims, SBO = 8 keys) rests on it.

The probe: D (64 x N) = A (64 x 32, registers) . B (32 x N, stored [k][n]), two k16 wgmmas,
the second at the descriptor's start + one k16 step, accumulators preset to 1e6 (scale-d 0
must drop them).  Values are multiples of 1/8 in [-1, 1], so every sum is exact and the result
must equal NumPy's bit for bit."""
import textwrap

import numpy as np
import pytest
from numba import cuda  # a module global: the simulator swaps it for its fake module

import nq.ptx as P
from nq.ptx import wgmma as G

ptx_util = pytest.importorskip("ptx_util")

K = 32


def layout(swizzle, n):
    """(lbo, sbo, k16 step bytes, image bytes) of the probe's B (32 k x n) MN-major."""
    if swizzle == G.SWIZZLE_NONE:
        # core matrices of 8 k x 8 n (16-byte k rows); k's 4 blocks adjacent (LBO 128), n's
        # 8-column blocks 512 apart (SBO)
        return 128, 512, 256, (n // 8) * 512
    assert swizzle == G.SWIZZLE_128B
    # k rows of 128 bytes (64 n); the 32 k rows of n 0..63 then those of n 64..127 (LBO)
    return K * 128, 1024, 16 * 128, max(1, n // 64) * K * 128


def host_image(n, swizzle, b):
    """uint32 shared-memory image of b (32, n) fp16 in the layout the descriptor names."""
    lbo, sbo, step, nbytes = layout(swizzle, n)
    img = np.zeros(nbytes, np.uint8)
    bits = b.view(np.uint16)
    for s in range(2):
        nn, k = np.meshgrid(np.arange(n), np.arange(16), indexing="ij")
        addr = G.smem_offset_mn(nn, k, lbo, sbo, swizzle, s * step)
        v = bits[16 * s + k, nn]
        img[addr] = (v & 0xFF).astype(np.uint8)
        img[addr + 1] = (v >> 8).astype(np.uint8)
    return img.view(np.uint32).copy()


def a_registers(a):
    regs = np.zeros((128, 8), np.uint32)
    bits = a.view(np.uint16)
    for th in range(128):
        for s in range(2):
            for reg in range(4):
                (r0, k0), (r1, k1) = (G.a_fragment_coords(th, reg, h) for h in range(2))
                lo, hi = int(bits[r0, 16 * s + k0]), int(bits[r1, 16 * s + k1])
                regs[th, 4 * s + reg] = lo | (hi << 16)
    return regs


def operands(n, seed):
    rng = np.random.default_rng(seed)
    a = (rng.integers(-8, 9, (64, K)) / 8).astype(np.float16)
    b = (rng.integers(-8, 9, (K, n)) / 8).astype(np.float16)
    return a, b


def build_probe(n, swizzle):
    from numba import float32, uint32, uint64

    from nq.ptx import cvta_to_shared_u32, fence_proxy_async_shared
    NA = n // 2
    mma = G.wgmma_rs_tb(n)
    fence = G.wgmma_fence_acc(NA)
    wait = G.wgmma_wait_group_acc(NA)
    lbo, sbo, STEP, _ = layout(swizzle, n)
    HI = G.desc_hi(lbo, sbo, swizzle)

    def probe(img, a_regs, d):
        sm = cuda.shared.array(0, uint32)
        base = cvta_to_shared_u32(sm)
        pad = ((base + 1023) & 0xFFFFFC00) - base          # 1024-aligned image
        tid = cuda.threadIdx.x
        for i in range(tid, img.size, 128):
            sm[pad // 4 + i] = img[i]
        fence_proxy_async_shared()
        cuda.syncthreads()
        acc = cuda.local.array(NA, float32)
        for j in range(NA):
            acc[j] = float32(1e6)
        sb = base + pad
        db0 = uint64(HI) | uint64((sb >> 4) & 0x3FFF)
        db1 = uint64(HI) | uint64(((sb + STEP) >> 4) & 0x3FFF)
        fence(acc)
        mma(acc, a_regs[tid, 0], a_regs[tid, 1], a_regs[tid, 2], a_regs[tid, 3], db0, 0)
        mma(acc, a_regs[tid, 4], a_regs[tid, 5], a_regs[tid, 6], a_regs[tid, 7], db1, 1)
        G.wgmma_commit_group()
        wait(acc, 0)
        for j in range(NA):
            d[tid, j] = acc[j]

    return probe, "void(uint32[::1], uint32[:, ::1], float32[:, ::1])"


def run(n, swizzle, seed=0):
    """(got, want): the probe's D (64 x N) on the current target (GPU, or the simulator), and
    NumPy's."""
    from nq.kernels.build import compile_kernel
    from nq.kernels.common import allow_smem
    a, b = operands(n, seed)
    img = host_image(n, swizzle, b)
    body, sig = build_probe(n, swizzle)
    kern = compile_kernel(body, sig, f"wgmma_tb_probe_n{n}_sw{swizzle}", launch_bounds=(128,))
    smem = img.nbytes + 1024
    allow_smem(kern, smem)
    d = cuda.to_device(np.zeros((128, n // 2), np.float32))
    kern[1, 128, 0, smem](cuda.to_device(img), cuda.to_device(a_registers(a)), d)
    got = d.copy_to_host()
    out = np.zeros((64, n), np.float32)
    for th in range(128):
        for j in range(n // 2):
            out[G.d_coords(th, j)] = got[th, j]
    return out, (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)


# ---- the model ----------------------------------------------------------------------------------

def test_mn_major_model():
    """Swizzle none: a 16 k x 64 n operand (LBO 128, SBO 256) fills 2 KB exactly, each core
    matrix 8 k rows of 16 bytes.  128B: the 128-byte rows are k's, 64 n each -- the tile a
    [key][dim] copy writes, chunk n // 8 of row k at (n // 8) ^ (k % 8) -- and the next 64 n
    LBO on; a k16 step is 16 rows (2048 bytes) on."""
    n, k = np.meshgrid(np.arange(64), np.arange(16), indexing="ij")
    a = G.smem_offset_mn(n, k, 128, 256, G.SWIZZLE_NONE)
    assert sorted(a.reshape(-1).tolist()) == list(range(0, 2048, 2))
    assert np.array_equal(a[:8, :8], (np.arange(8)[None, :] * 16 + np.arange(8)[:, None] * 2))
    n, k = np.meshgrid(np.arange(128), np.arange(16), indexing="ij")
    for step in range(2):
        a = G.smem_offset_mn(n, k, 8192, 1024, G.SWIZZLE_128B, start=2048 * step)
        kk = k + 16 * step
        want = ((n // 64) * 8192 + kk * 128 + 16 * (((n % 64) // 8) ^ (kk % 8)) + (n % 8) * 2)
        assert np.array_equal(a, want)


def test_trans_b_wrapper_text():
    w = G.wgmma_rs_tb(64)
    assert w.__name__ == "wgmma_m64n64k16_f32_f16_rs_tb"
    assert w.ptx_template.rstrip("}\n ").endswith("p, 1, 1, 1;")
    assert G.wgmma_rs(64).ptx_template.rstrip("}\n ").endswith("p, 1, 1, 0;")
    assert G.wgmma_rs_tb(64, 32) is G.wgmma_rs_tb(64, 32) is not G.wgmma_rs(64, 32)


# ---- the twin under the simulator; the PTX offline ---------------------------------------------

@pytest.mark.slow
def test_twin_under_the_simulator():
    """N = 128 with 128B (two 64-wide halves: LBO is read) and N = 16 without swizzle."""
    script = textwrap.dedent("""
        import sys; sys.path.insert(0, "tests"); sys.path.insert(0, "tests/ptx")
        import numpy as np
        import test_wgmma_trans_b as T
        for n, sw in ((128, 1), (16, 0)):
            got, want = T.run(n, sw, seed=n)
            print(f"n{n}sw{sw}", float(np.abs(got - want).max()))
        """)
    values, out = ptx_util.run_under_simulator(script, timeout=300)
    assert values == {"n128sw1": 0.0, "n16sw0": 0.0}, out


@pytest.mark.skipif(P.SIMULATOR, reason="the simulator compiles nothing")
@pytest.mark.parametrize("n", [64, 128])
def test_compiles_for_sm90a_and_ptxas_accepts(n):
    body, sig = build_probe(n, G.SWIZZLE_128B)
    ptx = ptx_util.compile_ptx_sm90(body, sig, cc=ptx_util.SM90A)
    ins = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16"
    assert ptx_util.count(ptx, ins) == 2 and ptx.count("p, 1, 1, 1;") == 2
    ptx_util.assert_no_local_memory(ptx)
    if not ptx_util.have_ptxas():
        pytest.skip("no ptxas / nvJitLink here")
    log = ptx_util.ptxas_log(ptx)
    _, spills = ptx_util.ptxas_report(ptx)
    assert spills == 0 and "serialized" not in log, log


# ---- the hardware --------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("n,swizzle", [(128, G.SWIZZLE_128B), (64, G.SWIZZLE_128B),
                                       (128, G.SWIZZLE_NONE), (16, G.SWIZZLE_NONE)])
def test_trans_b_on_the_gpu(n, swizzle):
    import wgmma_probe
    got, want = run(n, swizzle, seed=n + swizzle)
    assert np.array_equal(got, want), (
        f"m64n{n}k16 trans-b swizzle {swizzle}:\n" + wgmma_probe.describe_mismatch(got, want))
