"""The Python twins of nq.ptx, checked against hand-worked cases and independent models.

The twins are the specification the GPU tests (test_ptx_gpu.py) hold the instructions to, so
each is checked here against something that is not itself: worked examples from the PTX ISA,
numpy's own fp16 rounding, and the ValueShuffle packing of nq.loader.quant.
"""
import numpy as np
import pytest

import nq.ptx as P
from nq.ptx.half import F16_NAN, f16_round_bits, f16_value

RNG = np.random.default_rng(1234)


def f16bits(x) -> int:
    return int(np.array(x, dtype=np.float16).view(np.uint16))


def words_to_f16(w) -> np.ndarray:
    """uint32 half2 words -> their fp16 values in memory order (lo, hi, lo, hi, ...)."""
    return np.asarray(w, dtype=np.uint32).view(np.float16).astype(np.float64)


# ---- prmt -------------------------------------------------------------------------------------
def prmt_model(a, b, sel):
    """Independent model: bytes of {b, a} as a numpy array, selected by the selector nibbles."""
    pool = np.array([a, b], dtype="<u4").view(np.uint8)
    out = np.zeros(4, dtype=np.uint8)
    for i in range(4):
        s = (sel >> (4 * i)) & 0xF
        byte = pool[s & 7]
        out[i] = (0xFF if byte >= 0x80 else 0) if s & 8 else byte
    return int(out.view("<u4")[0])


def test_prmt_identity_and_reversal():
    a, b = 0x33221100, 0x77665544
    assert P.prmt_b32.twin(a, b, 0x3210) == a
    assert P.prmt_b32.twin(a, b, 0x7654) == b
    assert P.prmt_b32.twin(a, b, 0x0123) == 0x00112233
    assert P.prmt_b32.twin(a, b, 0x4567) == 0x44556677
    assert P.prmt_b32.twin(a, b, 0x7140) == 0x77114400


def test_prmt_sign_replication():
    assert P.prmt_b32.twin(0x0000_0080, 0, 0x8888) == 0xFFFFFFFF
    assert P.prmt_b32.twin(0x0000_007F, 0, 0x8888) == 0
    # selector nibbles 8, 9, 0, 1: sign of byte 0 (0x7F -> 00), sign of byte 1 (0x80 -> FF),
    # then bytes 0 and 1 copied
    assert P.prmt_b32.twin(0x0000_807F, 0, 0x1098) == prmt_model(0x807F, 0, 0x1098) == 0x807FFF00


def test_prmt_halfword_selectors_the_gemv_uses():
    for _ in range(200):
        a, b = (int(v) for v in RNG.integers(0, 2**32, 2, dtype=np.uint64))
        lo = P.prmt_b32.twin(a, b, 0x5410)  # (a.lo16, b.lo16)
        hi = P.prmt_b32.twin(a, b, 0x7632)  # (a.hi16, b.hi16)
        assert lo == ((b & 0xFFFF) << 16) | (a & 0xFFFF)
        assert hi == (b & 0xFFFF0000) | (a >> 16)


def test_prmt_random_selectors_against_model():
    for _ in range(2000):
        a, b = (int(v) for v in RNG.integers(0, 2**32, 2, dtype=np.uint64))
        sel = int(RNG.integers(0, 2**32))
        assert P.prmt_b32.twin(a, b, sel) == prmt_model(a, b, sel & 0xFFFF)


def test_prmt_returns_uint32():
    assert isinstance(P.prmt_b32.twin(1, 2, 0x3210), np.uint32)


# ---- lop3 -------------------------------------------------------------------------------------
def test_lop3_truth_table_is_its_own_lut():
    # The defining property of immLut: F(0xF0, 0xCC, 0xAA) == immLut, for all 256 functions.
    for lut in range(256):
        # the upper 24 bits are F(0, 0, 0), i.e. lut bit 0 replicated
        high = 0xFFFFFF00 if lut & 1 else 0
        assert P.lop3_b32.twin(P.LOP3_A, P.LOP3_B, P.LOP3_C, lut) == lut | high
        rep = lambda x: x * 0x01010101
        assert P.lop3_b32.twin(rep(0xF0), rep(0xCC), rep(0xAA), lut) == rep(lut)


@pytest.mark.parametrize("lut,fn", [
    (0xEA, lambda a, b, c: (a & b) | c),
    (0x6A, lambda a, b, c: (a & b) ^ c),
    (0x96, lambda a, b, c: a ^ b ^ c),
    (0xF8, lambda a, b, c: a | (b & c)),
    (0xE8, lambda a, b, c: (a & b) | (a & c) | (b & c)),  # majority
    (0x00, lambda a, b, c: 0),
    (0xFF, lambda a, b, c: 0xFFFFFFFF),
])
def test_lop3_named_functions(lut, fn):
    for _ in range(100):
        a, b, c = (int(v) for v in RNG.integers(0, 2**32, 3, dtype=np.uint64))
        assert P.lop3_b32.twin(a, b, c, lut) == fn(a, b, c)
    assert P.LUT_AND_OR == 0xEA and P.LUT_AND_XOR == 0x6A


# ---- the INT4 dequant built from the twins --------------------------------------------------
def pack_value_shuffle_independent(w8):
    """Eight ints in [-8, 7] -> the ValueShuffle word: slots [w0,w2,w4,w6,w1,w3,w5,w7] from bit 0."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    return sum((int(w8[src]) & 0xF) << (4 * slot) for slot, src in enumerate(order))


def test_independent_packing_matches_the_loader():
    from nq.loader.quant import pack_value_shuffle

    q = RNG.integers(-8, 8, size=(3, 128)).astype(np.int8)
    packed = pack_value_shuffle(q)
    for r in range(3):
        for j in range(16):
            assert packed[r, j] == pack_value_shuffle_independent(q[r, 8 * j: 8 * j + 8])


NEG_1032 = 0xE408E408  # fp16 -1032.0 in both halves


def dequant_word(word, scale_bits):
    """The GEMV's dequant of one ValueShuffle word, written with the twins only.

    Per shift s in (0, 4, 8, 12): one lop3 masks the nibble pair, flips its sign bit (two's
    complement -> offset 8) and ORs in the fp16 exponent, giving fp16 1024 + w + 8 in each half;
    subtracting 1032 is exact; the scale multiply rounds once, like w * scale in fp16.
    """
    scale2 = scale_bits | (scale_bits << 16)
    out = []
    for s in (0, 4, 8, 12):
        v = P.lop3_b32.twin(int(word) >> s, 0x000F000F, 0x64086408, P.LUT_AND_XOR)
        w = P.add_rn_f16x2.twin(v, NEG_1032)
        out.append(P.mul_rn_f16x2.twin(w, scale2))
    return out  # half2 words holding (w0,w1), (w2,w3), (w4,w5), (w6,w7) times scale


def test_value_shuffle_dequant_of_one_word():
    for _ in range(300):
        w8 = RNG.integers(-8, 8, size=8)
        scale = np.float16(RNG.uniform(1e-3, 2.0))
        word = pack_value_shuffle_independent(w8)
        got = words_to_f16(dequant_word(word, f16bits(scale)))
        want = (w8.astype(np.float64) * float(scale)).astype(np.float16).astype(np.float64)
        np.testing.assert_array_equal(got, want)


def test_magic_number_halves_before_scaling():
    # every nibble value in both lanes: 0x6400 | (n ^ 8) is 1024 + (w + 8) exactly
    for n in range(16):
        w = n - 16 if n >= 8 else n
        v = P.lop3_b32.twin(n | (n << 16), 0x000F000F, 0x64086408, P.LUT_AND_XOR)
        assert v == (0x6400 | (n ^ 8)) * 0x00010001
        np.testing.assert_array_equal(words_to_f16([v]), [1032 + w, 1032 + w])
        np.testing.assert_array_equal(words_to_f16([P.add_rn_f16x2.twin(v, NEG_1032)]), [w, w])
    # the offset-binary variant: OR only, codes 0..15 read as 1024 + code
    v = P.lop3_b32.twin(0x0003000C, 0x000F000F, 0x64006400, P.LUT_AND_OR)
    np.testing.assert_array_equal(words_to_f16([v]), [1024 + 12, 1024 + 3])


# ---- fp16 rounding and arithmetic -------------------------------------------------------------
def test_f16_rounding_matches_numpy_on_random_float32():
    x = np.concatenate([
        RNG.standard_normal(3000).astype(np.float32) * np.float32(100),
        (RNG.standard_normal(1000) * 1e-6).astype(np.float32),  # subnormal fp16 range
        RNG.uniform(-7e4, 7e4, 500).astype(np.float32),          # around the overflow
    ])
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    got = np.array([P.cvt_rn_f16_f32.twin(v) for v in x], dtype=np.uint16)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("x,bits", [
    (65504.0, 0x7BFF),
    (65519.99, 0x7BFF),
    (65520.0, 0x7C00),            # tie above the max rounds to inf
    (-65520.0, 0xFC00),
    (2.0 ** -24, 0x0001),         # smallest subnormal
    (2.0 ** -25, 0x0000),         # half of it: tie, to even (zero)
    (3 * 2.0 ** -25, 0x0002),     # 1.5 quanta: tie, to even (2)
    (-0.0, 0x8000),
    (1.0 + 2.0 ** -11, 0x3C00),   # tie between 1 and 1+2^-10: even
    (1.0 + 3 * 2.0 ** -11, 0x3C02),
    (float("inf"), 0x7C00),
    (float("nan"), F16_NAN),
])
def test_cvt_rn_f16_f32_edges(x, bits):
    assert P.cvt_rn_f16_f32.twin(np.float32(x)) == bits
    assert isinstance(P.cvt_rn_f16_f32.twin(np.float32(1)), np.uint16)


def test_cvt_f32_f16_all_bit_patterns():
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    want = h.view(np.float16).astype(np.float32)
    got = np.array([P.cvt_f32_f16.twin(v) for v in h], dtype=np.float32)
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))
    assert np.isnan(got[~finite]).all()


def test_pack_and_unpack_f16x2_order():
    # lo is element 0 in memory: the packed word viewed as fp16 reads [lo, hi]
    w = P.pack_f16x2_from_f32.twin(np.float32(1.5), np.float32(-2.0))
    assert w == 0xC000_3E00
    np.testing.assert_array_equal(words_to_f16([w]), [1.5, -2.0])
    assert P.unpack_f16x2_to_f32.twin(w) == (np.float32(1.5), np.float32(-2.0))
    for _ in range(200):
        lo, hi = RNG.standard_normal(2).astype(np.float32) * np.float32(30)
        w = P.pack_f16x2_from_f32.twin(lo, hi)
        want = np.array([lo, hi], dtype=np.float32).astype(np.float16)
        assert w == int(want.view("<u4")[0])
        assert P.unpack_f16x2_to_f32.twin(w) == tuple(want.astype(np.float32))


def half2(lo, hi):
    return f16bits(lo) | (f16bits(hi) << 16)


def test_fma_hand_cases():
    fma = P.fma_rn_f16x2.twin
    assert fma(half2(1, 2), half2(1, 3), half2(1, -6)) == half2(2, 0)
    # lo: (1 + 2^-10)(1 + 2^-9) - 1 = 3*2^-10 + 2^-19 exactly, representable; rounding the
    # product first (mul then add) would lose the 2^-19.  hi: 2048*1 + 1 = 2049 is a tie
    # between 2048 and 2050, to even: 2048.
    a = half2(1 + 2.0 ** -10, 2048.0)
    b = half2(1 + 2.0 ** -9, 1.0)
    c = half2(-1.0, 1.0)
    np.testing.assert_array_equal(words_to_f16([fma(a, b, c)]), [3 * 2.0 ** -10 + 2.0 ** -19, 2048.0])
    two_step = P.add_rn_f16x2.twin(P.mul_rn_f16x2.twin(a, b), c)
    np.testing.assert_array_equal(words_to_f16([two_step]), [3 * 2.0 ** -10, 2048.0])


def test_fma_signed_zeros_inf_nan():
    fma = P.fma_rn_f16x2.twin
    assert fma(half2(-1.0, 1.0), half2(0.0, 1.0), half2(0.0, -1.0)) == half2(0.0, 0.0)
    assert fma(half2(-1.0, -1.0), half2(0.0, 0.0), half2(-0.0, -0.0)) == 0x80008000
    big = half2(65504.0, 65504.0)
    assert fma(big, half2(2.0, -2.0), 0) == 0xFC00_7C00
    assert fma(half2(np.inf, 0.0), half2(0.0, 1.0), 0) == F16_NAN | (0 << 16)
    assert fma(half2(np.inf, np.inf), half2(1.0, 1.0), half2(-np.inf, 1.0)) == (0x7C00 << 16) | F16_NAN


def test_fma_add_mul_against_float64_where_exact():
    # with |a|, |b|, |c| in [2^-4, 2^4] the float64 a*b + c is exact, so numpy's one rounding
    # of it to fp16 is an independent model of fma.rn.f16x2 (and of mul/add).
    for _ in range(500):
        v = (RNG.uniform(0.0625, 16, 6) * RNG.choice([-1, 1], 6)).astype(np.float16)
        a, b, c = (half2(v[i], v[i + 3]) for i in range(3))
        f = v.astype(np.float64)
        want_fma = np.array([f[0] * f[1] + f[2], f[3] * f[4] + f[5]]).astype(np.float16)
        want_mul = np.array([f[0] * f[1], f[3] * f[4]]).astype(np.float16)
        want_add = np.array([f[0] + f[2], f[3] + f[5]]).astype(np.float16)
        assert P.fma_rn_f16x2.twin(a, b, c) == int(want_fma.view("<u4")[0])
        assert P.mul_rn_f16x2.twin(a, b) == int(want_mul.view("<u4")[0])
        assert P.add_rn_f16x2.twin(a, c) == int(want_add.view("<u4")[0])


def test_f16_round_bits_and_value_roundtrip():
    for bits in range(0, 0x7C00, 37):
        assert f16_round_bits(f16_value(bits)) == bits
        assert f16_round_bits(f16_value(bits | 0x8000)) == bits | 0x8000


# ---- memory ----------------------------------------------------------------------------------
def test_ld_global_nc_v4_twins_read_memory_order():
    a = np.arange(64, dtype=np.uint32) * np.uint32(0x01010101)
    for ld in (P.ld_global_nc_v4_u32.twin, P.ld_global_nc_na_v4_u32.twin):
        assert ld(a, 8) == (a[8], a[9], a[10], a[11])
    pol = P.createpolicy_evict_first_b64.twin()
    assert P.ld_global_nc_hint_v4_u32.twin(a, 4, pol) == tuple(a[4:8])
    m = a.reshape(8, 8)
    assert P.ld_global_nc_v4_u32.twin(m, (3, 4)) == tuple(a[28:32])
    h = np.arange(16, dtype=np.float16)
    words = P.ld_global_nc_v4_u32.twin(h, 8)
    np.testing.assert_array_equal(words_to_f16(words), np.arange(8, 16))
    with pytest.raises(AssertionError, match="misaligned"):
        P.ld_global_nc_v4_u32.twin(a, 2)


def test_st_global_v4_twin_writes_memory_order():
    out = np.zeros(12, dtype=np.uint32)
    P.st_global_v4_u32.twin(out, 4, 1, 2, 3, 0xFFFFFFFF)
    np.testing.assert_array_equal(out, [0] * 4 + [1, 2, 3, 0xFFFFFFFF] + [0] * 4)
    f = np.zeros(8, dtype=np.float32)
    P.st_global_v4_u32.twin(f, 4, *np.array([1.0, 2.0, -3.0, 0.5], dtype=np.float32).view(np.uint32))
    np.testing.assert_array_equal(f[4:], [1.0, 2.0, -3.0, 0.5])


def test_narrow_and_float_loads_and_u16_store_twins():
    a = np.arange(16, dtype=np.uint32) + np.uint32(7)
    assert P.ld_global_nc_v2_u32.twin(a, 6) == (13, 14)
    with pytest.raises(AssertionError, match="8-byte access"):
        P.ld_global_nc_v2_u32.twin(a, 5)
    assert P.ld_global_nc_u32.twin(a, 5) == 12
    h2 = np.array([1.0, -2.0, 0.5, 3.0], dtype=np.float16)
    assert P.ld_global_nc_u32.twin(h2, 2) == int(h2[2:].view(np.uint32)[0])   # a pair
    with pytest.raises(AssertionError, match="4-byte access"):
        P.ld_global_nc_u32.twin(h2, 1)
    f = np.linspace(-1, 1, 8).astype(np.float32)
    assert P.ld_global_nc_v4_f32.twin(f, 4) == tuple(f[4:])
    assert P.ld_global_nc_v2_f32.twin(f, 6) == tuple(f[6:])
    with pytest.raises(AssertionError, match="8-byte access"):
        P.ld_global_nc_v2_f32.twin(f, 3)
    h = np.array([1.5, -2.0, 65504.0], dtype=np.float16)
    assert P.ld_global_nc_u16.twin(h, 2) == 0x7BFF
    P.st_global_u16.twin(h, 1, P.cvt_rn_f16_f32.twin(np.float32(0.25)))
    np.testing.assert_array_equal(h, [1.5, 0.25, 65504.0])


def test_ld_shared_v4_twin_and_element_addresses():
    tile = (np.arange(32, dtype=np.uint32) * np.uint32(3)).reshape(4, 8)
    assert P.ld_shared_v4_u32.twin(tile, (2, 4)) == tuple(tile[2, 4:8])
    ftile = np.linspace(-1, 1, 8, dtype=np.float32)
    assert P.ld_shared_v4_f32.twin(ftile, 4) == tuple(ftile[4:])
    base = int(P.cvta_to_shared_u32.twin(tile))
    assert int(P.cvta_to_shared_u32_at.twin(tile, (2, 4))) == base + 4 * (2 * 8 + 4)
    flat = np.zeros(16, dtype=np.uint64)
    assert int(P.cvta_to_shared_u32_at.twin(flat, 3)) == int(P.cvta_to_shared_u32.twin(flat)) + 24
    # the 32-bit-address load reads the same 16 bytes as the &arr[idx] one
    assert P.ld_shared_v4_u32_at.twin(P.cvta_to_shared_u32_at.twin(tile, (3, 4))) == tuple(tile[3, 4:8])
    assert P.ld_shared_v2_u32_at.twin(P.cvta_to_shared_u32_at.twin(tile, (1, 6))) == tuple(tile[1, 6:8])


def test_mov_b32_bit_casts():
    assert P.mov_b32_u32_from_f32.twin(np.float32(1.0)) == 0x3F800000
    assert P.mov_b32_u32_from_f32.twin(np.float32(-0.0)) == 0x80000000
    assert P.mov_b32_f32_from_u32.twin(0x40490FDB) == np.float32(np.pi)
    for bits in rand_u32_list(100):
        f = P.mov_b32_f32_from_u32.twin(bits)
        if not np.isnan(f):
            assert P.mov_b32_u32_from_f32.twin(f) == bits


def rand_u32_list(n):
    return [int(v) for v in RNG.integers(0, 2**32, n, dtype=np.uint64)]


# ---- shared addresses, mbarrier, bulk copy ---------------------------------------------------
def test_shared_address_twin_is_consistent_across_views():
    buf = np.zeros(64, dtype=np.uint32)
    base = int(P.cvta_to_shared_u32.twin(buf))
    assert base % 16 == 0 and base < 2**32
    assert int(P.cvta_to_shared_u32.twin(buf[8:])) == base + 32
    other = int(P.cvta_to_shared_u32.twin(np.zeros(4, dtype=np.uint64)))
    assert other >= base + 256 or other + 32 <= base  # distinct buffers never overlap


def test_shared_addresses_are_given_out_again_once_freed():
    # each simulated block allocates its shared arrays anew; a run of many blocks must not walk
    # the stand-in addresses past the 256 KiB that a wgmma descriptor's 14 bits of (addr >> 4)
    # name (the batched prefill's wgmma attention read a wrapped address before this)
    # (no gc.collect(): an array is freed when its last reference goes, and a full collection
    # in a test worker that has imported numba and torch took ~2.7 s -- 200 of them were 550 s
    # of CI's run)
    from nq.ptx import _sim
    seen = set()
    for _ in range(200):
        block = np.zeros(96 * 1024 // 4, np.uint32)          # 96 KiB a "block"
        base = int(P.cvta_to_shared_u32.twin(block))
        seen.add(base)
        assert base + block.nbytes <= _sim.WINDOW
        del block
    assert len(seen) <= 2, sorted(seen)
    # a live array keeps its range, and a temporary view of it resolves inside it
    keep = np.zeros(1024, np.uint32)
    kb = int(P.cvta_to_shared_u32.twin(keep[16:]))
    other = np.zeros(1024, np.uint32)
    ob = int(P.cvta_to_shared_u32.twin(other))
    assert ob >= kb - 64 + 4096 or ob + 4096 <= kb - 64      # never overlapping a live one
    assert int(P.cvta_to_shared_u32.twin(keep)) == kb - 64
    _sim.shared_bytes(kb - 64, 4096)[:] = 7                  # the whole of keep, through it
    assert (keep.view(np.uint8) == 7).all()
    # the simulator's dynamic shared memory: each thread's cuda.shared.array(0) is a new
    # np.frombuffer array over the block's one buffer; the range lives as long as the buffer,
    # not as the first thread's array
    dyn = np.zeros(4096, np.byte)
    t0 = np.frombuffer(dyn.data, dtype=np.uint32, count=1024)
    db = int(P.cvta_to_shared_u32.twin(t0))
    del t0
    t1 = np.frombuffer(dyn.data, dtype=np.uint32, count=1024)
    assert int(P.cvta_to_shared_u32.twin(t1[4:])) == db + 16
    _sim.shared_bytes(db, 4096)[:] = 3
    assert (dyn == 3).all()
    # a freed region forgets its mbarriers: a new array at the same address must init its own
    bars = np.zeros(2, np.uint64)
    bar = int(P.cvta_to_shared_u32.twin(bars))
    P.mbarrier_init.twin(bar, 1)
    del bars
    fresh = np.zeros(2, np.uint64)
    assert int(P.cvta_to_shared_u32.twin(fresh)) == bar
    with pytest.raises(RuntimeError, match="before mbarrier_init"):
        P.mbarrier_arrive.twin(bar)


def test_mbarrier_arrival_counting_and_phases():
    bars = np.zeros(2, dtype=np.uint64)
    bar = P.cvta_to_shared_u32.twin(bars)
    P.mbarrier_init.twin(bar, 2)
    assert P.mbarrier_try_wait_parity.twin(bar, 0) == 0
    assert P.mbarrier_try_wait_parity.twin(bar, 1) == 1  # "the phase before" counts as done
    assert P.mbarrier_arrive.twin(bar) == 0
    assert P.mbarrier_try_wait_parity.twin(bar, 0) == 0
    P.mbarrier_arrive.twin(bar)
    assert P.mbarrier_try_wait_parity.twin(bar, 0) == 1
    assert P.mbarrier_try_wait_parity.twin(bar, 1) == 0  # re-armed: phase 1 in progress
    assert P.mbarrier_arrive.twin(bar) == 1
    P.mbarrier_arrive.twin(bar)
    assert P.mbarrier_try_wait_parity.twin(bar, 1) == 1
    P.mbarrier_wait_parity.twin(bar, 1)  # returns at once


def test_bulk_copy_completes_the_phase_only_with_all_bytes():
    bars = np.zeros(1, dtype=np.uint64)
    tile = np.zeros(32, dtype=np.uint32)
    src = np.arange(64, dtype=np.uint32) + np.uint32(1000)
    bar, dst = P.cvta_to_shared_u32.twin(bars), P.cvta_to_shared_u32.twin(tile)
    P.mbarrier_init.twin(bar, 1)
    P.mbarrier_arrive_expect_tx.twin(bar, 128)
    assert P.mbarrier_try_wait_parity.twin(bar, 0) == 0  # arrived, but no bytes yet
    P.cp_async_bulk_g2s.twin(dst, src, 16, 64, bar)
    assert P.mbarrier_try_wait_parity.twin(bar, 0) == 0  # half the bytes
    P.cp_async_bulk_g2s_hint.twin(dst + 64, src, 48, 64, bar, P.createpolicy_evict_first_b64.twin())
    assert P.mbarrier_try_wait_parity.twin(bar, 0) == 1
    np.testing.assert_array_equal(tile[:16], src[16:32])
    np.testing.assert_array_equal(tile[16:], src[48:64])
    # bytes may land before the producer announces them (tx-count goes negative meanwhile)
    P.cp_async_bulk_g2s.twin(dst, src, 0, 16, bar)
    assert P.mbarrier_try_wait_parity.twin(bar, 1) == 0
    P.mbarrier_arrive_expect_tx.twin(bar, 16)
    assert P.mbarrier_try_wait_parity.twin(bar, 1) == 1


def test_bulk_copy_rejects_what_the_gpu_would_fault_on():
    bars, tile = np.zeros(1, dtype=np.uint64), np.zeros(32, dtype=np.uint32)
    src = np.zeros(64, dtype=np.uint32)
    bar, dst = P.cvta_to_shared_u32.twin(bars), P.cvta_to_shared_u32.twin(tile)
    P.mbarrier_init.twin(bar, 1)
    with pytest.raises(AssertionError, match="multiple of 16"):
        P.cp_async_bulk_g2s.twin(dst, src, 0, 24, bar)
    with pytest.raises(AssertionError, match="misaligned"):
        P.cp_async_bulk_g2s.twin(dst, src, 2, 16, bar)
    with pytest.raises(RuntimeError, match="before mbarrier_init"):
        P.mbarrier_arrive.twin(P.cvta_to_shared_u32.twin(np.zeros(1, dtype=np.uint64)))


# ---- dp4a ------------------------------------------------------------------------------------
def test_dp4a_hand_cases():
    assert P.dp4a_s32.twin(0x01020304, 0x01010101, 0) == 10
    assert P.dp4a_s32.twin(0xFFFFFFFF, 0xFFFFFFFF, -4) == 0           # (-1)(-1) * 4 - 4
    assert P.dp4a_s32.twin(0x80808080, 0x80808080, 0) == 4 * 128 * 128
    assert P.dp4a_s32.twin(0x0000007F, 0x00000080, 7) == 127 * -128 + 7
    assert P.dp4a_s32.twin(0x01, 0x01, 2**31 - 1) == -2**31            # wraps like an s32 add
    for _ in range(200):
        a8, b8 = RNG.integers(-128, 128, 4), RNG.integers(-128, 128, 4)
        c = int(RNG.integers(-2**20, 2**20))
        a = int(np.array(a8, dtype=np.int8).view("<u4")[0])
        b = int(np.array(b8, dtype=np.int8).view("<u4")[0])
        assert P.dp4a_s32.twin(a, b, c) == int(a8 @ b8) + c
