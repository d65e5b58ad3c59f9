"""Checkpoints `nq pack` refuses, each named with its fault and fix, before any tensor is
quantised and with nothing left where the output would go.

Every case damages a copy of one small synthetic snapshot (nq/loader/synth.py): a missing
shard, a tensor of the wrong shape or an unknown dtype, a Llama config, rope_scaling, no
tokenizer, a hidden size that is not a multiple of 128, a truncated shard, unreadable JSON.
"""
import json
import shutil
from collections import namedtuple

import pytest

from nq.config import tiny_config
from nq.loader import hf
from nq.loader.hf import LoadError, pack
from nq.loader.synth import make_hf_snapshot


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return make_hf_snapshot(tmp_path_factory.mktemp("hf") / "snap", tiny_config(num_layers=1),
                            shards=2)


def _edit_json(path, **changes):
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))


def _edit_st_header(path, name, **changes):
    """Rewrite one tensor's entry in a safetensors header, keeping the header's length."""
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header[name].update(changes)
    blob = json.dumps(header, separators=(",", ":")).encode()
    assert len(blob) <= n
    raw[8:8 + n] = blob.ljust(n)
    path.write_bytes(raw)


def _shard_of(snap, hf_name):
    index = json.loads((snap / "model.safetensors.index.json").read_text())
    return snap / index["weight_map"][hf_name]


K = "model.layers.0.self_attn.k_proj.weight"
Case = namedtuple("Case", "damage message")
CASES = {
    "missing shard": Case(lambda s: (s / "model-00002-of-00002.safetensors").unlink(),
                          r"model-00002-of-00002\.safetensors: listed in model\.safetensors\.index"
                          r"\.json but missing; re-download the snapshot"),
    "wrong shape": Case(lambda s: _edit_st_header(_shard_of(s, K), K, shape=[64, 512]),
                        r"model-0000\d-of-00002\.safetensors: tensor model\.layers\.0\.self_attn"
                        r"\.k_proj\.weight has shape \(64, 512\), config\.json implies \(128, 256\); "
                        r"the checkpoint and its config\.json disagree"),
    "unknown dtype": Case(lambda s: _edit_st_header(_shard_of(s, K), K, dtype="F8_E4M3"),
                          r"safetensors: tensor model\.layers\.0\.self_attn\.k_proj\.weight has "
                          r"dtype F8_E4M3; nq packs BF16, F16 and F32 checkpoints"),
    "llama": Case(lambda s: _edit_json(s / "config.json", model_type="llama",
                                       architectures=["LlamaForCausalLM"]),
                  r"config\.json: unsupported model config \(snap\): model_type='llama', "
                  r"architectures=\['LlamaForCausalLM'\]; nq runs Qwen2/Qwen2\.5"),
    "rope_scaling": Case(lambda s: _edit_json(s / "config.json", rope_scaling={
                             "type": "yarn", "factor": 4.0}),
                         r"config\.json: .*rope_scaling=.*yarn.*remove rope_scaling from "
                         r"config\.json"),
    "no tokenizer": Case(lambda s: (s / "tokenizer.json").unlink(),
                         r"snap: no tokenizer\.json; a \.nanoqwen carries its tokenizer"),
    "hidden 192": Case(lambda s: _edit_json(s / "config.json", hidden_size=192,
                                            num_attention_heads=3, num_key_value_heads=1),
                       r"config\.json: .*hidden_size=192 is not a multiple of 128"),
    "truncated shard": Case(lambda s: _truncate(s / "model-00002-of-00002.safetensors"),
                            r"model-00002-of-00002\.safetensors: tensor .* runs past the end of the "
                            r"file; the download is truncated, re-download it"),
    "config not JSON": Case(lambda s: (s / "config.json").write_text("{'hidden_size': 256"),
                            r"config\.json: not valid JSON \(.*\); re-download the snapshot"),
    "no config": Case(lambda s: (s / "config.json").unlink(),
                      r"snap: no config\.json; is this a Hugging Face snapshot folder\?"),
    "shard outside": Case(lambda s: _edit_json(s / "model.safetensors.index.json", weight_map={
                              K: "../elsewhere.safetensors"}),
                          r"index\.json: shard names \['\.\./elsewhere\.safetensors'\] are not "
                          r"file names in the snapshot"),
    "bad st header": Case(lambda s: _edit_st_header(_shard_of(s, K), K, data_offsets=[9, 3]),
                          r"safetensors: unreadable safetensors header \(tensor model\.layers"),
}


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


@pytest.mark.parametrize("case", list(CASES))
def test_refused_before_any_work(case, sharded, tmp_path, monkeypatch):
    snap = tmp_path / "snap"
    shutil.copytree(sharded, snap)
    CASES[case].damage(snap)
    quantised = []
    monkeypatch.setattr(hf, "quantize_pack", lambda w: quantised.append(1))
    out = tmp_path / "out" / "m.nanoqwen"
    with pytest.raises(LoadError, match=CASES[case].message):
        pack(snap, out, progress=False)
    assert quantised == [] and not (tmp_path / "out").exists()


def test_full_disk_is_refused_before_packing(sharded, tmp_path, monkeypatch):
    """The free space is checked against the packed size before the first tensor."""
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=10_000))
    with pytest.raises(LoadError, match=r"m\.nanoqwen: the packed model needs 0\.8 MiB, the file "
                                        r"system holding .* has 0\.0 MiB free; free some space"):
        pack(sharded, tmp_path / "m.nanoqwen", progress=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("make, message", [
    (lambda d: d.mkdir(), r"is a directory; give the output file's path, e\.g\. .*model\.nanoqwen"),
    (lambda d: None, None),
])
def test_output_path_checked_first(sharded, tmp_path, monkeypatch, make, message):
    """A directory as the output is refused before the snapshot is even looked at."""
    out = tmp_path / "m.nanoqwen"
    make(out)
    if message is None:                   # a file below a file: the folder cannot be made
        (tmp_path / "f").write_text("x")
        out, message = tmp_path / "f" / "m.nanoqwen", r"f: is a file, so .* cannot be created"
    monkeypatch.setattr(hf, "resolve_snapshot", lambda *a, **k: pytest.fail("looked at the snapshot"))
    with pytest.raises(ValueError, match=message):
        pack(sharded, out, progress=False)
