"""HF snapshot -> .nanoqwen: the packed tensors equal quantise(source) for every source dtype,
sharded and tied checkpoints, embedded meta files, and failures that leave nothing behind."""
import json
import os

import numpy as np
import pytest

from nq.config import tiny_config
from nq.loader import hf
from nq.loader.format import NanoqwenFile
from nq.loader.hf import LoadError, SafetensorsFile, pack
from nq.loader.quant import quantize_pack
from nq.loader.synth import (CHAT_TEMPLATE, build_tokenizer_json, make_hf_snapshot,
                             random_hf_weights, round_bf16, write_safetensors)
from nq.loader.weights import fake_quantize, hf_to_host, load_host_weights

STORED = {"bfloat16": round_bf16, "float16": lambda x: x.astype(np.float16).astype(np.float32),
          "float32": lambda x: x}


@pytest.mark.parametrize("dtype,shards,tie", [
    ("bfloat16", 1, False), ("float16", 1, False), ("float32", 1, False),
    ("bfloat16", 3, False), ("bfloat16", 1, True)])
def test_pack_equals_quantised_source(tmp_path, dtype, shards, tie):
    cfg = tiny_config(num_layers=2, tie=tie)
    snap = make_hf_snapshot(tmp_path / "snap", cfg, seed=5, shards=shards, dtype=dtype)
    assert (snap / "model.safetensors.index.json").exists() == (shards > 1)
    # the fp16 head, as the checkpoint has it (the quantised heads, the default int4+fp16
    # among them: test_lm_head_int4.py, test_lm_head_int8.py)
    out = pack(snap, tmp_path / "m.nanoqwen", progress=False, lm_head="fp16")
    nf = NanoqwenFile(out)
    assert nf.verify() > 0
    assert nf.config == cfg.replace(name="snap")
    assert ("lm_head" in nf.names()) == (not tie)
    src = {k: STORED[dtype](v) for k, v in random_hf_weights(cfg, 5).items()}
    for ours, hf_name, _ in hf._source_plan(cfg):
        if ours.endswith("_proj.weight"):
            qweight, scales = quantize_pack(src[hf_name])
            base = ours[:-len(".weight")]
            assert np.array_equal(nf.array(base + ".qweight"), qweight), ours
            assert np.array_equal(nf.array(base + ".scales"), scales), ours
        else:
            assert np.array_equal(nf.array(ours), src[hf_name].astype(np.float16)), ours
    if tie:
        assert np.array_equal(nf.array("lm_head"), src["model.embed_tokens.weight"].astype(np.float16))
    for fn in hf.META_FILES:  # each one the snapshot has (synth writes no chat_template.jinja)
        if (snap / fn).exists():
            assert nf.meta(fn) == (snap / fn).read_bytes(), fn
        else:
            assert "meta/" + fn not in nf, fn
    assert nf.header.source_revision == ""
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == ["m.nanoqwen"]


def test_host_weights_equal_fake_quantised_source(tmp_path):
    cfg = tiny_config(num_layers=1)
    w = random_hf_weights(cfg, 7)
    snap = make_hf_snapshot(tmp_path / "s", cfg, dtype="float32", weights=w)
    nf = NanoqwenFile(pack(snap, tmp_path / "m.nanoqwen", progress=False, lm_head="fp16"))
    host = load_host_weights(nf)
    want = hf_to_host(cfg, fake_quantize(w))
    assert sorted(host) == sorted(want)
    for k in want:
        assert host[k].dtype == np.float32 and np.array_equal(host[k], want[k]), k
    assert nf.meta("tokenizer.json") == (snap / "tokenizer.json").read_bytes()


def test_safetensors_reader_matches_the_reference_library(tmp_path):
    from safetensors.numpy import save_file
    rng = np.random.default_rng(0)
    arrays = {"a": rng.standard_normal((3, 5)).astype(np.float16),
              "b": rng.standard_normal((7,)).astype(np.float32)}
    save_file(arrays, str(tmp_path / "x.safetensors"))
    sf = SafetensorsFile(tmp_path / "x.safetensors")
    for k, v in arrays.items():
        assert np.array_equal(sf.raw(k), v) and sf.raw(k).dtype == v.dtype
    # bf16 from torch: our widening must equal torch's bf16 -> fp32
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as save_torch
    t = torch.randn(4, 6).to(torch.bfloat16)
    save_torch({"w": t}, str(tmp_path / "y.safetensors"))
    sf = SafetensorsFile(tmp_path / "y.safetensors")
    assert sf.is_bf16("w")
    assert np.array_equal(hf.bf16_to_f32(sf.raw("w")), t.float().numpy())
    # and ours the other way: torch reads what synth writes
    from safetensors.torch import load_file
    x = rng.standard_normal((2, 8)).astype(np.float32)
    write_safetensors(tmp_path / "z.safetensors", [("x", (2, 8))], "bfloat16", {"x": x}.get)
    assert np.array_equal(load_file(str(tmp_path / "z.safetensors"))["x"].float().numpy(), round_bf16(x))


def _leftovers(d):
    return sorted(p.name for p in d.iterdir())


def test_missing_tensor_fails_before_writing(tmp_path):
    cfg = tiny_config(num_layers=1)
    w = random_hf_weights(cfg, 0)
    del w["model.layers.0.mlp.up_proj.weight"]
    snap = tmp_path / "s"
    snap.mkdir()
    hf_names = list(w)
    (snap / "config.json").write_text(json.dumps(cfg.to_hf()))
    (snap / "tokenizer.json").write_text(build_tokenizer_json(cfg.vocab_size))
    write_safetensors(snap / "model.safetensors", [(k, w[k].shape) for k in hf_names], "float32", w.get)
    out_dir = tmp_path / "out"
    with pytest.raises(LoadError, match="lacks 1 tensors.*model.layers.0.mlp.up_proj.weight"):
        pack(snap, out_dir / "m.nanoqwen", progress=False)
    assert not out_dir.exists() or _leftovers(out_dir) == []


def test_failure_mid_stream_leaves_nothing(tmp_path, monkeypatch):
    snap = make_hf_snapshot(tmp_path / "s", tiny_config(num_layers=2))
    calls = []

    def flaky(w):
        calls.append(1)
        if len(calls) == 9:
            raise MemoryError("simulated failure in layer 1")
        return quantize_pack(w)
    monkeypatch.setattr(hf, "quantize_pack", flaky)
    with pytest.raises(MemoryError):
        pack(snap, tmp_path / "out" / "m.nanoqwen", progress=False)
    assert _leftovers(tmp_path / "out") == []


def test_shape_and_dtype_errors_name_the_file(tmp_path):
    cfg = tiny_config(num_layers=1)
    snap = make_hf_snapshot(tmp_path / "s", cfg, shards=2)
    conf = json.loads((snap / "config.json").read_text())
    conf["intermediate_size"] = 512
    (snap / "config.json").write_text(json.dumps(conf))
    with pytest.raises(LoadError, match=r"model-0000\d-of-00002\.safetensors: tensor "
                                        r"model\.layers\.0\.mlp\.gate_proj\.weight has shape"):
        pack(snap, tmp_path / "m.nanoqwen", progress=False)
    # an int8 (pre-quantised) tensor is refused by dtype
    w = random_hf_weights(cfg, 0)
    snap2 = tmp_path / "s2"
    make_hf_snapshot(snap2, cfg, weights=w, dtype="float32")
    raw = bytearray((snap2 / "model.safetensors").read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["model.norm.weight"]["dtype"] = "I32"
    blob = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(blob) == n
    raw[8:8 + n] = blob
    (snap2 / "model.safetensors").write_bytes(raw)
    with pytest.raises(LoadError, match=r"model\.safetensors: tensor model\.norm\.weight has dtype I32"):
        pack(snap2, tmp_path / "m.nanoqwen", progress=False)
    assert not (tmp_path / "m.nanoqwen").exists()
    with pytest.raises(LoadError, match="no such directory, and not a Hugging Face repo id"):
        pack(str(tmp_path / "nowhere"), tmp_path / "m.nanoqwen", progress=False)


def test_synthetic_tokenizer_and_chat_template(tiny_snapshot, tiny_cfg):
    from jinja2 import Template
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tiny_snapshot / "tokenizer.json"))
    assert tok.get_vocab_size() < tiny_cfg.vocab_size
    im_end = tok.token_to_id("<|im_end|>")
    gen = json.loads((tiny_snapshot / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [im_end, tok.token_to_id("<|endoftext|>")]
    text = "def add(a, b):\n    return a + b  # héllo ✓"
    ids = tok.encode(text + "<|im_end|>").ids
    assert ids[-1] == im_end and tok.decode(ids[:-1]) == text
    assert len(ids) < len(text.encode())                # the merges compress
    conf = json.loads((tiny_snapshot / "tokenizer_config.json").read_text())
    assert conf["chat_template"] == CHAT_TEMPLATE and conf["eos_token"] == "<|im_end|>"
    prompt = Template(CHAT_TEMPLATE).render(messages=[{"role": "user", "content": "hi"}],
                                            add_generation_prompt=True)
    assert prompt == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
                      "helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                      "<|im_start|>assistant\n")
    prompt = Template(CHAT_TEMPLATE).render(messages=[{"role": "system", "content": "S"},
                                                      {"role": "user", "content": "u"}])
    assert prompt == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nu<|im_end|>\n"


def test_packed_fixture_is_complete(tiny_nanoqwen, tiny_cfg):
    nf = NanoqwenFile(tiny_nanoqwen, verify=True)
    assert nf.config.replace(name=tiny_cfg.name) == tiny_cfg
    assert os.path.getsize(tiny_nanoqwen) == nf.header.file_size
