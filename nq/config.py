"""ModelConfig: the dimensions of one Qwen2/Qwen2.5 model, validated in one place.

Every kernel is specialised at JIT time from a ModelConfig, so every divisibility a kernel
relies on is checked here, once, with a message that says what is unsupported.  A config
comes from a checkpoint's `config.json` (`from_hf`), from a `.nanoqwen` header (the loader
rebuilds it from the stored JSON), or from the presets below (benchmarks, tests).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

GROUP_SIZE = 128  # INT4 quantisation group along the input dimension (FORMAT.md)
LM_HEADS = ("fp16", "int8", "int4", "int4+fp16")    # what `nq pack --lm-head` writes (FORMAT.md)
# What `nq pack` writes unless told, and `nq bench --random` times: the INT4 head, its candidates
# rescored by the fp16 rows (nq/kernels/lm_head_rescore.py), so a greedy token is the fp16
# head's (short of a 6-sigma rounding bound failing, ~6e-8 a token) for about the INT4 head's
# bytes: -0.151 / -0.147 / -0.147 ms a 7B token at 512 / 8K / 32K on the H200 (83f4990),
# -0.249 on the H100 (docs/PERF.md 0.37-0.39, 0.41).  "fp16" keeps the checkpoint's head alone.
DEFAULT_LM_HEAD = "int4+fp16"


class ConfigError(ValueError):
    """A checkpoint configuration that nq cannot run; the message says what and why."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    name: str = "qwen2"

    def __post_init__(self):
        self.validate()

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_kv_heads

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(out_features, in_features) of the seven quantised projections of one layer."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (self.q_size, h),
            "k_proj": (self.kv_size, h),
            "v_proj": (self.kv_size, h),
            "o_proj": (h, self.q_size),
            "gate_proj": (i, h),
            "up_proj": (i, h),
            "down_proj": (h, i),
        }

    def validate(self) -> None:
        def need(cond, what):
            if not cond:
                raise ConfigError(f"unsupported model config ({self.name}): {what}")

        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim"):
            need(int(getattr(self, f)) > 0, f"{f} must be a positive integer")
        need(self.head_dim in (64, 128),
             f"head_dim={self.head_dim}; the attention kernels are built for 64 or 128")
        need(self.hidden_size % GROUP_SIZE == 0,
             f"hidden_size={self.hidden_size} is not a multiple of {GROUP_SIZE}: the INT4 weights "
             f"are quantised in groups of {GROUP_SIZE} along it")
        need(self.num_heads % self.num_kv_heads == 0,
             f"num_attention_heads={self.num_heads} is not a multiple of "
             f"num_key_value_heads={self.num_kv_heads}")
        for name, (n, k) in self.projection_shapes().items():
            need(k % GROUP_SIZE == 0,
                 f"{name} has {k} input features, not a multiple of the INT4 group size {GROUP_SIZE}")
            need(n % 8 == 0, f"{name} has {n} output features, not a multiple of 8")
        need(self.rms_norm_eps > 0, "rms_norm_eps must be positive")
        need(self.rope_theta > 0, "rope_theta must be positive")

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_hf(cls, cfg: dict | str | Path, name: str | None = None) -> "ModelConfig":
        """Build from a Hugging Face `config.json` (a dict or a path), refusing what nq cannot run."""
        if not isinstance(cfg, dict):
            path = Path(cfg)
            if path.is_dir():
                path = path / "config.json"
            try:
                cfg = json.loads(path.read_text())
            except FileNotFoundError:
                raise ConfigError(f"{path}: no config.json; is this a Hugging Face snapshot?") from None
            name = name or str(path.parent.name)
        name = name or cfg.get("_name_or_path") or "qwen2"

        def refuse(what):
            raise ConfigError(f"unsupported model config ({name}): {what}")

        arch = cfg.get("architectures") or ["Qwen2ForCausalLM"]
        if cfg.get("model_type", "qwen2") != "qwen2" or arch[0] != "Qwen2ForCausalLM":
            refuse(f"model_type={cfg.get('model_type')!r}, architectures={arch}; "
                   "nq runs Qwen2/Qwen2.5 (Qwen2ForCausalLM) only")
        if cfg.get("rope_scaling"):
            refuse(f"rope_scaling={cfg['rope_scaling']!r}; only plain RoPE is implemented "
                   "(remove rope_scaling from config.json to run within the native context)")
        if cfg.get("use_sliding_window"):
            refuse("use_sliding_window=true; sliding-window attention is not implemented")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            refuse(f"hidden_act={act!r}; the MLP is SwiGLU with silu")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if key not in cfg:
                refuse(f"config.json lacks {key}")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if heads * head_dim != hidden:
            refuse(f"num_attention_heads*head_dim={heads}*{head_dim} != hidden_size={hidden}")
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            name=str(name),
        )

    def to_hf(self) -> dict:
        """A Qwen2 `config.json` dict that `from_hf` (and transformers) read back to this config."""
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "use_sliding_window": False,
            "sliding_window": None,
            "rope_scaling": None,
            "attention_dropout": 0.0,
            "torch_dtype": "bfloat16",
        }

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> "ModelConfig":
        """Back from `to_json()` (a .nanoqwen's stored config), refusing anything else with a
        ConfigError: each field must have the JSON type its annotation names, since a float
        `num_layers` would compare equal to the header's (2.0 == 2) and fail far later, in range()."""
        try:
            d = json.loads(text)
        except ValueError as e:                      # bad UTF-8 or bad JSON
            raise ConfigError(f"not JSON ({e})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"a JSON {type(d).__name__}, not an object")
        kinds = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,),
                 "int | None": (int, type(None))}
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        for k, v in d.items():
            if k not in fields:
                raise ConfigError(f"unknown field {k!r}")
            if not isinstance(v, kinds[fields[k]]) or (isinstance(v, bool) and fields[k] != "bool"):
                raise ConfigError(f"{k} is {v!r}, not {fields[k]}")
        try:
            return cls(**d)
        except (TypeError, OverflowError) as e:     # a missing field; an int too large for C
            raise ConfigError(str(e)) from None

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


def _preset(name, vocab, hidden, inter, layers, heads, kv, tie, eps=1e-6):
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv,
                       head_dim=hidden // heads, rms_norm_eps=eps, rope_theta=1_000_000.0,
                       tie_word_embeddings=tie, bos_token_id=151643, eos_token_id=151645,
                       name=name)


# The Qwen2.5 family as published (config.json of the Qwen/Qwen2.5-*-Instruct repos).
PRESETS: dict[str, ModelConfig] = {
    "0.5b": _preset("qwen2.5-0.5b", 151936, 896, 4864, 24, 14, 2, True),
    "1.5b": _preset("qwen2.5-1.5b", 151936, 1536, 8960, 28, 12, 2, True),
    "3b": _preset("qwen2.5-3b", 151936, 2048, 11008, 36, 16, 2, True),
    "7b": _preset("qwen2.5-7b", 152064, 3584, 18944, 28, 28, 4, False),
    "14b": _preset("qwen2.5-14b", 152064, 5120, 13824, 48, 40, 8, False, eps=1e-5),
    "32b": _preset("qwen2.5-32b", 152064, 5120, 27648, 64, 40, 8, False, eps=1e-5),
}


def tiny_config(head_dim: int = 64, num_heads: int = 4, num_kv_heads: int = 2,
                num_layers: int = 2, vocab_size: int = 512, intermediate_size: int = 384,
                tie: bool = False, **kw) -> ModelConfig:
    """A small random-weight test model; sizes obey every constraint the 7B obeys."""
    return ModelConfig(vocab_size=vocab_size, hidden_size=head_dim * num_heads,
                       intermediate_size=intermediate_size, num_layers=num_layers,
                       num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       tie_word_embeddings=tie, name=f"tiny-d{head_dim}-h{num_heads}-kv{num_kv_heads}",
                       **kw)
