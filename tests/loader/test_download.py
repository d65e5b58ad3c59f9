"""The repo-id path of resolve_snapshot/pack against a fake, offline Hugging Face cache.

The cache is laid out as huggingface_hub lays it out (models--Org--Name/{blobs, refs/main,
snapshots/<sha>/ -> ../../blobs}), under a tmp HF_HOME with HF_HUB_OFFLINE=1, so the real
snapshot_download resolves it with no network.
"""
import hashlib
import os

import pytest

from nq.config import tiny_config
from nq.loader.format import NanoqwenFile
from nq.loader.hf import LoadError, pack, resolve_snapshot, snapshot_revision
from nq.loader.synth import make_hf_snapshot

SHA = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(hf_home, repo_id, build_dir):
    """Move the files of build_dir into an HF-cache layout for repo_id at revision SHA."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    snap = repo / "snapshots" / SHA
    snap.mkdir(parents=True)
    for f in sorted(build_dir.iterdir()):
        blob = hashlib.sha256(f.read_bytes()).hexdigest()
        f.rename(repo / "blobs" / blob)
        (snap / f.name).symlink_to(os.path.join("..", "..", "blobs", blob))
    return snap


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    hf_home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = tiny_config(num_layers=1)
    snap = fake_hub_cache(hf_home, "FakeOrg/Tiny-Coder",
                          make_hf_snapshot(tmp_path / "build", cfg, seed=3))
    return snap, cfg


def test_repo_id_resolves_from_offline_cache(offline_hub, tmp_path):
    snap, cfg = offline_hub
    got = resolve_snapshot("FakeOrg/Tiny-Coder", progress=False)
    assert got == snap and snapshot_revision(got) == SHA
    assert resolve_snapshot("FakeOrg/Tiny-Coder", revision=SHA, progress=False) == snap
    out = pack("FakeOrg/Tiny-Coder", tmp_path / "m.nanoqwen", progress=False)
    nf = NanoqwenFile(out, verify=True)
    assert nf.header.source_revision == SHA
    assert nf.config == cfg.replace(name="FakeOrg/Tiny-Coder")
    assert nf.meta("config.json") == (snap / "config.json").read_bytes()


def test_local_directory_is_used_as_is(offline_hub):
    snap, _ = offline_hub
    assert resolve_snapshot(str(snap)) == snap
    assert snapshot_revision(snap.parent.parent / "blobs") == ""


def test_uncached_repo_offline_is_a_clear_error(offline_hub):
    with pytest.raises(LoadError, match=r"FakeOrg/Not-There: not in the Hugging Face cache.*"
                                        r"HF_HUB_OFFLINE=1.*local snapshot directory"):
        resolve_snapshot("FakeOrg/Not-There", progress=False)
    with pytest.raises(LoadError, match=r"FakeOrg/Tiny-Coder@v9: not in the Hugging Face cache"):
        resolve_snapshot("FakeOrg/Tiny-Coder", revision="v9", progress=False)


def test_generate_with_no_model_packs_the_default_repo_once(tmp_path, monkeypatch, capsys):
    """`nq generate` with no -m: the default repo id, resolved offline, packed once into $NQ_CACHE."""
    from nq import cli
    from nq.loader import resolve
    hf_home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("NQ_CACHE", str(tmp_path / "nqcache"))
    fake_hub_cache(hf_home, resolve.DEFAULT_REPO, make_hf_snapshot(tmp_path / "b", tiny_config(num_layers=1)))
    argv = ["generate", "--backend", "numpy", "-p", "hi", "-n", "2", "--temp", "0", "--json"]
    assert cli.main(argv) == 0
    packed = list((tmp_path / "nqcache").glob("*.nanoqwen"))
    assert len(packed) == 1 and SHA in packed[0].name
    assert "packing" in capsys.readouterr().err
    mtime = packed[0].stat().st_mtime_ns
    assert cli.main(argv) == 0  # the second run reuses the packed file
    assert packed[0].stat().st_mtime_ns == mtime
    assert "packing" not in capsys.readouterr().err
