"""Where a model comes from: `-m` as a packed file, an HF folder or a repo id, resolved to one
`.nanoqwen` path (downloaded and packed once into the cache).  The CLI, `nq bench` and
`nq verify` all resolve models here.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

DEFAULT_REPO = "Qwen/Qwen2.5-Coder-7B-Instruct"


def cache_dir() -> Path:
    """Where packed models live: $NQ_CACHE, else $XDG_CACHE_HOME/nq, else ~/.cache/nq."""
    if os.environ.get("NQ_CACHE"):
        return Path(os.environ["NQ_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nq"


def resolve_model(model: str | None, revision: str | None = None) -> Path:
    """A `.nanoqwen` path for -m: a packed file as is; an HF snapshot folder or a repo id
    (default: Qwen2.5-Coder-7B-Instruct) downloaded and packed once into the cache."""
    model = model or DEFAULT_REPO
    path = Path(model).expanduser()
    if path.is_file():
        return path
    from nq.loader.hf import pack, resolve_snapshot   # the packer, only when there is no file
    if model.endswith(".nanoqwen"):
        raise FileNotFoundError(f"{model}: no such file; pack one with `nq pack SRC {model}`")
    # A snapshot folder in the HF cache is named after its commit, so a new revision packs anew.
    key = (str(path.resolve()) if path.is_dir() else model).strip("/").replace("/", "--")
    if not path.is_dir() and (revision is None or re.fullmatch(r"[0-9a-f]{40}", revision)):
        # A repo id packed before is used without asking the hub (the HF copy may be pruned,
        # or the machine offline); `--revision` or `nq pack` fetches another revision.
        packed = sorted(cache_dir().glob(f"{key}--{revision or '*'}.nanoqwen"),
                        key=lambda p: p.stat().st_mtime)
        if packed:
            return with_default_head(packed[-1])
    snapshot = resolve_snapshot(str(path) if path.is_dir() else model, revision=revision)
    out = cache_dir() / f"{key}--{snapshot.name}.nanoqwen"
    if not out.exists():
        print(f"nq: packing {snapshot} into {out} (once)", file=sys.stderr)
        out.parent.mkdir(parents=True, exist_ok=True)
        pack(snapshot, out)
    return with_default_head(out)


def with_default_head(path: Path) -> Path:
    """A pack of this cache made when `nq pack`'s default lm_head was fp16, re-packed once in
    place with today's (nq/config.py DEFAULT_LM_HEAD: int4+fp16, ~0.15 ms a 7B token less)
    from its own fp16 rows (nq/loader/repack.py: offline, 29 s for the 7B on 2 cores).  The
    cache holds nq's own packs, so the file is replaced (written beside, renamed over once
    whole); files elsewhere are never touched.  NQ_KEEP_CACHED_HEAD=1 keeps it as it is; so
    does a failure (too little space, a damaged file), which says why."""
    from nq.config import DEFAULT_LM_HEAD
    from nq.loader.format import FormatError, NanoqwenFile
    if os.environ.get("NQ_KEEP_CACHED_HEAD") == "1":
        return path
    with NanoqwenFile(path) as nf:
        old = nf.lm_head
    if old != "fp16" or DEFAULT_LM_HEAD == "fp16":
        return path
    from nq.loader.hf import LoadError
    from nq.loader.repack import repack
    print(f"nq: re-packing {path} with the {DEFAULT_LM_HEAD} lm_head, `nq pack`'s default "
          f"since nq 0.5 (once, from the file's own fp16 rows; NQ_KEEP_CACHED_HEAD=1 keeps it "
          f"as it is)", file=sys.stderr)
    try:
        repack(path, path, DEFAULT_LM_HEAD)
    except (LoadError, FormatError, OSError) as e:
        print(f"nq: kept {path.name} with its fp16 lm_head: {e}", file=sys.stderr)
    return path
