"""The kernel cache's files: where they live, an entry's format (build.py keys, stores and
loads them), `nq cache info` / `nq cache clear`, and the compile costs that order a parallel
batch.

An entry: MAGIC, one line of JSON header (the key and its inputs, the entry symbol, the cubin's
sha256), then the cubin; written to a temporary file and renamed into place.

The order a batch is handed out in.  build.py's child processes take the jobs in the order
given, so a slow kernel handed out last finishes last, alone: the batch costs its tail.
Longest first (LPT) bounds the batch by its slowest kernel wherever there are enough
processes.  A kernel's cost is what it took last time, by name (the name spells its
constants, and stays when nq's version changes every key), kept in COSTS_FILE beside the
entries; a name never compiled here counts as the family's largest known cost, else as
FIRST_GUESS for the families that compiled slowest on the H200.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

MAGIC = b"NQKERNEL1\n"


# ---- where, and an entry ------------------------------------------------------------------------

def cache_root() -> Path:
    """$NQ_CACHE/kernels ($NQ_CACHE defaults to $XDG_CACHE_HOME/nq or ~/.cache/nq)."""
    from nq.loader.resolve import cache_dir
    return cache_dir() / "kernels"


def entry_path(key: str, name: str) -> Path:
    """Where the kernel `name` compiled under cache key `key` lives in the cache."""
    return cache_root() / f"{name[:80]}-{key[:24]}.cubin"


def write_entry(path: Path, header: dict, cubin: bytes) -> None:
    """The entry at path, written whole or not at all (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=f"-{os.getpid()}")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + cubin)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_entry(path: Path, key: str | None = None) -> tuple[dict, bytes] | None:
    """(header, cubin) of a valid entry (its key, if given, and checksum match), else None."""
    try:
        data = path.read_bytes()
        if not data.startswith(MAGIC):
            return None
        head, _, cubin = data[len(MAGIC):].partition(b"\n")
        header = json.loads(head)
        if key is not None and header.get("key") != key:
            return None
        if header.get("sha256") != hashlib.sha256(cubin).hexdigest() or not cubin:
            return None
        return header, cubin
    except (OSError, ValueError, UnicodeDecodeError):
        return None


# ---- the order a batch is compiled in -----------------------------------------------------------

COSTS_FILE = "compile_seconds.json"
# seconds, the families' slowest on the H200's first start (2026-12-02; 16 processes at once)
FIRST_GUESS = {"prefill_attn_wgmma": 7.3, "prefill_attn": 4.0, "attn_split": 3.5,
               "gemm_wgmma": 3.0, "gemm": 2.5, "gemv": 3.0}


def costs_path() -> Path:
    return cache_root() / COSTS_FILE


def read_costs() -> dict:
    try:
        d = json.loads(costs_path().read_text())
        return {str(k): float(v) for k, v in d.items()} if isinstance(d, dict) else {}
    except (OSError, ValueError, TypeError):
        return {}


def remember_costs(took: dict) -> None:
    """Merge took {name: s} into COSTS_FILE (temporary file, then rename: two starts at once
    leave one whole file, whichever renamed last)."""
    try:
        path = costs_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = {**read_costs(), **{k: round(v, 3) for k, v in took.items()}}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=f"-{os.getpid()}")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(merged, f, indent=0, sort_keys=True)
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
    except OSError:
        pass          # an order hint only: a read-only cache compiles in the given order


def _family(name: str) -> str:
    for fam in sorted(FIRST_GUESS, key=len, reverse=True):
        if name.startswith(fam + "_"):
            return fam
    return name.split("_")[0]


def longest_first(names: list[str], costs: dict | None = None) -> list[int]:
    """The indices of names in the order a batch should hand them out: the slowest first, by
    costs ({name: s}, default COSTS_FILE's), an unknown name by its family's largest known
    cost or FIRST_GUESS; ties keep the given order."""
    costs = read_costs() if costs is None else costs
    fam_max: dict = {}
    for n, c in costs.items():
        fam_max[_family(n)] = max(fam_max.get(_family(n), 0.0), c)

    def cost(n):
        if n in costs:
            return costs[n]
        return fam_max.get(_family(n), FIRST_GUESS.get(_family(n), 1.0))
    return sorted(range(len(names)), key=lambda i: -cost(names[i]))


# ---- `nq cache` -----------------------------------------------------------------------------

def cache_entries() -> list[tuple[Path, int, dict | None]]:
    """(path, size, header or None when invalid) of every entry, newest first."""
    root = cache_root()
    if not root.is_dir():
        return []
    out = []
    for p in sorted(root.glob("*.cubin"), key=lambda p: p.stat().st_mtime, reverse=True):
        entry = read_entry(p)
        out.append((p, p.stat().st_size, entry[0] if entry else None))
    return out


def clear_cache() -> tuple[int, int]:
    """Delete every entry, and the temporary files of writers that are gone (a live process's
    is left to its rename); (files, bytes) removed."""
    from nq.loader.outfile import remove_stale
    root = cache_root()
    n = size = 0
    if root.is_dir():
        for p in [*root.glob("*.cubin"), root / COSTS_FILE]:
            if p.exists():
                size += p.stat().st_size
                p.unlink(missing_ok=True)
                n += 1
        stale = remove_stale(root, ".tmp-*")
        n, size = n + len(stale), size + sum(b for _, b in stale)
    return n, size
