"""Hugging Face snapshot -> .nanoqwen: locate the snapshot, read safetensors by mmap, pack.

`pack` streams one tensor at a time: read the bf16/fp16/fp32 source through an mmap view,
widen to fp32 (one tensor's worth of temporaries at most), quantise the seven projections per
layer to INT4 ValueShuffle, convert everything else to fp16 (the lm_head, with
`lm_head="int8"`, to int8 rows: quant.quantize_int8_rows; with "int4", to a projection's INT4
form: quant.quantize_pack; either from the source's own precision),
hand each result to the streaming writer, and drop the source pages from RSS.  The 7B packs
in well under 4 GB of RSS.

The safetensors reader is ours (the format is an 8-byte length, a JSON header, raw data), so
packing needs neither torch nor the safetensors package; bf16 is widened by `u16 << 16`.
"""
from __future__ import annotations

import json
import math
import mmap
import shutil
import os
import re
import struct
import sys
from pathlib import Path

import numpy as np

from nq.config import DEFAULT_LM_HEAD, GROUP_SIZE, LM_HEADS, ConfigError, ModelConfig
from nq.loader.format import (HEADER_SIZE, PROJECTIONS, expected_tensors, release_pages,
                              write_nanoqwen)
from nq.loader.outfile import check_output
from nq.loader.quant import quantize_int8_rows, quantize_pack

# Data only: nothing a download brings can run (no *.py of trust_remote_code models, no pickled
# *.bin/*.pt/*.pth weights).  tests/loader/test_no_code.py holds each pattern to that.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "merges.txt"]
# Embedded in the .nanoqwen so it is self-contained; recent snapshots keep the chat template in
# chat_template.jinja rather than in tokenizer_config.json (nq.text reads either).
META_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja")
_ST_DTYPES = {"BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4")}
CONVERT_ROWS = 4096      # rows per chunk when converting a big matrix (embed, lm_head)


class LoadError(ValueError):
    """A snapshot nq cannot read or pack; the message names the file and what to do."""


# ---- the name map (ours -> HF), declarative ------------------------------------------------
# kind "f16": stored as fp16; "int4": quantised to qweight/scales.
GLOBAL_NAMES = {"embed_tokens": "model.embed_tokens.weight", "norm": "model.norm.weight",
                "lm_head": "lm_head.weight"}
LAYER_NAMES = {"input_layernorm": "model.layers.{i}.input_layernorm.weight",
               "post_attention_layernorm": "model.layers.{i}.post_attention_layernorm.weight"}
for _p in PROJECTIONS:
    _mod = "self_attn" if _p in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    LAYER_NAMES[f"{_p}.weight"] = f"model.layers.{{i}}.{_mod}.{_p}.weight"
    if _p in ("q_proj", "k_proj", "v_proj"):
        LAYER_NAMES[f"{_p}.bias"] = f"model.layers.{{i}}.{_mod}.{_p}.bias"


def hf_name(ours: str) -> str:
    """HF tensor name for one of ours, e.g. layers.3.q_proj.weight -> model.layers.3.self_attn.q_proj.weight."""
    if ours in GLOBAL_NAMES:
        return GLOBAL_NAMES[ours]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", ours)
    if not m or m.group(2) not in LAYER_NAMES:
        raise KeyError(f"no Hugging Face name for {ours!r}")
    return LAYER_NAMES[m.group(2)].format(i=m.group(1))


def host_names(cfg: ModelConfig) -> list[str]:
    """Our fp32 host-weight names for `cfg`, in file order (projections as `.weight`)."""
    names = ["embed_tokens"]
    for i in range(cfg.num_layers):
        names += [f"layers.{i}.{k}" for k in LAYER_NAMES]
    names.append("norm")
    if not cfg.tie_word_embeddings:
        names.append("lm_head")
    return names


# ---- safetensors by mmap -------------------------------------------------------------------
class SafetensorsFile:
    """One .safetensors file mapped read-only; `raw()` is a zero-copy view in the file's dtype."""

    def __init__(self, path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise LoadError(f"{self.path}: truncated safetensors file ({size} bytes); re-download it")
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        (n,) = struct.unpack_from("<Q", self._mm, 0)
        if 8 + n > size:
            raise LoadError(f"{self.path}: safetensors header of {n} bytes runs past the end of "
                            f"the file ({size} bytes); re-download it")
        try:
            header = json.loads(bytes(self._mm[8:8 + n]))
            header.pop("__metadata__", None)
            for name, t in header.items():
                b, e = t["data_offsets"]
                if not (isinstance(t["dtype"], str) and all(type(d) is int and d >= 0 for d in t["shape"])
                        and type(b) is int and type(e) is int and 0 <= b <= e):
                    raise ValueError(f"tensor {name}: {t}")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise LoadError(f"{self.path}: unreadable safetensors header ({e}); re-download it") from None
        self._base = 8 + n
        self.tensors: dict[str, dict] = header
        for name, t in header.items():
            if self._base + t["data_offsets"][1] > size:
                raise LoadError(f"{self.path}: tensor {name} runs past the end of the file; "
                                "the download is truncated, re-download it")

    def raw(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        if t["dtype"] not in _ST_DTYPES:
            raise LoadError(f"{self.path}: tensor {name} has dtype {t['dtype']}; nq packs BF16, "
                            "F16 and F32 checkpoints (not pre-quantised ones)")
        dt = _ST_DTYPES[t["dtype"]]
        b, e = t["data_offsets"]
        shape = tuple(t["shape"])
        if e - b != math.prod(shape) * dt.itemsize:
            raise LoadError(f"{self.path}: tensor {name} has {e - b} bytes for shape {shape} "
                            f"{t['dtype']}; the file is corrupt, re-download it")
        return np.frombuffer(self._mm, dt, (e - b) // dt.itemsize, self._base + b).reshape(shape)

    def is_bf16(self, name: str) -> bool:
        return self.tensors[name]["dtype"] == "BF16"

    def release(self, name: str, rows: slice | None = None) -> None:
        """Drop tensor `name` (or rows `rows` of it) from RSS; see format.release_pages."""
        b, e = self.tensors[name]["data_offsets"]
        if rows is not None:
            row = (e - b) // max(1, self.tensors[name]["shape"][0])
            start, stop, _ = rows.indices(self.tensors[name]["shape"][0])
            b, e = b + start * row, b + stop * row
        release_pages(self._mm, self._base + b, e - b)


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> float32, exactly: bf16 is the top half of an fp32."""
    return (u16.astype(np.uint32) << np.uint32(16)).view(np.float32)


class Checkpoint:
    """All safetensors of a snapshot (sharded through model.safetensors.index.json or not)."""

    def __init__(self, snapshot: Path):
        self.dir = Path(snapshot)
        index = self.dir / "model.safetensors.index.json"
        self._where: dict[str, str] = {}
        if index.exists():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
                bad = [fn for fn in files if not isinstance(fn, str) or Path(fn).name != fn]
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise LoadError(f"{index}: unreadable shard index ({e}); re-download the snapshot") from None
            if bad:  # a shard must sit in the snapshot: no "../" out of it
                raise LoadError(f"{index}: shard names {bad[:3]} are not file names in the snapshot; "
                                "re-download the snapshot")
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
        if not files:
            raise LoadError(f"{self.dir}: no *.safetensors files; nq packs safetensors checkpoints")
        self.files: dict[str, SafetensorsFile] = {}
        for fn in files:
            if not (self.dir / fn).exists():
                raise LoadError(f"{self.dir / fn}: listed in {index.name} but missing; re-download the snapshot")
            self.files[fn] = sf = SafetensorsFile(self.dir / fn)
            for name in sf.tensors:
                self._where[name] = fn

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def file_of(self, name: str) -> SafetensorsFile:
        return self.files[self._where[name]]

    def _raw(self, name: str, shape: tuple[int, ...]) -> tuple[SafetensorsFile, np.ndarray]:
        if name not in self._where:
            raise LoadError(f"{self.dir}: the checkpoint has no tensor {name}; is this a complete "
                            "Qwen2 snapshot? re-download it")
        sf = self.file_of(name)
        raw = sf.raw(name)
        if raw.shape != tuple(shape):
            raise LoadError(f"{sf.path}: tensor {name} has shape {raw.shape}, config.json implies "
                            f"{tuple(shape)}; the checkpoint and its config.json disagree")
        return sf, raw

    def f32(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Tensor `name` widened to a fresh fp32 array, its shape checked against `shape`."""
        sf, raw = self._raw(name, shape)
        out = bf16_to_f32(raw) if sf.is_bf16(name) else raw.astype(np.float32)
        sf.release(name)
        return out

    def _f32_rows(self, name: str, shape: tuple[int, ...]):
        """(first row, fp32 block of CONVERT_ROWS rows) over tensor `name`; each block's source
        pages leave RSS once the consumer has taken it."""
        sf, raw = self._raw(name, shape)
        for r in range(0, shape[0], CONVERT_ROWS):
            part = raw[r:r + CONVERT_ROWS]
            yield r, (bf16_to_f32(part) if sf.is_bf16(name) else part.astype(np.float32))
            sf.release(name, slice(r, r + CONVERT_ROWS))

    def f16(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Tensor `name` as fp16, converted CONVERT_ROWS rows at a time (no whole fp32 copy)."""
        out = np.empty(shape, np.float16)
        for r, part in self._f32_rows(name, shape):
            out[r:r + CONVERT_ROWS] = _to_f16(part, name, self.file_of(name).path)
        return out

    def quantised(self, kind: str, name: str,
                  shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """Tensor `name` as an lm_head of `kind` (quantise_rows), quantised CONVERT_ROWS rows at
        a time from the source's precision (never through fp16: the scales come from the
        weights the checkpoint holds)."""
        return quantise_rows(kind, self._f32_rows(name, shape), shape)


def quantise_rows(kind: str, blocks, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """A (N, K) matrix given as (first row, fp32 block) pieces, quantised as an lm_head of
    `kind`: "int8" (q int8 (N, K), scales fp32 (N,): quant.quantize_int8_rows) or an INT4 one
    (qweight uint32 (N, K // 8), scales fp16 (N, K // 128): quant.quantize_pack).  Both are
    row-wise, so the pieces give what one call on the whole matrix gives."""
    n, k = shape
    if kind == "int8":
        q, scales, fn = np.empty((n, k), np.int8), np.empty(n, np.float32), quantize_int8_rows
    else:
        q, scales, fn = (np.empty((n, k // 8), np.uint32),
                         np.empty((n, k // GROUP_SIZE), np.float16), quantize_pack)
    for r, part in blocks:
        q[r:r + len(part)], scales[r:r + len(part)] = fn(part)
    return q, scales


def _to_f16(x: np.ndarray, name: str, where) -> np.ndarray:
    if x.size and np.abs(x).max() > 65504:
        raise LoadError(f"{where}: tensor {name} has values beyond the fp16 range (max |x| = "
                        f"{np.abs(x).max():g}); nq stores non-quantised tensors in fp16")
    return x.astype(np.float16)


# ---- locating a snapshot -------------------------------------------------------------------
def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _hub_cache() -> str | None:
    """The hub cache the environment names *now* (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def resolve_snapshot(src: str, revision: str | None = None, progress: bool = True) -> Path:
    """A local snapshot directory for `src`: a directory as given, or a repo id fetched into
    (or found in, with HF_HUB_OFFLINE=1) the Hugging Face cache."""
    path = Path(src).expanduser()
    if path.is_dir():
        return path.absolute()
    if path.exists():
        raise LoadError(f"{src}: is a file; give a snapshot directory or a repo id like "
                        "Qwen/Qwen2.5-Coder-7B-Instruct")
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", src):
        raise LoadError(f"{src}: no such directory, and not a Hugging Face repo id (Org/Name)")
    import huggingface_hub
    from huggingface_hub import errors, utils

    offline = _env_true("HF_HUB_OFFLINE")
    quiet = not progress and not utils.are_progress_bars_disabled()
    if quiet:
        utils.disable_progress_bars()
    try:
        return Path(huggingface_hub.snapshot_download(
            src, revision=revision, cache_dir=_hub_cache(), allow_patterns=ALLOW_PATTERNS,
            local_files_only=offline))
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled) as e:
        raise LoadError(f"{src}{'@' + revision if revision else ''}: not in the Hugging Face cache "
                        f"({_hub_cache() or 'default cache'}) and downloads are "
                        f"{'disabled (HF_HUB_OFFLINE=1)' if offline else 'unavailable'}; download it on a "
                        f"machine with network access (`huggingface-cli download {src}`) or pass a "
                        f"local snapshot directory [{type(e).__name__}]") from None
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, errors.GatedRepoError) as e:
        raise LoadError(f"{src}: {type(e).__name__}: {str(e).splitlines()[0]}; check the repo id, "
                        "the revision and your HF_TOKEN") from None
    finally:
        if quiet:
            utils.enable_progress_bars()


def snapshot_revision(snapshot: Path) -> str:
    """The commit sha of an HF-cache snapshot (`.../snapshots/<sha>`), else ""."""
    snapshot = Path(snapshot)
    if snapshot.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", snapshot.name):
        return snapshot.name
    return ""


def snapshot_name(snapshot: Path) -> str:
    """A readable model name: "Org/Name" for an HF-cache snapshot, else the folder name."""
    snapshot = Path(snapshot)
    repo = snapshot.parent.parent.name
    if snapshot_revision(snapshot) and repo.startswith("models--"):
        return repo[len("models--"):].replace("--", "/", 1)
    return snapshot.name


# ---- pack ------------------------------------------------------------------------------------
def _source_plan(cfg: ModelConfig) -> list[tuple[str, str, tuple[int, ...]]]:
    """(our name, HF name, source shape) for every tensor the file stores, in file order."""
    shapes = {"embed_tokens": (cfg.vocab_size, cfg.hidden_size), "norm": (cfg.hidden_size,),
              "lm_head": (cfg.vocab_size, cfg.hidden_size),
              "input_layernorm": (cfg.hidden_size,), "post_attention_layernorm": (cfg.hidden_size,)}
    for proj, nk in cfg.projection_shapes().items():
        shapes[f"{proj}.weight"], shapes[f"{proj}.bias"] = nk, nk[:1]
    plan = []
    for ours in host_names(cfg):
        short = ours.split(".", 2)[2] if ours.startswith("layers.") else ours
        plan.append((ours, hf_name(ours), shapes[short]))
    return plan


def _check_sources(ckpt: Checkpoint, plan) -> None:
    """Fail before writing anything if a tensor is missing or mis-shaped (reads headers only)."""
    missing = [hf for _, hf, _ in plan if hf not in ckpt]
    if missing:
        raise LoadError(f"{ckpt.dir}: the checkpoint lacks {len(missing)} tensors that config.json "
                        f"implies (first: {', '.join(missing[:3])}); is the download complete?")
    for _, hf, shape in plan:
        sf = ckpt.file_of(hf)
        got = tuple(sf.tensors[hf]["shape"])
        if got != shape:
            raise LoadError(f"{sf.path}: tensor {hf} has shape {got}, config.json implies {shape}; "
                            "the checkpoint and its config.json disagree")
        if sf.tensors[hf]["dtype"] not in _ST_DTYPES:
            sf.raw(hf)                                         # raises the dtype error


def read_config(snap: Path) -> ModelConfig:
    """The snapshot's config.json as a ModelConfig; every refusal names the file."""
    path = snap / "config.json"
    if not path.is_file():
        raise LoadError(f"{snap}: no config.json; is this a Hugging Face snapshot folder?")
    try:
        return ModelConfig.from_hf(path, name=snapshot_name(snap))
    except ConfigError as e:
        raise LoadError(f"{path}: {e}") from None
    except json.JSONDecodeError as e:
        raise LoadError(f"{path}: not valid JSON ({e}); re-download the snapshot") from None
    except (ValueError, TypeError) as e:
        raise LoadError(f"{path}: a value nq cannot use ({e}); is this a Qwen2 config.json?") from None


def _check_space(out: Path, cfg: ModelConfig, meta: dict[str, bytes], lm_head: str) -> None:
    """Refuse before quantising when the output's file system lacks the room (a pack that
    runs out of disk half-way would cost minutes and leave nothing)."""
    # payloads, up to 128 bytes of alignment padding and ~100 bytes of table entry each
    blobs = [math.prod(shape) * dt.itemsize
             for dt, shape in expected_tensors(cfg, lm_head).values()]
    blobs += [len(b) for b in meta.values()]
    need = HEADER_SIZE + sum(blobs) + 228 * len(blobs)
    folder = out.parent
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if free < need:
        def size(n):
            return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
        raise LoadError(f"{out}: the packed model needs {size(need)}, the file system holding "
                        f"{folder} has {size(free)} free; free some space or write elsewhere")


def pack(src: str, out, revision: str | None = None, progress: bool = True,
         lm_head: str = DEFAULT_LM_HEAD) -> Path:
    """Quantise the snapshot `src` (directory or repo id) into the .nanoqwen file `out`.

    lm_head: "int4+fp16" (the default, format.DEFAULT_LM_HEAD: the projections' INT4 g128
    form, and the fp16 rows kept beside it to rescore its candidates near the top, so a
    greedy token is the fp16 head's), "fp16" (as the checkpoint has it, alone), "int8" (one
    fp32 scale a row, half the bytes a decode step reads for it) or "int4" (INT4 alone, a
    quarter of them, at more cost to the logits than int8); a tied model keeps its fp16
    embedding beside a quantised head, and it serves as an INT4 head's fp16 rows.
    Everything that can be refused is refused before the first tensor is read: the output
    path, config.json (architecture, rope scaling, dimensions), the tokenizer, every tensor's
    presence, shape and dtype, and the free space."""
    from tqdm import tqdm

    from nq.errors import signals_deferred

    if lm_head not in LM_HEADS:
        raise LoadError(f"lm_head={lm_head!r}: choose one of {', '.join(LM_HEADS)}")
    out = check_output(out)
    snap = resolve_snapshot(str(src), revision, progress)
    cfg = read_config(snap)
    if not (snap / "tokenizer.json").is_file():
        raise LoadError(f"{snap}: no tokenizer.json; a .nanoqwen carries its tokenizer, so nq "
                        "packs snapshots that have one (re-download the snapshot with its "
                        "tokenizer files)")
    ckpt = Checkpoint(snap)
    plan = _source_plan(cfg)
    _check_sources(ckpt, plan)
    meta = {fn: (snap / fn).read_bytes() for fn in META_FILES if (snap / fn).exists()}
    _check_space(out, cfg, meta, lm_head)
    out.parent.mkdir(parents=True, exist_ok=True)
    n_out = len(expected_tensors(cfg, lm_head))
    head_shape = (cfg.vocab_size, cfg.hidden_size)

    def quantised_head(hf):
        qweight, scales = ckpt.quantised(lm_head, hf, head_shape)
        yield "lm_head.qweight", qweight
        yield "lm_head.scales", scales

    def tensors():
        with signals_deferred():   # not a half-built bar: its __del__ would print a traceback
            bar = tqdm(total=n_out, desc=f"pack {out.name}", unit="tensor", file=sys.stderr,
                       disable=not progress)
        with bar:
            for ours, hf, shape in plan:
                if ours.endswith("_proj.weight"):
                    qweight, scales = quantize_pack(ckpt.f32(hf, shape))
                    base = ours[:-len(".weight")]
                    yield base + ".qweight", qweight
                    yield base + ".scales", scales
                    bar.update(2)
                elif ours == "lm_head" and lm_head != "fp16":
                    yield from quantised_head(hf)
                    bar.update(2)
                    if lm_head == "int4+fp16":     # kept to rescore the INT4 head with
                        yield ours, ckpt.f16(hf, shape)
                        bar.update(1)
                else:
                    yield ours, ckpt.f16(hf, shape)
                    bar.update(1)
            if cfg.tie_word_embeddings and lm_head != "fp16":   # from the embedding's source
                yield from quantised_head(hf_name("embed_tokens"))
                bar.update(2)

    return write_nanoqwen(out, cfg, tensors(), meta, snapshot_revision(snap), lm_head=lm_head)
