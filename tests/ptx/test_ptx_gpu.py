"""Each nq.ptx wrapper on the GPU against its Python twin (the spec, see test_ptx_twins.py).

Run on the H200 with `python3 -m pytest -m gpu tests/test_ptx_gpu.py`.  Under the simulator
(`NUMBA_ENABLE_CUDASIM=1 python3 -m pytest -m gpu tests/test_ptx_gpu.py`) the wrappers are the
twins, so this checks the kernels' plumbing on small sizes, not the hardware.
"""
import numpy as np
import pytest
from numba import cuda

import nq.ptx as P
from nq.ptx import LUT_AND_OR, LUT_AND_XOR

pytestmark = pytest.mark.gpu

SIM = P.SIMULATOR
N = 256 if SIM else 1 << 16  # elements per test; the simulator runs ~1-5k threads/s
TPB = 64 if SIM else 256
RNG = np.random.default_rng(7)


def launch(kernel, n, *args):
    dev = [cuda.to_device(a) for a in args]
    kernel[(n + TPB - 1) // TPB, TPB](*dev)
    cuda.synchronize()
    return [d.copy_to_host() for d in dev]


def rand_u32(n):
    return RNG.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)


def rand_f16_bits(n):
    """Random fp16 bit patterns: all signs, subnormals, infinities; no NaN inputs."""
    h = RNG.integers(0, 2**16, n, dtype=np.uint32).astype(np.uint16)
    nan = (h & 0x7C00) == 0x7C00
    h[nan & ((h & 0x3FF) != 0)] &= np.uint16(0xFC00)  # NaN -> inf of the same sign
    return h


def rand_half2(n):
    return rand_f16_bits(2 * n).view(np.uint32)


def twin_map(f, *cols):
    return np.array([f(*row) for row in zip(*cols)])


def assert_half2_equal(got, want):
    """Bitwise equal, except that any NaN only has to be a NaN (payloads are not specified)."""
    g, w = got.view(np.uint16), want.astype(np.uint32).view(np.uint16)
    nan_w = np.isnan(w.view(np.float16))
    np.testing.assert_array_equal(g[~nan_w], w[~nan_w])
    assert np.isnan(g[nan_w].view(np.float16)).all()


# ---- permute ---------------------------------------------------------------------------------
@cuda.jit
def k_prmt(a, b, s, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = P.prmt_b32(a[i], b[i], s[i])


@cuda.jit
def k_prmt_const(a, b, s, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = P.prmt_b32(a[i], b[i], 0x5410) ^ P.prmt_b32(a[i], b[i], 0x8F1C)


def test_prmt():
    a, b, s = rand_u32(N), rand_u32(N), rand_u32(N)
    *_, out = launch(k_prmt, N, a, b, s, np.zeros(N, np.uint32))
    np.testing.assert_array_equal(out, twin_map(P.prmt_b32.twin, a, b, s))
    *_, out = launch(k_prmt_const, N, a, b, s, np.zeros(N, np.uint32))
    want = twin_map(lambda x, y: P.prmt_b32.twin(x, y, 0x5410) ^ P.prmt_b32.twin(x, y, 0x8F1C), a, b)
    np.testing.assert_array_equal(out, want)


@cuda.jit
def k_lop3(a, b, c, out):
    i = cuda.grid(1)
    if i < a.size:
        out[0, i] = P.lop3_b32(a[i], b[i], c[i], LUT_AND_OR)
        out[1, i] = P.lop3_b32(a[i], b[i], c[i], LUT_AND_XOR)
        out[2, i] = P.lop3_b32(a[i], b[i], c[i], 0x96)
        out[3, i] = P.lop3_b32(a[i], b[i], c[i], 0x1B)


def test_lop3():
    a, b, c = rand_u32(N), rand_u32(N), rand_u32(N)
    *_, out = launch(k_lop3, N, a, b, c, np.zeros((4, N), np.uint32))
    for row, lut in enumerate((LUT_AND_OR, LUT_AND_XOR, 0x96, 0x1B)):
        np.testing.assert_array_equal(out[row], twin_map(lambda x, y, z: P.lop3_b32.twin(x, y, z, lut), a, b, c))


# ---- half -------------------------------------------------------------------------------------
@cuda.jit
def k_half2_math(a, b, c, out):
    i = cuda.grid(1)
    if i < a.size:
        out[0, i] = P.fma_rn_f16x2(a[i], b[i], c[i])
        out[1, i] = P.mul_rn_f16x2(a[i], b[i])
        out[2, i] = P.add_rn_f16x2(a[i], c[i])


def test_half2_math():
    a, b, c = rand_half2(N), rand_half2(N), rand_half2(N)
    # plus products that land near 1 (a dense test of the rounding rather than of overflow)
    a[: N // 2] = ((rand_f16_bits(N) & 0x03FF) | 0x3800).view(np.uint32)  # [0.5, 1)
    b[: N // 2] = ((rand_f16_bits(N) & 0x03FF) | 0x3C00).view(np.uint32)  # [1, 2)
    *_, out = launch(k_half2_math, N, a, b, c, np.zeros((3, N), np.uint32))
    assert_half2_equal(out[0], twin_map(P.fma_rn_f16x2.twin, a, b, c))
    assert_half2_equal(out[1], twin_map(P.mul_rn_f16x2.twin, a, b))
    assert_half2_equal(out[2], twin_map(P.add_rn_f16x2.twin, a, c))


@cuda.jit
def k_cvt_f32_f16(h, out):
    i = cuda.grid(1)
    if i < h.size:
        out[i] = P.cvt_f32_f16(h[i])


def test_cvt_f32_f16_all_bit_patterns():
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16) if not SIM else rand_f16_bits(N)
    _, out = launch(k_cvt_f32_f16, h.size, h, np.zeros(h.size, np.float32))
    want = twin_map(P.cvt_f32_f16.twin, h).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(out[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert np.isnan(out[nan]).all()


@cuda.jit
def k_cvt_f16_f32(f, out, packed):
    i = cuda.grid(1)
    if i < f.size:
        out[i] = P.cvt_rn_f16_f32(f[i])
        packed[i] = P.pack_f16x2_from_f32(f[i], -f[i] * 0.5)


def test_cvt_rn_f16_f32_and_pack():
    f = np.concatenate([
        RNG.standard_normal(N // 2).astype(np.float32) * np.float32(1000),
        rand_u32(N // 2).view(np.float32),
    ])
    f[np.isnan(f)] = np.float32(65520.0)  # the overflow tie, instead of NaN inputs
    _, out, packed = launch(k_cvt_f16_f32, N, f, np.zeros(N, np.uint16), np.zeros(N, np.uint32))
    np.testing.assert_array_equal(out, twin_map(P.cvt_rn_f16_f32.twin, f))
    neg_half = (-f * np.float32(0.5)).astype(np.float32)
    np.testing.assert_array_equal(packed, twin_map(P.pack_f16x2_from_f32.twin, f, neg_half))


@cuda.jit
def k_unpack(w, lo, hi):
    i = cuda.grid(1)
    if i < w.size:
        lo[i], hi[i] = P.unpack_f16x2_to_f32(w[i])


def test_unpack_f16x2_to_f32():
    w = rand_half2(N)
    _, lo, hi = launch(k_unpack, N, w, np.zeros(N, np.float32), np.zeros(N, np.float32))
    want = np.array([P.unpack_f16x2_to_f32.twin(x) for x in w], dtype=np.float32)
    np.testing.assert_array_equal(lo, want[:, 0])
    np.testing.assert_array_equal(hi, want[:, 1])


# ---- the INT4 dequant, end to end in one kernel --------------------------------------------
@cuda.jit
def k_dequant(words, scales, out):
    i = cuda.grid(1)
    if i < words.size:
        s2 = scales[i] | (scales[i] << 16)
        for j in range(4):
            v = P.lop3_b32(words[i] >> (4 * j), 0x000F000F, 0x64086408, LUT_AND_XOR)
            out[i, j] = P.mul_rn_f16x2(P.add_rn_f16x2(v, 0xE408E408), s2)


def test_value_shuffle_dequant_on_device():
    from nq.loader.quant import pack_value_shuffle

    q = RNG.integers(-8, 8, size=(N, 8)).astype(np.int8)
    words = pack_value_shuffle(q).reshape(N)
    scales = RNG.uniform(1e-3, 1.0, N).astype(np.float16).view(np.uint16).astype(np.uint32)
    *_, out = launch(k_dequant, N, words, scales, np.zeros((N, 4), np.uint32))
    got = out.view(np.float16).reshape(N, 8).astype(np.float64)
    want = (q * scales.astype(np.uint16).view(np.float16)[:, None]).astype(np.float16)
    np.testing.assert_array_equal(got, want.astype(np.float64))


# ---- memory -----------------------------------------------------------------------------------
@cuda.jit
def k_copy16(src, out):
    i = cuda.grid(1)
    if 4 * i < src.size:
        a, b, c, d = P.ld_global_nc_v4_u32(src, 4 * i)
        e, f, g, h = P.ld_global_nc_na_v4_u32(src, 4 * i)
        pol = P.createpolicy_evict_first_b64()
        w, x, y, z = P.ld_global_nc_hint_v4_u32(src, 4 * i, pol)
        P.st_global_v4_u32(out, (0, 4 * i), a, b, c, d)
        P.st_global_v4_u32(out, (1, 4 * i), e, f, g, h)
        P.st_global_v4_u32(out, (2, 4 * i), w, x, y, z)


@cuda.jit
def k_copy16_2d(src, out):
    r, c = cuda.grid(2)
    if r < src.shape[0] and 4 * c < src.shape[1]:
        a, b, x, y = P.ld_global_nc_v4_u32(src, (r, 4 * c))
        P.st_global_v4_u32(out, (r, 4 * c), a, b, x, y)


def test_loads_and_stores_move_16_bytes():
    src = rand_u32(4 * N)
    *_, out = launch(k_copy16, N, src, np.zeros((3, 4 * N), np.uint32))
    for row in range(3):
        np.testing.assert_array_equal(out[row], src)
    m = rand_u32(16 * 32).reshape(16, 32)
    dm, dout = cuda.to_device(m), cuda.to_device(np.zeros_like(m))
    k_copy16_2d[(2, 1), (8, 8)](dm, dout)
    np.testing.assert_array_equal(dout.copy_to_host(), m)


# ---- dp4a -------------------------------------------------------------------------------------
@cuda.jit
def k_dp4a(a, b, c, out):
    i = cuda.grid(1)
    if i < a.size:
        out[i] = P.dp4a_s32(a[i], b[i], c[i])


def test_dp4a():
    a, b = rand_u32(N), rand_u32(N)
    c = RNG.integers(-2**31, 2**31, N, dtype=np.int64).astype(np.int32)
    *_, out = launch(k_dp4a, N, a, b, c, np.zeros(N, np.int32))
    np.testing.assert_array_equal(out, twin_map(P.dp4a_s32.twin, a, b, c))


# ---- shared memory: alignment where the simulator allows none -------------------------------
ALIGN = None if SIM else 128  # the simulator refuses alignment=; None is accepted by both


@cuda.jit
def k_ldmatrix(tile_g, out, out_t):
    tile = cuda.shared.array((16, 8), dtype=np.uint32, alignment=ALIGN)  # 16x16 fp16
    lane = cuda.threadIdx.x
    for j in range(4):
        tile[lane // 2, 4 * (lane % 2) + j] = tile_g[lane // 2, 4 * (lane % 2) + j]
    cuda.syncthreads()
    base = P.cvta_to_shared_u32(tile)
    r0, r1, r2, r3 = P.ldmatrix_x4(base + (lane % 16) * 32 + (lane // 16) * 16)
    out[lane, 0], out[lane, 1], out[lane, 2], out[lane, 3] = r0, r1, r2, r3
    r0, r1, r2, r3 = P.ldmatrix_x4_trans(base + (lane % 16) * 32 + (lane // 16) * 16)
    out_t[lane, 0], out_t[lane, 1], out_t[lane, 2], out_t[lane, 3] = r0, r1, r2, r3


def test_ldmatrix_x4_and_trans():
    from nq.ptx.mma import ldmatrix_x4_warp

    tile = RNG.standard_normal((16, 16)).astype(np.float16)
    words = tile.view(np.uint32)  # (16, 8)
    out, out_t = np.zeros((32, 4), np.uint32), np.zeros((32, 4), np.uint32)
    d = [cuda.to_device(x) for x in (words, out, out_t)]
    k_ldmatrix[1, 32](*d)
    u16 = tile.view(np.uint16)
    rows = np.array([u16[i % 16, 8 * (i // 16): 8 * (i // 16) + 8] for i in range(32)])
    np.testing.assert_array_equal(d[1].copy_to_host(), ldmatrix_x4_warp(rows))
    np.testing.assert_array_equal(d[2].copy_to_host(), ldmatrix_x4_warp(rows, trans=True))


@cuda.jit
def k_mma(a, b, c, out):
    lane = cuda.threadIdx.x
    d0, d1, d2, d3 = P.mma_sync_m16n8k16_f16_f32(a[lane, 0], a[lane, 1], a[lane, 2], a[lane, 3],
                                                 b[lane, 0], b[lane, 1],
                                                 c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3])
    out[lane, 0], out[lane, 1], out[lane, 2], out[lane, 3] = d0, d1, d2, d3


def test_mma_sync_m16n8k16():
    from nq.ptx.mma import mma_m16n8k16_f16_f32_warp

    for _ in range(3):
        a = RNG.standard_normal(32 * 8).astype(np.float16).view(np.uint32).reshape(32, 4)
        b = RNG.standard_normal(32 * 4).astype(np.float16).view(np.uint32).reshape(32, 2)
        c = RNG.standard_normal((32, 4)).astype(np.float32)
        d = [cuda.to_device(x) for x in (a, b, c, np.zeros((32, 4), np.float32))]
        k_mma[1, 32](*d)
        # products are exact; the tensor core's fp32 sum of 16 terms + c may round differently
        # from the model's one rounding: sums are O(5), so 1e-5 absolute is a few fp32 ulps.
        np.testing.assert_allclose(d[3].copy_to_host(), mma_m16n8k16_f16_f32_warp(a, b, c),
                                   rtol=1e-5, atol=1e-5)


@cuda.jit
def k_mma_s8(a, b, c, out, f, r):
    lane = cuda.threadIdx.x
    d0, d1, d2, d3 = P.mma_sync_m16n8k32_s8_s32(a[lane, 0], a[lane, 1], a[lane, 2], a[lane, 3],
                                                b[lane, 0], b[lane, 1],
                                                c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3])
    out[lane, 0], out[lane, 1], out[lane, 2], out[lane, 3] = d0, d1, d2, d3
    r[lane] = P.cvt_rni_s32_f32(f[lane])


def test_mma_sync_m16n8k32_s8_and_cvt_rni():
    from nq.ptx.mma import mma_m16n8k32_s8_s32_warp

    for _ in range(3):   # integer sums: the tensor core and the model agree to the bit
        a = RNG.integers(0, 2**32, (32, 4), dtype=np.uint32)
        b = RNG.integers(0, 2**32, (32, 2), dtype=np.uint32)
        c = RNG.integers(-2**30, 2**30, (32, 4)).astype(np.int32)
        f = (RNG.standard_normal(32) * 4e6).astype(np.float32)
        f[:4] = [2.5, 3.5, -2.5, -0.5]
        d = [cuda.to_device(x) for x in (a, b, c, np.zeros((32, 4), np.int32), f,
                                         np.zeros(32, np.int32))]
        k_mma_s8[1, 32](*d)
        np.testing.assert_array_equal(d[3].copy_to_host(), mma_m16n8k32_s8_s32_warp(a, b, c))
        np.testing.assert_array_equal(d[5].copy_to_host(),
                                      [P.cvt_rni_s32_f32.twin(v) for v in f])


# ---- bulk copies signalled through an mbarrier, two phases ----------------------------------
STAGE_WORDS = 1024  # 4 KiB per stage, copied as two 2 KiB bulk copies


@cuda.jit
def k_bulk_pipeline(src, out, flags):
    tile = cuda.shared.array(STAGE_WORDS, dtype=np.uint32, alignment=ALIGN)
    bars = cuda.shared.array(2, dtype=np.uint64, alignment=ALIGN)
    tid = cuda.threadIdx.x
    sbase = P.cvta_to_shared_u32(tile)
    bar = P.cvta_to_shared_u32(bars)
    if tid == 0:
        P.mbarrier_init(bar, 1)
        P.mbarrier_init(bar + 8, cuda.blockDim.x)
        P.fence_mbarrier_init()
    cuda.syncthreads()
    for s in range(2):
        if tid == 0:
            P.fence_proxy_async_shared()  # the tile was read by ordinary loads last stage
            P.mbarrier_arrive_expect_tx(bar, 4 * STAGE_WORDS)
            P.cp_async_bulk_g2s(sbase, src, s * STAGE_WORDS, 2 * STAGE_WORDS, bar)
            P.cp_async_bulk_g2s_hint(sbase + 2 * STAGE_WORDS, src, s * STAGE_WORDS + STAGE_WORDS // 2,
                                     2 * STAGE_WORDS, bar, P.createpolicy_evict_first_b64())
        if s == 0:
            while not P.mbarrier_try_wait_parity(bar, 0):
                pass
        else:
            P.mbarrier_wait_parity(bar, 1)
        for j in range(tid, STAGE_WORDS, cuda.blockDim.x):
            out[s * STAGE_WORDS + j] = tile[j]
        cuda.syncthreads()  # everyone has read the tile before it is overwritten
    # a barrier counting every thread's arrival: phase 0 completes only when all have arrived
    P.mbarrier_arrive(bar + 8)
    P.mbarrier_wait_parity(bar + 8, 0)
    flags[tid] = P.mbarrier_try_wait_parity(bar + 8, 0) + 2 * P.mbarrier_try_wait_parity(bar + 8, 1)


def test_bulk_copy_pipeline_with_mbarrier():
    src = rand_u32(2 * STAGE_WORDS)
    threads = 64
    d = [cuda.to_device(x) for x in (src, np.zeros_like(src), np.zeros(threads, np.uint32))]
    k_bulk_pipeline[1, threads](*d)
    cuda.synchronize()
    np.testing.assert_array_equal(d[1].copy_to_host(), src)
    # after phase 0: parity 0 done (1), parity 1 (the phase now running) not done (0)
    np.testing.assert_array_equal(d[2].copy_to_host(), np.ones(threads, np.uint32))


# ---- narrow loads, shared 16-byte loads, u16 stores, bit casts ------------------------------
@cuda.jit
def k_extras(w, h, f, out, o16, addr, same, pair):
    tile = cuda.shared.array((8, 8), dtype=np.uint32, alignment=ALIGN)
    i = cuda.threadIdx.x  # 32 threads
    tile[i // 4, 2 * (i % 4)] = w[2 * i]
    tile[i // 4, 2 * (i % 4) + 1] = w[2 * i + 1]
    cuda.syncthreads()
    a, b, c, d = P.ld_shared_v4_u32(tile, (i // 4, 4 * (i % 2)))
    out[i, 0], out[i, 1], out[i, 2], out[i, 3] = a, b, c, d
    out[i, 4], out[i, 5] = P.ld_global_nc_v2_u32(w, 2 * i)
    x0, x1, x2, x3 = P.ld_global_nc_v4_f32(f, 4 * i)
    out[i, 6] = P.mov_b32_u32_from_f32(x0 * x1 + x2 - x3)
    pair[i, 0], pair[i, 1] = P.ld_global_nc_v2_f32(f, 2 * i)
    hb = P.ld_global_nc_u16(h, i)
    out[i, 7] = hb
    P.st_global_u16(o16, i, P.cvt_rn_f16_f32(P.mov_b32_f32_from_u32(out[i, 6]) * 2))
    addr[i] = P.cvta_to_shared_u32_at(tile, (i // 4, i % 8)) - P.cvta_to_shared_u32(tile)
    # the 32-bit-address twins of the load above: the same 16 (and last 8) bytes, bit for bit
    e, f_, g, h_ = P.ld_shared_v4_u32_at(P.cvta_to_shared_u32(tile) + 16 * (2 * (i // 4) + i % 2))
    u, v = P.ld_shared_v2_u32_at(P.cvta_to_shared_u32(tile) + 16 * (2 * (i // 4) + i % 2) + 8)
    same[i] = ((e == a) and (f_ == b) and (g == c) and (h_ == d) and (u == c) and (v == d)
               and P.ld_global_nc_u32(w, 2 * i + 1) == w[2 * i + 1])


def test_extras():
    w = rand_u32(64)
    h = RNG.standard_normal(32).astype(np.float16)
    f = RNG.standard_normal(128).astype(np.float32)
    d = [cuda.to_device(x) for x in (w, h, f, np.zeros((32, 8), np.uint32),
                                     np.zeros(32, np.float16), np.zeros(32, np.uint32),
                                     np.zeros(32, np.uint32), np.zeros((32, 2), np.float32))]
    k_extras[1, 32](*d)
    np.testing.assert_array_equal(d[7].copy_to_host(), f[:64].reshape(32, 2))
    out, o16, addr = d[3].copy_to_host(), d[4].copy_to_host(), d[5].copy_to_host()
    tile = w.reshape(8, 8)
    lanes = np.arange(32)
    np.testing.assert_array_equal(out[:, 0:4], [tile[i // 4, 4 * (i % 2): 4 * (i % 2) + 4] for i in lanes])
    np.testing.assert_array_equal(out[:, 4:6], w.reshape(32, 2))
    f4 = f.reshape(32, 4)
    want = (f4[:, 0] * f4[:, 1] + f4[:, 2] - f4[:, 3]).astype(np.float32)
    # fp32 contraction of x0*x1 + x2 into an fma may differ from numpy's two roundings
    np.testing.assert_allclose(out[:, 6].view(np.float32), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out[:, 7], h.view(np.uint16))
    np.testing.assert_array_equal(o16, (out[:, 6].view(np.float32) * 2).astype(np.float16))
    np.testing.assert_array_equal(addr, [4 * (8 * (i // 4) + i % 8) for i in lanes])
    np.testing.assert_array_equal(d[6].copy_to_host(), np.ones(32, np.uint32))



@cuda.jit
def k_clock(out, spins):
    # the SM's cycle counter moves, and a loop that spins on it waits at least its cycles
    t0 = P.clock64()
    target = t0 + spins[0]
    while P.clock64() < target:
        pass
    out[0] = P.clock64() - t0


def test_clock64_counts_cycles():
    out = cuda.device_array(1, np.uint64)
    for n in (0, 2000, 100000):
        k_clock[1, 1](out, cuda.to_device(np.array([n], np.uint64)))
        got = int(out.copy_to_host()[0])
        assert n <= got < n + 20000, (n, got)


# ---- thread block clusters: rank, barrier, distributed shared memory -------------------------
@cuda.jit
def k_cluster(out, ranks):
    # every CTA writes (rank + 1) * 1000 + thread into its shared cells; after the cluster
    # barrier thread t reads cell t of the CTA one rank up (mod the cluster size)
    cells = cuda.shared.array(64, dtype=np.float32)
    r = P.cluster_ctarank()
    t = cuda.threadIdx.x
    cells[t] = np.float32((r + 1) * 1000 + t)
    P.barrier_cluster_sync()
    size = ranks.size          # the cluster size: one cluster spans the grid's x
    peer = P.mapa_shared_cluster_u32(P.cvta_to_shared_u32_at(cells, t), (r + 1) % size)
    out[cuda.blockIdx.y, cuda.blockIdx.x, t] = P.ld_shared_cluster_f32(peer)
    if t == 0:
        ranks[cuda.blockIdx.x] = r
    P.barrier_cluster_sync()   # no CTA leaves while its peer may still read its cells


@pytest.mark.skipif(SIM, reason="the simulator launches no clusters (the twins: a cluster of one)")
@pytest.mark.parametrize("size", [2, 8, 16])
def test_cluster_rank_barrier_and_distributed_shared_memory(size):
    from nq.kernels.fastlaunch import FastLaunch, allow_large_cluster
    k_cluster.compile("void(float32[:, :, ::1], uint32[::1])")
    out = cuda.to_device(np.zeros((3, size, 64), np.float32))
    ranks = cuda.to_device(np.zeros(size, np.uint32))
    if size > 8:
        allow_large_cluster(k_cluster)
    FastLaunch(k_cluster, out, ranks)((1, 3), 64, 0, 0, cluster=(size, 1, 1))
    cuda.synchronize()
    np.testing.assert_array_equal(ranks.copy_to_host(), np.arange(size))
    want = ((np.arange(size)[:, None] + 1) % size + 1) * 1000 + np.arange(64)[None, :]
    got = out.copy_to_host()
    for y in range(3):   # three clusters along y, each its own ring
        np.testing.assert_array_equal(got[y], want.astype(np.float32))
