"""INT4 quantiser and ValueShuffle packing: round trips, a hand-worked word, edge values."""
import numpy as np
import pytest

from nq.loader.quant import (dequantize_int4, dequantize_packed, fake_quantize_matrix,
                             pack_value_shuffle, quantize_int4, quantize_pack,
                             unpack_value_shuffle)


def test_value_shuffle_hand_worked_word():
    # w0..w7 = 1, 2, 3, 4, 5, 6, 7, -1; slots from the lowest nibble: w0 w2 w4 w6 w1 w3 w5 w7
    # = 1 3 5 7 2 4 6 -1(0xF) -> 0xF6427531 reading nibbles from the highest down.
    q = np.array([[1, 2, 3, 4, 5, 6, 7, -1]], np.int8)
    packed = pack_value_shuffle(q)
    assert packed.dtype == np.uint32 and packed.shape == (1, 1)
    assert int(packed[0, 0]) == 0xF6427531
    # The reason for the order: shifts 0, 4, 8, 12 masked by 0x000F000F give adjacent pairs
    # (w0, w1), (w2, w3), (w4, w5), (w6, w7) in the low/high 16-bit halves.
    word = int(packed[0, 0])
    pairs = [((word >> s) & 0x000F000F) for s in (0, 4, 8, 12)]
    assert [(p & 0xF, p >> 16) for p in pairs] == [(1, 2), (3, 4), (5, 6), (7, 0xF)]


def test_pack_unpack_round_trip_all_values():
    rng = np.random.default_rng(0)
    q = rng.integers(-8, 8, size=(24, 256), dtype=np.int8)
    q[0, :16] = np.arange(-8, 8)                      # every nibble value at least once
    assert np.array_equal(unpack_value_shuffle(pack_value_shuffle(q)), q)


def test_quantize_edge_values_and_sign_of_absmax():
    k = 128
    w = np.zeros((3, k), np.float32)
    w[0, :15] = np.arange(-7, 8)                      # absmax 7 -> scale 1 -> q = w exactly
    w[1, 5] = -3.5                                    # negative absmax maps to -7, not +7
    w[1, 6] = 1.0
    # row 2 stays zero: scale 0, q 0, no NaN
    q, s = quantize_int4(w)
    assert q.dtype == np.int8 and s.dtype == np.float16 and s.shape == (3, 1)
    assert np.array_equal(q[0, :15], np.arange(-7, 8)) and s[0, 0] == 1.0
    assert q[1, 5] == -7 and q[1, 6] == 2 and s[1, 0] == np.float16(0.5)
    assert s[2, 0] == 0 and not q[2].any()
    d = dequantize_int4(q, s)
    assert np.isfinite(d).all() and np.array_equal(d[0], w[0]) and not d[2].any()


def test_quantize_against_rounded_fp16_scale():
    rng = np.random.default_rng(1)
    w = (0.02 * rng.standard_normal((64, 384))).astype(np.float32)
    q, s = quantize_int4(w)
    assert q.min() >= -7 and q.max() <= 7
    # Every group reaches +-7 (its absmax), and q is the nearest grid point of the *stored*
    # scale, so the error is at most half a step except where the clip at 7 bites.
    g = w.reshape(64, 3, 128)
    assert np.array_equal(np.abs(q.reshape(64, 3, 128)).max(axis=2), np.full((64, 3), 7))
    s32 = s.astype(np.float32)[:, :, None]
    assert np.array_equal(q.reshape(64, 3, 128), np.clip(np.rint(g / s32), -7, 7))
    err = np.abs(dequantize_int4(q, s).reshape(64, 3, 128) - g)
    assert (err <= 0.5 * s32 * 1.01 + np.abs(np.abs(g) - 7 * s32)).all()


def test_packed_dequantisation_equals_quantiser_exactly():
    rng = np.random.default_rng(2)
    w = (0.05 * rng.standard_normal((40, 256))).astype(np.float32)
    w[3, 128:] = 0                                    # a zero group inside a packed matrix
    q, s = quantize_int4(w)
    packed, s2 = quantize_pack(w)
    assert np.array_equal(s, s2)
    assert np.array_equal(packed, pack_value_shuffle(q))
    assert np.array_equal(dequantize_packed(packed, s2), dequantize_int4(q, s))
    assert np.array_equal(fake_quantize_matrix(w), dequantize_int4(q, s))


def test_chunked_path_matches_across_chunk_boundaries(monkeypatch):
    import nq.loader.quant as quant
    rng = np.random.default_rng(3)
    w = rng.standard_normal((37, 256)).astype(np.float32)
    whole = quant.quantize_pack(w)
    monkeypatch.setattr(quant, "CHUNK_ROWS", 8)       # 37 rows: four full chunks and a tail
    chunked = quant.quantize_pack(w)
    assert all(np.array_equal(a, b) for a, b in zip(whole, chunked))
    assert np.array_equal(quant.quantize_int4(w)[1], whole[1])


def test_quantize_refuses_bad_input():
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize_int4(np.zeros((4, 100), np.float32))
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_int4(np.full((1, 128), np.nan, np.float32))
    with pytest.raises(ValueError, match="fp16 scale"):
        quantize_int4(np.full((1, 128), 1e6, np.float32))
