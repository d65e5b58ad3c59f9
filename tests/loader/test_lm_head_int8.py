"""The int8 lm_head on the host: the per-row quantiser, the .nanoqwen tensors and header flag
(`nq pack --lm-head int8`), old files and old readers, the refusals, `nq info`, and the NumPy
reference reading the dequantised head."""
import numpy as np
import pytest

from nq.cli import main
from nq.config import tiny_config
from nq.loader import format as fm
from nq.loader.format import FormatError, NanoqwenFile, write_nanoqwen
from nq.loader.hf import LoadError, pack
from nq.loader.quant import dequantize_int8_rows, quantize_int8_rows
from nq.loader.synth import make_hf_snapshot, random_hf_weights, round_bf16
from nq.loader.weights import load_host_weights
from nq.ref import RefModel


# ---- the quantiser ---------------------------------------------------------------------------
def test_quantize_int8_rows_round_trip_and_error_bound():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((2500, 192)) * rng.uniform(0.01, 3, (2500, 1))).astype(np.float32)
    w[7, 11] = -40.0                                     # an outlier sets its row's scale
    w[8] = 0.0                                           # a zero row: scale 0, q 0, no NaN
    q, s = quantize_int8_rows(w)                         # 2500 rows: three chunks of 1024
    assert q.dtype == np.int8 and s.dtype == np.float32 and s.shape == (2500,)
    assert np.array_equal(s, (np.abs(w).max(axis=1) / np.float32(127)).astype(np.float32))
    assert q[7, 11] == -127 and np.abs(q).max() == 127 and q.min() >= -127
    assert s[8] == 0 and not q[8].any()
    deq = dequantize_int8_rows(q, s)
    assert deq.dtype == np.float32 and np.array_equal(deq, q * s[:, None])
    # round to nearest: at most half a step (plus fp32 rounding of w / s) from the source
    w64, s64 = w.astype(np.float64), s.astype(np.float64)[:, None]
    err = np.abs(q * s64 - w64)
    assert (err <= s64 * (0.5 + 1e-5)).all()
    # and it is the nearest grid point: q +- 1 is never closer (to fp32 rounding of w / s)
    for d in (-1, 1):
        alt = np.clip(q.astype(np.int32) + d, -127, 127) * s64
        assert (np.abs(alt - w64) >= err - 1e-5 * s64).all()
    # deterministic, and idempotent on its own output
    q2, s2 = quantize_int8_rows(deq)
    assert np.array_equal(q2, q) and np.allclose(s2, s, rtol=1e-6)


def test_quantize_int8_rows_refuses():
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_int8_rows(np.array([[1.0, np.nan]], np.float32))
    with pytest.raises(ValueError, match="2-D"):
        quantize_int8_rows(np.zeros(8, np.float32))
    with pytest.raises(ValueError, match="int8 \\(N, K\\)"):
        dequantize_int8_rows(np.zeros((2, 8), np.int8), np.zeros(3, np.float32))


# ---- the format ------------------------------------------------------------------------------
def tensors_for(cfg, lm_head, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for name, (dt, shape) in fm.expected_tensors(cfg, lm_head).items():
        if dt == np.uint32:
            out.append((name, rng.integers(0, 2**32, size=shape, dtype=np.uint32)))
        elif dt == np.int8:
            out.append((name, rng.integers(-127, 128, size=shape, dtype=np.int8)))
        else:
            out.append((name, rng.standard_normal(shape).astype(dt)))
    return out


@pytest.mark.parametrize("tie", [False, True])
def test_int8_file_round_trip(tmp_path, tie):
    cfg = tiny_config(num_layers=1, tie=tie)
    tensors = tensors_for(cfg, "int8")
    names = [n for n, _ in tensors]
    assert names[-2:] == ["lm_head.qweight", "lm_head.scales"] and "lm_head" not in names
    nf = NanoqwenFile(write_nanoqwen(tmp_path / "m.nanoqwen", cfg, iter(tensors), lm_head="int8"),
                      verify=True)
    assert nf.lm_head == "int8" and nf.header.version == 1 and nf.needs_nq == "0.2.0"
    assert nf.header.flags == fm.FLAG_LM_HEAD_INT8 | (fm.FLAG_TIED if tie else 0)
    for name, arr in tensors:
        assert nf.array(name).dtype == arr.dtype and np.array_equal(nf.array(name), arr), name
    assert nf.entry("lm_head.qweight").offset % 128 == 0
    with pytest.raises(KeyError, match="its lm_head is int8"):   # never the embedding instead
        nf.array("lm_head")
    text = nf.describe()
    assert "lm_head: int8" in text and "needs nq >= 0.2.0" in text
    assert ("embed_tokens stays fp16" in text) == tie


def test_fp16_files_are_written_as_before(tmp_path):
    """A default (fp16) file is byte for byte what the v1.0 writer made: flags as before, the
    reserved bytes zero (no `needs nq`), so every reader, old or new, opens it."""
    from test_format import reseal                     # the v1.0 header encoding
    for tie in (False, True):
        cfg = tiny_config(num_layers=1, tie=tie)
        path = write_nanoqwen(tmp_path / f"m{tie}.nanoqwen", cfg, iter(tensors_for(cfg, "fp16")))
        raw = path.read_bytes()
        assert raw[124:256] == bytes(132)
        reseal(path)
        assert path.read_bytes() == raw
        nf = NanoqwenFile(path, verify=True)
        assert nf.lm_head == "fp16" and nf.needs_nq == "" and nf.header.flags == int(tie)
        assert nf.describe().count("lm_head: fp16") == 1


def test_a_reader_that_does_not_know_a_flag_names_the_nq_it_needs(tmp_path, monkeypatch):
    """What an older nq says (one that knows bit 0 only: v1 readers before this change say
    "unknown header flags 0x2 (this nq knows 0x1); re-pack ..." and stop there), and what this
    one will say of a later flag."""
    cfg = tiny_config(num_layers=1)
    path = write_nanoqwen(tmp_path / "m.nanoqwen", cfg, iter(tensors_for(cfg, "int8")),
                          lm_head="int8")
    monkeypatch.setattr(fm, "KNOWN_FLAGS", fm.FLAG_TIED)
    with pytest.raises(FormatError, match=r"m\.nanoqwen: unknown header flags 0x2 .*this file "
                                          r"needs nq >= 0\.2\.0, upgrade nq or re-pack"):
        NanoqwenFile(path)


def test_refuses_a_mixed_up_lm_head(tmp_path):
    from test_format import reseal
    cfg = tiny_config(num_layers=1)
    int8 = tensors_for(cfg, "int8")
    # the int8 flag without its scales: missing
    path = tmp_path / "a.nanoqwen"
    write_nanoqwen(path, cfg, iter(int8[:-1]), check=False, lm_head="int8")
    with pytest.raises(FormatError, match="missing 1 required tensors .first: lm_head.scales"):
        NanoqwenFile(path)
    # int8 tensors in a file whose header says fp16: not expected
    path = write_nanoqwen(tmp_path / "b.nanoqwen", cfg, iter(int8), lm_head="int8")
    reseal(path, header={"flags": 0})
    with pytest.raises(FormatError, match="unexpected tensor 'lm_head.qweight'.*re-pack"):
        NanoqwenFile(path)
    # fp32 scales stored as fp16
    bad = [(n, a.astype(np.float16) if n == "lm_head.scales" else a) for n, a in int8]
    with pytest.raises(FormatError, match="lm_head.scales is float16 .*float32"):
        write_nanoqwen(tmp_path / "c.nanoqwen", cfg, iter(bad), lm_head="int8")
    with pytest.raises(ValueError, match="lm_head='int2'"):
        write_nanoqwen(tmp_path / "d.nanoqwen", cfg, iter(int8), lm_head="int2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.nanoqwen", "b.nanoqwen"]


def test_the_needs_field_is_under_the_checksum(tmp_path):
    cfg = tiny_config(num_layers=1)
    path = write_nanoqwen(tmp_path / "m.nanoqwen", cfg, iter(tensors_for(cfg, "int8")),
                          lm_head="int8")
    raw = bytearray(path.read_bytes())
    assert raw[124:129] == b"0.2.0"
    raw[126] ^= 1
    path.write_bytes(raw)
    with pytest.raises(FormatError, match="checksum mismatch"):
        NanoqwenFile(path)


# ---- pack, info, the reference ---------------------------------------------------------------
@pytest.mark.parametrize("tie", [False, True])
def test_pack_int8_equals_quantised_source(tmp_path, tie, capsys):
    cfg = tiny_config(num_layers=1, tie=tie)
    snap = make_hf_snapshot(tmp_path / "snap", cfg, seed=3)
    out = tmp_path / "m.nanoqwen"
    assert main(["pack", str(snap), str(out), "--lm-head", "int8"]) == 0
    nf = NanoqwenFile(out, verify=True)
    src = {k: round_bf16(v) for k, v in random_hf_weights(cfg, 3).items()}
    head = src["model.embed_tokens.weight" if tie else "lm_head.weight"]
    q, s = quantize_int8_rows(head)                    # from the source, not its fp16 rounding
    assert np.array_equal(nf.array("lm_head.qweight"), q)
    assert np.array_equal(nf.array("lm_head.scales"), s)
    assert np.array_equal(nf.array("embed_tokens"), src["model.embed_tokens.weight"].astype(np.float16))
    # the rest is the fp16 pack's, byte for byte
    ref = NanoqwenFile(pack(snap, tmp_path / "fp16.nanoqwen", progress=False, lm_head="fp16"))
    for name in ref.names():
        if name != "lm_head":
            assert np.array_equal(nf.array(name), ref.array(name)), name
    # the reference reads the dequantised head (tied too), the rest as before
    host, host16 = load_host_weights(nf), load_host_weights(ref)
    assert np.array_equal(host["lm_head"], dequantize_int8_rows(q, s))
    assert not np.shares_memory(host["lm_head"], host["embed_tokens"])
    for name in host16:
        if name != "lm_head":
            assert np.array_equal(host[name], host16[name]), name
    ids = [5, 9, 2, 77]
    got = RefModel(nf.config, host).forward(ids)
    h16 = RefModel(ref.config, host16).forward(ids)
    assert not np.array_equal(got, h16)
    np.testing.assert_allclose(got, h16, atol=0.02 * float(np.ptp(h16)))
    capsys.readouterr()
    assert main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "lm_head: int8" in text and "lm_head.scales" in text and "float32" in text


def test_pack_refuses_an_unknown_lm_head(tmp_path, tiny_snapshot, capsys):
    with pytest.raises(LoadError, match=r"lm_head='bf16': choose one of fp16, int8, int4, int4\+fp16$"):
        pack(tiny_snapshot, tmp_path / "m.nanoqwen", progress=False, lm_head="bf16")
    with pytest.raises(SystemExit):
        main(["pack", str(tiny_snapshot), str(tmp_path / "m.nanoqwen"), "--lm-head", "int2"])
    assert "invalid choice: 'int2'" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_ref_model_tied_with_its_own_head():
    cfg = tiny_config(num_layers=1, tie=True)
    from nq.ref import random_weights
    w = random_weights(cfg)
    base = RefModel(cfg, w).forward([1, 2, 3])
    other = RefModel(cfg, {**w, "lm_head": 2 * w["embed_tokens"]}).forward([1, 2, 3])
    np.testing.assert_allclose(other, 2 * base, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="lm_head has shape"):
        RefModel(cfg, {**w, "lm_head": w["embed_tokens"][:-1]})
