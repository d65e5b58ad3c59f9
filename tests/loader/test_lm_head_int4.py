"""The int4 lm_head on the host (`nq pack --lm-head int4`): the .nanoqwen tensors (a
projection's packed INT4 g128 form) and header flag bit 2, old readers, the refusals, pack
from the source's own precision, the free-space check, `nq info`, the CLI choice, the random
file script, and the NumPy reference reading the dequantised head."""
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import nq
from nq.cli import build_parser, main
from nq.config import DEFAULT_LM_HEAD, GROUP_SIZE, tiny_config
from nq.loader import format as fm
from nq.loader import hf
from nq.loader.format import FormatError, NanoqwenFile, write_nanoqwen
from nq.loader.hf import pack
from nq.loader.quant import (dequantize_int8_rows, dequantize_packed, quantize_int8_rows,
                             quantize_pack)
from nq.loader.synth import make_hf_snapshot, random_hf_weights, round_bf16
from nq.loader.weights import load_host_weights
from nq.ref import RefModel
from script_util import load_script
from test_format import reseal
from test_lm_head_int8 import tensors_for

ROOT = Path(__file__).resolve().parents[2]


def _version(v: str) -> tuple[int, ...]:
    return tuple(map(int, v.split(".")))


# ---- the names the runtime matches -----------------------------------------------------------
def test_public_names():
    assert fm.FLAG_LM_HEAD_INT4 == 4 and fm.FLAG_SINCE[fm.FLAG_LM_HEAD_INT4] == "0.3.0"
    assert fm.FLAG_LM_HEAD_FP16_ROWS == 8 and fm.FLAG_SINCE[fm.FLAG_LM_HEAD_FP16_ROWS] == "0.4.0"
    assert fm.LM_HEADS == ("fp16", "int8", "int4", "int4+fp16")
    assert fm.LM_HEAD_FLAGS == {"int8": fm.FLAG_LM_HEAD_INT8, "int4": fm.FLAG_LM_HEAD_INT4,
                                "int4+fp16": fm.FLAG_LM_HEAD_INT4 | fm.FLAG_LM_HEAD_FP16_ROWS}
    assert fm.KNOWN_FLAGS == (fm.FLAG_TIED | fm.FLAG_LM_HEAD_INT8 | fm.FLAG_LM_HEAD_INT4
                              | fm.FLAG_LM_HEAD_FP16_ROWS) == 15
    # this nq reads every flag it writes, and the package says the same version as the module
    assert max(map(_version, fm.FLAG_SINCE.values())) <= _version(nq.__version__)
    toml = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', toml, re.M).group(1) == nq.__version__ == "0.5.0"


@pytest.mark.parametrize("tie", [False, True])
def test_expected_tensors_are_a_projections_form(tie):
    cfg = tiny_config(num_layers=1, tie=tie)
    v, h = cfg.vocab_size, cfg.hidden_size
    want = fm.expected_tensors(cfg, "int4")
    assert list(want)[-2:] == ["lm_head.qweight", "lm_head.scales"] and "lm_head" not in want
    assert want["lm_head.qweight"] == (np.dtype("<u4"), (v, h // 8))
    assert want["lm_head.scales"] == (np.dtype("<f2"), (v, h // GROUP_SIZE))
    assert want["embed_tokens"] == (np.dtype("<f2"), (v, h))          # kept for the lookup
    # exactly what quantize_pack gives for a (vocab, hidden) matrix, as for a projection
    q, s = quantize_pack(np.ones((v, h), np.float32))
    assert want["lm_head.qweight"] == (q.dtype, q.shape)
    assert want["lm_head.scales"] == (s.dtype, s.shape)
    proj = fm.expected_tensors(cfg)["layers.0.q_proj.qweight"]
    assert proj[0] == want["lm_head.qweight"][0]
    # the rest is the fp16 file's, in its order; the count follows
    fp16 = {n: t for n, t in fm.expected_tensors(cfg).items() if n != "lm_head"}
    assert {n: t for n, t in want.items() if not n.startswith("lm_head.")} == fp16
    assert fm.expected_count(cfg, "int4") == len(want) == len(fp16) + 2


# ---- the format ------------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [False, True])
def test_int4_file_round_trip(tmp_path, tie):
    cfg = tiny_config(num_layers=1, tie=tie)
    tensors = tensors_for(cfg, "int4")
    nf = NanoqwenFile(write_nanoqwen(tmp_path / "m.nanoqwen", cfg, iter(tensors), lm_head="int4"),
                      verify=True)
    assert nf.lm_head == "int4" and nf.header.version == 1 and nf.needs_nq == "0.3.0"
    assert nf.header.flags == fm.FLAG_LM_HEAD_INT4 | (fm.FLAG_TIED if tie else 0)
    assert (tmp_path / "m.nanoqwen").read_bytes()[124:140] == b"0.3.0".ljust(16, b"\0")
    for name, arr in tensors:
        assert nf.array(name).dtype == arr.dtype and np.array_equal(nf.array(name), arr), name
    assert nf.array("lm_head.qweight").dtype == np.uint32
    assert nf.array("lm_head.scales").dtype == np.float16
    assert nf.entry("lm_head.qweight").offset % 128 == 0
    with pytest.raises(KeyError, match="its lm_head is int4: lm_head.qweight, lm_head.scales"):
        nf.array("lm_head")                              # never the embedding instead
    text = nf.describe()
    assert "lm_head: int4" in text and "needs nq >= 0.3.0" in text
    assert ("embed_tokens stays fp16" in text) == tie


@pytest.mark.parametrize("known, knows", [(fm.FLAG_TIED | fm.FLAG_LM_HEAD_INT8, "0x3"),
                                          (fm.FLAG_TIED, "0x1")])
@pytest.mark.parametrize("tie", [False, True])
def test_an_older_reader_refuses_it_naming_the_nq_it_needs(tmp_path, monkeypatch, known, knows,
                                                           tie):
    """A 0.2.x reader knows bits 0 and 1 (a 0.1.x one bit 0): both stop at the flags check
    instead of reading the int4 words as something else."""
    cfg = tiny_config(num_layers=1, tie=tie)
    path = write_nanoqwen(tmp_path / "m.nanoqwen", cfg, iter(tensors_for(cfg, "int4")),
                          lm_head="int4")
    NanoqwenFile(path).close()                           # this reader opens it
    monkeypatch.setattr(fm, "KNOWN_FLAGS", known)
    with pytest.raises(FormatError, match=rf"m\.nanoqwen: unknown header flags 0x4 \(nq \S+ knows "
                                          rf"{knows}\); this file needs nq >= 0\.3\.0, upgrade "
                                          r"nq or re-pack"):
        NanoqwenFile(path)


def test_the_needs_field_is_the_newest_flags():
    assert fm._needs_nq(fm.FLAG_LM_HEAD_INT4) == b"0.3.0"
    assert fm._needs_nq(fm.FLAG_TIED | fm.FLAG_LM_HEAD_INT4) == b"0.3.0"
    assert fm._needs_nq(fm.FLAG_TIED | fm.FLAG_LM_HEAD_INT8) == b"0.2.0"
    assert fm._needs_nq(fm.FLAG_TIED) == b""


@pytest.mark.parametrize("bits", [fm.FLAG_LM_HEAD_INT8 | fm.FLAG_LM_HEAD_INT4,
                                  fm.FLAG_LM_HEAD_FP16_ROWS,
                                  fm.FLAG_LM_HEAD_INT8 | fm.FLAG_LM_HEAD_FP16_ROWS])
@pytest.mark.parametrize("lm_head", ["int8", "int4"])
@pytest.mark.parametrize("tie", [False, True])
def test_refuses_head_flags_no_writer_sets(tmp_path, lm_head, tie, bits):
    cfg = tiny_config(num_layers=1, tie=tie)
    path = write_nanoqwen(tmp_path / "m.nanoqwen", cfg, iter(tensors_for(cfg, lm_head)),
                          lm_head=lm_head)
    flags = bits | (fm.FLAG_TIED if tie else 0)
    reseal(path, header={"flags": flags})
    with pytest.raises(FormatError, match=rf"m\.nanoqwen: header flags {flags:#x} mark no lm_head "
                                          r"nq writes \(int8 0x2, int4 0x4, int4\+fp16 0xc\); the "
                                          r"file is corrupt, re-pack with `nq pack`"):
        NanoqwenFile(path)


def test_refuses_a_mixed_up_lm_head(tmp_path):
    cfg = tiny_config(num_layers=1)
    int4, int8 = tensors_for(cfg, "int4"), tensors_for(cfg, "int8")
    # int4 tensors under the int8 flag, and the other way round: the dtypes say which
    path = write_nanoqwen(tmp_path / "a.nanoqwen", cfg, iter(int4), lm_head="int4")
    reseal(path, header={"flags": fm.FLAG_LM_HEAD_INT8})
    with pytest.raises(FormatError, match=r"tensor lm_head.qweight is uint32 \(512, 32\), the "
                                          r"config needs int8 \(512, 256\); re-pack"):
        NanoqwenFile(path)
    path = write_nanoqwen(tmp_path / "b.nanoqwen", cfg, iter(int8), lm_head="int8")
    reseal(path, header={"flags": fm.FLAG_LM_HEAD_INT4})
    with pytest.raises(FormatError, match=r"tensor lm_head.qweight is int8 \(512, 256\), the "
                                          r"config needs uint32 \(512, 32\); re-pack"):
        NanoqwenFile(path)
    # int4 tensors in a file whose header says fp16: not expected
    path = write_nanoqwen(tmp_path / "c.nanoqwen", cfg, iter(int4), lm_head="int4")
    reseal(path, header={"flags": 0})
    with pytest.raises(FormatError, match="unexpected tensor 'lm_head.qweight'.*re-pack"):
        NanoqwenFile(path)
    # the int4 flag without its scales: missing
    write_nanoqwen(tmp_path / "d.nanoqwen", cfg, iter(int4[:-1]), check=False, lm_head="int4")
    with pytest.raises(FormatError, match="missing 1 required tensors .first: lm_head.scales"):
        NanoqwenFile(tmp_path / "d.nanoqwen")
    # the writer refuses int8's fp32 scales, and a head the format has no flag for
    bad = [(n, a.astype(np.float32) if n == "lm_head.scales" else a) for n, a in int4]
    with pytest.raises(FormatError, match="lm_head.scales is float32 .*float16"):
        write_nanoqwen(tmp_path / "e.nanoqwen", cfg, iter(bad), lm_head="int4")
    with pytest.raises(ValueError, match="lm_head='int2': a .nanoqwen lm_head is one of "
                                         "fp16, int8, int4"):
        write_nanoqwen(tmp_path / "f.nanoqwen", cfg, iter(int4), lm_head="int2")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{c}.nanoqwen" for c in "abcd"]


# ---- pack, info, the reference ---------------------------------------------------------------
@pytest.mark.parametrize("dtype, tie", [("bfloat16", False), ("bfloat16", True),
                                        ("float32", False), ("float32", True)])
def test_pack_int4_equals_quantised_source(tmp_path, monkeypatch, capsys, dtype, tie):
    # 100-row chunks: the 512-row head is quantised in six pieces, the last one short
    monkeypatch.setattr(hf, "CONVERT_ROWS", 100)
    cfg = tiny_config(num_layers=1, tie=tie)
    snap = make_hf_snapshot(tmp_path / "snap", cfg, seed=3, dtype=dtype)
    out = tmp_path / "m.nanoqwen"
    assert main(["pack", str(snap), str(out), "--lm-head", "int4"]) == 0
    nf = NanoqwenFile(out, verify=True)
    assert nf.lm_head == "int4" and nf.needs_nq == "0.3.0"
    src = {k: round_bf16(v) if dtype == "bfloat16" else v
           for k, v in random_hf_weights(cfg, 3).items()}
    head = src["model.embed_tokens.weight" if tie else "lm_head.weight"]
    q, s = quantize_pack(head)                          # from the source, not its fp16 rounding
    assert np.array_equal(nf.array("lm_head.qweight"), q)
    assert np.array_equal(nf.array("lm_head.scales"), s)
    if dtype == "float32":                              # where fp16 first would differ
        q16, s16 = quantize_pack(head.astype(np.float16).astype(np.float32))
        assert not (np.array_equal(q16, q) and np.array_equal(s16, s))
    embed = src["model.embed_tokens.weight"].astype(np.float16)
    assert np.array_equal(nf.array("embed_tokens"), embed)
    # the rest is the fp16 pack's, byte for byte
    ref = NanoqwenFile(pack(snap, tmp_path / "fp16.nanoqwen", progress=False, lm_head="fp16"))
    assert set(nf.names()) == set(ref.names()) - {"lm_head"} | {"lm_head.qweight", "lm_head.scales"}
    for name in ref.names():
        if name != "lm_head":
            assert np.array_equal(nf.array(name), ref.array(name)), name
    # the reference reads the dequantised head (tied too), the rest as before; a tied one's
    # candidates would be rescored by the embedding (the next test): not here
    monkeypatch.setenv("NQ_RESCORE", "0")
    host, host16 = load_host_weights(nf), load_host_weights(ref)
    assert "lm_head.exact" not in host
    assert host["lm_head"].dtype == np.float32
    assert np.array_equal(host["lm_head"], dequantize_packed(q, s))
    assert not np.shares_memory(host["lm_head"], host["embed_tokens"])
    for name in host16:
        if name != "lm_head":
            assert np.array_equal(host[name], host16[name]), name
    ids = [5, 9, 2, 77]
    got = RefModel(nf.config, host).forward(ids)
    h16 = RefModel(ref.config, host16).forward(ids)
    np.testing.assert_allclose(got, h16, atol=0.1 * float(np.ptp(h16)))
    # and it costs more than the int8 head of the same source
    h8 = RefModel(ref.config, {**host16, "lm_head": dequantize_int8_rows(*quantize_int8_rows(head))}
                  ).forward(ids)
    assert np.abs(got - h16).mean() > 2 * np.abs(h8 - h16).mean()
    capsys.readouterr()
    assert main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "lm_head: int4" in text and "needs nq >= 0.3.0" in text
    assert re.search(r"lm_head\.qweight +uint32 +512x32 ", text)
    assert re.search(r"lm_head\.scales +float16 +512x2 ", text)


def test_the_space_check_counts_the_int4_head(tmp_path, tiny_snapshot, monkeypatch):
    """Free space of one byte under the fp16 file: the fp16 pack is refused, the int4 pack
    (a quarter of the head's bytes) fits; one byte under the int4 file refuses it too."""
    fp16 = pack(tiny_snapshot, tmp_path / "fp16.nanoqwen", progress=False,
                lm_head="fp16").stat().st_size
    int4 = pack(tiny_snapshot, tmp_path / "int4.nanoqwen", progress=False, lm_head="int4")
    int4 = int4.stat().st_size
    assert int4 < fp16
    real = shutil.disk_usage
    for free, lm_head, fits in [(fp16 - 1, "fp16", False), (fp16 - 1, "int4", True),
                                (int4 - 1, "int4", False)]:
        monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=free))
        out = tmp_path / "out" / f"{lm_head}-{free}.nanoqwen"
        if fits:
            nf = NanoqwenFile(pack(tiny_snapshot, out, progress=False, lm_head=lm_head))
            assert nf.lm_head == lm_head
        else:
            with pytest.raises(hf.LoadError, match="the packed model needs .*; free some space"):
                pack(tiny_snapshot, out, progress=False, lm_head=lm_head)
            assert not out.exists()


# ---- the command line and the random-file script ---------------------------------------------
def test_the_cli_offers_every_lm_head(tmp_path, tiny_snapshot, capsys):
    parser = build_parser()
    for lm_head in fm.LM_HEADS:
        assert parser.parse_args(["pack", "src", "out", "--lm-head", lm_head]).lm_head == lm_head
    assert parser.parse_args(["pack", "src", "out"]).lm_head == "int4+fp16" == DEFAULT_LM_HEAD
    with pytest.raises(SystemExit):
        main(["pack", str(tiny_snapshot), str(tmp_path / "m.nanoqwen"), "--lm-head", "int2"])
    assert "invalid choice: 'int2'" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    with pytest.raises(SystemExit):
        main(["pack", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "{fp16,int8,int4,int4+fp16}" in text and "INT4 g128" in text and "nq >= 0.3.0" in text
    assert "nq >= 0.4.0" in text and "rescores" in text
    assert "scripts/lm_head_quality.py" in text and "nq >= 0.2.0" in text


def _random_script():
    return load_script("make_random_nanoqwen")


@pytest.mark.parametrize("lm_head", ["int8", "int4"])
def test_random_file_script_writes_a_quantised_head(tmp_path, lm_head):
    """`--lm-head int4` as `nq pack` writes it, with --text-ids: the head's rows outside the
    tokenizer's merged tokens are zero, the others random around unit logits."""
    mod = _random_script()
    cfg = tiny_config(num_layers=1)
    mod.PRESETS = {"tiny": cfg}
    out = tmp_path / "r.nanoqwen"
    assert mod.main(["tiny", str(out), "--lm-head", lm_head, "--text-ids"]) == 0
    nf = NanoqwenFile(out, verify=True)
    assert nf.lm_head == lm_head and nf.needs_nq == fm.FLAG_SINCE[fm.LM_HEAD_FLAGS[lm_head]]
    head = load_host_weights(nf)["lm_head"]
    text = next(i for i in range(256, cfg.vocab_size) if not head[i].any())
    assert 256 < text < cfg.vocab_size and not head[:256].any() and not head[text:].any()
    assert head[256:text].any(axis=1).all() and np.isfinite(head).all()
    assert 0.5 < head[256:text].std() * np.sqrt(cfg.hidden_size) < 2
    with pytest.raises(SystemExit):
        mod.main(["tiny", str(out), "--lm-head", "int2"])


@pytest.mark.parametrize("tie", [False, True])
def test_pack_int4_fp16_keeps_the_rows_that_rescore(tmp_path, tie):
    """`--lm-head int4+fp16`: the INT4 head of `int4` and, untied, the fp16 lm_head beside it
    (bits 2 and 3, needs nq 0.4.0); tied, the embedding serves.  The reference then rescores
    the INT4 head's candidates with those rows (as the GPU step does), so its greedy token is
    the fp16 head's where the INT4 head alone picks another."""
    from nq.kernels.lm_head_rescore import row_bounds
    from nq.loader.weights import rescore_rows_of
    cfg = tiny_config(num_layers=1, tie=tie)
    snap = make_hf_snapshot(tmp_path / "snap", cfg, seed=3)
    nf = NanoqwenFile(pack(snap, tmp_path / "m.nanoqwen", progress=False, lm_head="int4+fp16"),
                      verify=True)
    i4 = NanoqwenFile(pack(snap, tmp_path / "i4.nanoqwen", progress=False, lm_head="int4"))
    f16 = NanoqwenFile(pack(snap, tmp_path / "f16.nanoqwen", progress=False, lm_head="fp16"))
    assert nf.lm_head == "int4+fp16" and nf.needs_nq == "0.4.0"
    default = NanoqwenFile(pack(snap, tmp_path / "d.nanoqwen", progress=False))  # pack's default
    assert default.lm_head == "int4+fp16" and default.names() == nf.names()
    for name in nf.names():
        assert np.array_equal(default.array(name), nf.array(name)), name
    assert nf.header.flags & (fm.FLAG_LM_HEAD_INT4 | fm.FLAG_LM_HEAD_FP16_ROWS) == 12
    assert set(nf.names()) == set(i4.names()) | ({"lm_head"} if not tie else set())
    for name in i4.names():
        assert np.array_equal(nf.array(name), i4.array(name)), name
    if not tie:
        assert np.array_equal(nf.array("lm_head"), f16.array("lm_head"))
    assert rescore_rows_of(nf) == ("embed_tokens" if tie else "lm_head")
    assert rescore_rows_of(i4) == ("embed_tokens" if tie else None)   # untied int4: no rows
    host = load_host_weights(nf)
    rows = host["embed_tokens"] if tie else np.asarray(f16.array("lm_head"), np.float32)
    np.testing.assert_array_equal(host["lm_head.exact"], rows)
    np.testing.assert_array_equal(host["lm_head.bound"], row_bounds(nf.array("lm_head.scales")))
    assert "int4+fp16" in nf.describe() and "rescored by" in nf.describe()
    # the reference: candidates' logits from the fp16 rows, the rest the INT4 head's
    ids = [5, 9, 2, 77, 300, 41]
    got = RefModel(cfg, host).forward(ids)
    plain = RefModel(cfg, {k: v for k, v in host.items() if not k.startswith("lm_head.")})
    int4 = plain.forward(ids)
    want = RefModel(cfg, load_host_weights(f16)).forward(ids)
    for t in range(len(ids)):
        cand = got[t] != int4[t]
        assert 0 < cand.sum() < cand.size / 2
        np.testing.assert_allclose(got[t][cand], want[t][cand], rtol=1e-4, atol=1e-4)
        assert np.argmax(got[t]) == np.argmax(want[t])
