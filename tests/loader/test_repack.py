"""`nq pack OLD.nanoqwen NEW.nanoqwen --lm-head KIND` (nq/loader/repack.py): a file's head made
anew from its fp16 rows equals what a pack of the snapshot writes, and what it refuses."""
import numpy as np
import pytest

from nq.cli import main
from nq.config import tiny_config
from nq.loader.format import FormatError, NanoqwenFile
from nq.loader.hf import LoadError, pack
from nq.loader.repack import repack
from nq.loader.synth import make_hf_snapshot


def same_files(a: NanoqwenFile, b: NanoqwenFile):
    assert (a.lm_head, a.needs_nq, a.header.flags) == (b.lm_head, b.needs_nq, b.header.flags)
    assert a.config == b.config and a.header.source_revision == b.header.source_revision
    assert sorted(a.names()) == sorted(b.names())
    for name in a.names():
        assert np.array_equal(a.array(name), b.array(name)), name


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def snap(request, tmp_path_factory):
    # an fp16 checkpoint: its fp16 rows are the source, so re-packed heads equal packed ones
    cfg = tiny_config(num_layers=1, tie=request.param)
    return make_hf_snapshot(tmp_path_factory.mktemp("hf") / "snap", cfg, seed=11, dtype="float16")


@pytest.mark.parametrize("kind", ["int4+fp16", "int8", "int4"])
def test_an_fp16_file_repacked_equals_the_snapshot_packed(snap, tmp_path, kind, monkeypatch):
    import nq.loader.repack as R
    monkeypatch.setattr(R, "CONVERT_ROWS", 100)        # the 512-row head in six chunks
    old = pack(snap, tmp_path / "old.nanoqwen", progress=False, lm_head="fp16")
    new = repack(old, tmp_path / "new.nanoqwen", lm_head=kind, progress=False)
    want = pack(snap, tmp_path / "want.nanoqwen", progress=False, lm_head=kind)
    same_files(NanoqwenFile(new, verify=True), NanoqwenFile(want))


def test_the_default_file_back_to_fp16_through_the_cli(snap, tmp_path, capsys):
    old = pack(snap, tmp_path / "d.nanoqwen", progress=False)      # int4+fp16, the default
    out = tmp_path / "f.nanoqwen"
    assert main(["pack", str(old), str(out), "--lm-head", "fp16"]) == 0
    assert "nq: wrote" in capsys.readouterr().err
    same_files(NanoqwenFile(out), NanoqwenFile(pack(snap, tmp_path / "w.nanoqwen",
                                                    progress=False, lm_head="fp16")))
    # and the CLI's default re-packs it to int4+fp16 again, byte for byte the default pack
    again = tmp_path / "again.nanoqwen"
    assert main(["pack", str(out), str(again)]) == 0
    same_files(NanoqwenFile(again), NanoqwenFile(old))


def test_what_it_refuses(snap, tmp_path, capsys):
    f16 = pack(snap, tmp_path / "f16.nanoqwen", progress=False, lm_head="fp16")
    tied = NanoqwenFile(f16).config.tie_word_embeddings
    with pytest.raises(LoadError, match="already fp16; nothing to re-pack"):
        repack(f16, tmp_path / "x.nanoqwen", lm_head="fp16", progress=False)
    with pytest.raises(LoadError, match="choose one of"):
        repack(f16, tmp_path / "x.nanoqwen", lm_head="int2", progress=False)
    i4 = pack(snap, tmp_path / "i4.nanoqwen", progress=False, lm_head="int4")
    if tied:       # the embedding's rows serve
        assert NanoqwenFile(repack(i4, tmp_path / "y.nanoqwen", lm_head="fp16",
                                   progress=False)).lm_head == "fp16"
    else:
        with pytest.raises(LoadError, match="without the fp16 rows .* pack the HF snapshot"):
            repack(i4, tmp_path / "y.nanoqwen", lm_head="int4+fp16", progress=False)
    # a damaged payload is found before anything is written
    bad = tmp_path / "bad.nanoqwen"
    data = bytearray(f16.read_bytes())
    e = NanoqwenFile(f16).entry("embed_tokens")
    data[e.offset + 3] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="embed_tokens"):
        repack(bad, tmp_path / "z.nanoqwen", progress=False)
    assert not (tmp_path / "z.nanoqwen").exists()
    assert main(["pack", str(f16), str(tmp_path / "r.nanoqwen"), "--revision", "main"]) == 2
    assert "is a file, not a repo id; drop --revision" in capsys.readouterr().err
    assert not (tmp_path / "r.nanoqwen").exists()
