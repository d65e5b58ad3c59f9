"""Synthetic Hugging Face snapshots: random Qwen2 weights, config, generation config, tokenizer.

Tests and benchmarks need checkpoints with no hub access: `make_hf_snapshot` writes a folder
that `nq pack` and transformers both read like a real Qwen2.5-Instruct snapshot (config.json,
generation_config.json, safetensors -- sharded with an index if asked --, tokenizer.json,
tokenizer_config.json with the Qwen2.5 chat template).  The safetensors writer is ours and
streams, so scripts/make_fake_checkpoint.py can write a 15 GB 7B checkpoint in little RAM.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable

import numpy as np

from nq.config import ModelConfig

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>",
                  "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
                  "<|file_sep|>")
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# Qwen2.5's chat template without the tools branch: a default system turn, ChatML turns, and
# `<|im_start|>assistant\n` as the generation prompt.
CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen2's pre-tokeniser split (contractions, letters, single digits, punctuation, spaces).
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
              r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CORPUS = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

import numpy as np
def quicksort(values: list[int]) -> list[int]:
    if len(values) <= 1:
        return values
    pivot = values[len(values) // 2]
    left = [x for x in values if x < pivot]
    right = [x for x in values if x > pivot]
    return quicksort(left) + [x for x in values if x == pivot] + quicksort(right)

The quick brown fox jumps over the lazy dog. Hello, world! What is the capital of France?
Write a function that returns the sum of two numbers. You are a helpful assistant.
for (int i = 0; i < n; ++i) { total += data[i] * weights[i]; }
'''


# ---- safetensors writing -------------------------------------------------------------------
def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even (what torch does)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """The fp32 value a bf16 checkpoint stores for x."""
    return (f32_to_bf16_bits(x).astype(np.uint32) << np.uint32(16)).view(np.float32)


_ST_NAME = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_ST_SIZE = {"BF16": 2, "F16": 2, "F32": 4}


def encode_st(x: np.ndarray, dtype: str) -> np.ndarray:
    """A float array as the bytes of safetensors dtype `dtype` (bfloat16, float16, float32)."""
    if dtype == "bfloat16":
        return f32_to_bf16_bits(x)
    return np.ascontiguousarray(x, "<f2" if dtype == "float16" else "<f4")


def write_safetensors(path, specs: list[tuple[str, tuple[int, ...]]], dtype: str,
                      produce: Callable[[str], object]) -> int:
    """Write a .safetensors file whose tensors (name, shape) are produced one at a time.

    `produce(name)` returns the tensor as a float array, or an iterator of row blocks (so a
    1 GB embedding never exists whole); uint16 blocks for bfloat16 are taken as bit patterns
    already.  Returns the data size in bytes.
    """
    st = _ST_NAME[dtype]
    header, pos = {}, 0
    for name, shape in specs:
        n = int(np.prod(shape, dtype=np.int64)) * _ST_SIZE[st]
        header[name] = {"dtype": st, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)          # the spec pads the header to 8 bytes with spaces
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, shape in specs:
            x = produce(name)
            written = 0
            for block in ([x] if isinstance(x, np.ndarray) else x):
                data = block if (st == "BF16" and block.dtype == np.uint16) else encode_st(block, dtype)
                f.write(np.ascontiguousarray(data).data)
                written += data.nbytes
            b, e = header[name]["data_offsets"]
            if written != e - b:
                raise ValueError(f"{path}: produced {written} bytes for {name}, its shape "
                                 f"{shape} needs {e - b}")
    return pos


# ---- weights -------------------------------------------------------------------------------
def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of a Qwen2 checkpoint for `cfg`, with its shape, in layer order."""
    from nq.loader.hf import _source_plan
    return {hf: shape for _, hf, shape in _source_plan(cfg)}


def random_hf_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights under HF names, at a trained model's scale.

    Matrices ~ N(0, 0.02), norms ~ 1 + N(0, 0.05), biases ~ N(0, 0.02); large enough that
    the INT4 error is realistic, small enough that activations stay tame over a few layers.
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in hf_shapes(cfg).items():
        if name.endswith("norm.weight"):
            out[name] = (1 + 0.05 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (0.02 * rng.standard_normal(shape)).astype(np.float32)
    return out


# ---- tokenizer -----------------------------------------------------------------------------
def build_tokenizer_json(vocab_size: int) -> str:
    """A Qwen2-style byte-level BPE tokenizer.json with fewer than `vocab_size` ids.

    256 byte tokens plus merges trained on a small built-in corpus, then Qwen's special tokens
    as added tokens right after the regular ones (Qwen2 likewise has fewer tokenizer ids than
    embedding rows).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if vocab_size < 512:
        raise ValueError(f"vocab_size={vocab_size}: the synthetic tokenizer needs at least 512")
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    regular = min(vocab_size - len(SPECIAL_TOKENS) - 7, 1024)
    trainer = trainers.BpeTrainer(vocab_size=regular, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    assert tok.get_vocab_size() < vocab_size
    return tok.to_str()


def special_token_ids(tokenizer_json: str) -> dict[str, int]:
    return {t["content"]: t["id"] for t in json.loads(tokenizer_json)["added_tokens"]}


def tokenizer_config(tokenizer_json: str) -> dict:
    ids = special_token_ids(tokenizer_json)
    return {
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False,
                                          "rstrip": False, "single_word": False, "special": True}
                                 for t, i in ids.items()},
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def generation_config(im_end: int, endoftext: int) -> dict:
    """Qwen2.5-Instruct's sampling defaults, with this tokenizer's stop ids."""
    return {"bos_token_id": endoftext, "pad_token_id": endoftext, "do_sample": True,
            "eos_token_id": [im_end, endoftext], "repetition_penalty": 1.05,
            "temperature": 0.7, "top_p": 0.8, "top_k": 20}


# ---- snapshot ------------------------------------------------------------------------------
def shard_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def split_shards(specs: list[tuple[str, tuple[int, ...]]], shards: int, itemsize: int):
    """Cut the ordered tensor list into `shards` runs of roughly equal bytes (HF does the same)."""
    sizes = [int(np.prod(s, dtype=np.int64)) * itemsize for _, s in specs]
    total, out, cur, acc = sum(sizes), [[] for _ in range(shards)], 0, 0
    for spec, size in zip(specs, sizes):
        if out[cur] and acc + size / 2 > total * (cur + 1) / shards and cur < shards - 1:
            cur += 1
        out[cur].append(spec)
        acc += size
    return out, total


def write_hf_checkpoint(dir, cfg: ModelConfig, produce: Callable[[str], np.ndarray],
                        shards: int = 1, dtype: str = "bfloat16") -> None:
    """config.json plus the safetensors (and index when sharded); tensors come from `produce`."""
    d = Path(dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    specs = list(hf_shapes(cfg).items())
    groups, total = split_shards(specs, shards, _ST_SIZE[_ST_NAME[dtype]])
    weight_map = {}
    for fn, group in zip(shard_names(shards), groups):
        write_safetensors(d / fn, group, dtype, produce)
        weight_map.update({name: fn for name, _ in group})
    if shards > 1:
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def make_hf_snapshot(dir, cfg: ModelConfig, seed: int = 0, shards: int = 1,
                     dtype: str = "bfloat16", tokenizer: bool = True,
                     weights: dict[str, np.ndarray] | None = None) -> Path:
    """A complete synthetic Qwen2 snapshot in `dir` (random_hf_weights(cfg, seed) unless
    `weights` is given); with `tied` configs no lm_head.weight is written."""
    weights = random_hf_weights(cfg, seed) if weights is None else weights
    d = Path(dir)
    write_hf_checkpoint(d, cfg, weights.__getitem__, shards, dtype)
    if tokenizer:
        tj = build_tokenizer_json(cfg.vocab_size)
        ids = special_token_ids(tj)
        (d / "tokenizer.json").write_text(tj)
        (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tj), indent=2))
        gen = generation_config(ids["<|im_end|>"], ids["<|endoftext|>"])
        (d / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return d
