"""The `.nanoqwen` v1 file: a streaming writer and a zero-copy mmap reader.

One self-contained file per model: a 256-byte header, payloads aligned to 128 bytes, then a
tensor table.  docs/FORMAT.md specifies it byte by byte; this module is the only code that
knows the byte layout.  The writer streams (payloads are written as they arrive, the table
after them, the header last, into a temp file renamed into place) so packing a 7B never holds
the model in memory; the reader maps the file once and hands out np.frombuffer views.

The lm_head is fp16 (`lm_head`, or the embedding when tied) or quantised into
`lm_head.qweight` + `lm_head.scales`: with header flag bit 1, int8 rows with a per-row fp32
scale; with bit 2, INT4 g128 in a projection's ValueShuffle form (uint32 words, fp16 group
scales), so the projections' kernels and quantiser serve it; with bits 2 and 3 ("int4+fp16")
the fp16 `lm_head` is kept beside the INT4 one, whose candidates it rescores each step
(nq/kernels/lm_head_rescore.py).  Tied models keep their fp16 embedding for the lookup beside
any of them (and it rescores a tied INT4 head).  Readers from before a flag refuse such a file at the
flags check instead of misreading it, so the format version stays 1; the header's `needs nq`
field names the nq that reads it, for this reader's refusals and later ones'.

Checksums are CRC-32 (zlib, ~4 GB/s here): the header's covers the header (checksum field
zeroed) and the table and is checked on every open; per-tensor payload CRCs are checked only
by `verify()`, because reading 4.5 GB on every start would cost seconds.

(About 500 lines, kept in one file on purpose: the writer and the reader are the two halves of
one byte layout, and every check the fuzzer drives lives next to the field it guards.)
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import mmap
import os
import stat
import struct
import zlib
from pathlib import Path
from typing import Iterable

import numpy as np

from nq import __version__
from nq.config import GROUP_SIZE, LM_HEADS, ConfigError, ModelConfig
from nq.loader.outfile import check_output, fsync_folder, remove_stale

MAGIC = b"NANOQWEN"
VERSION = 1
LAYOUT_VALUE_SHUFFLE = 1
HEADER_SIZE = 256
ALIGN = 128                      # payload alignment: TMA and 128-bit loads want 16 B, 128 B is a line
CONFIG_TENSOR = "meta/nq_config.json"
MAX_TABLE = 16 << 20             # a 7B's table is ~40 KB; a larger one is damage, not a model
VERIFY_CHUNK = 64 << 20          # verify() checksums and unmaps 64 MiB at a time: RSS stays flat
FLAG_TIED = 1                    # bit 0: tie_word_embeddings (no fp16 lm_head tensor)
FLAG_LM_HEAD_INT8 = 2            # bit 1: lm_head.qweight int8 (V, H) + lm_head.scales fp32 (V,)
FLAG_LM_HEAD_INT4 = 4            # bit 2: lm_head.qweight u32 (V, H/8) + .scales fp16 (V, H/128)
FLAG_LM_HEAD_FP16_ROWS = 8       # bit 3, with bit 2: the fp16 `lm_head` kept too (untied) to
                                 # rescore the INT4 head's candidates (lm_head_rescore.py)
# each flag -> the first nq that reads it; a file written with flags beyond v1.0's records the
# newest of these in its header (`needs nq`), so that a reader that does not know a flag can
# say which nq it needs
FLAG_SINCE = {FLAG_TIED: "0.1.0", FLAG_LM_HEAD_INT8: "0.2.0", FLAG_LM_HEAD_INT4: "0.3.0",
              FLAG_LM_HEAD_FP16_ROWS: "0.4.0"}
KNOWN_FLAGS = sum(FLAG_SINCE)
# LM_HEADS, what `nq pack --lm-head` writes, and DEFAULT_LM_HEAD live in nq/config.py (the
# CLI's flags read them without numpy; fm.LM_HEADS is the same tuple)
INT4_HEADS = ("int4", "int4+fp16")                  # the ones with an INT4 head
# a quantised lm_head -> its header flags (fp16 has none); a file's head bits are one of these
LM_HEAD_FLAGS = {"int8": FLAG_LM_HEAD_INT8, "int4": FLAG_LM_HEAD_INT4,
                 "int4+fp16": FLAG_LM_HEAD_INT4 | FLAG_LM_HEAD_FP16_ROWS}
_HEAD_BITS = FLAG_LM_HEAD_INT8 | FLAG_LM_HEAD_INT4 | FLAG_LM_HEAD_FP16_ROWS
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# magic, version, layout, group, flags, vocab, hidden, inter, layers, heads, kv_heads, head_dim,
# tensor count, table offset, table bytes, file size, source revision, header crc32
_HEADER = struct.Struct("<8s12IQQQ40sI")
_HEADER_CRC_AT = _HEADER.size - 4
_NEEDS = struct.Struct("<16s")   # at byte 124, in the reserved area (zero in v1.0 files)
_NEEDS_AT = 124
_MIN_ENTRY = 2 + 2 + 20          # a table entry with an empty name and no dimensions
assert _HEADER.size <= _NEEDS_AT and _NEEDS_AT + _NEEDS.size <= HEADER_SIZE

DTYPES = {1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype("<u2"), 4: np.dtype("<i2"),
          5: np.dtype("<u4"), 6: np.dtype("<i4"), 7: np.dtype("<f2"), 8: np.dtype("<f4")}
_DTYPE_CODE = {v: k for k, v in DTYPES.items()}


class FormatError(ValueError):
    """A .nanoqwen file (or a tensor offered to the writer) that nq refuses; says what and how to fix."""


@dataclasses.dataclass(frozen=True)
class Header:
    version: int
    layout: int
    group_size: int
    flags: int
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tensor_count: int
    table_offset: int
    table_size: int
    file_size: int
    source_revision: str
    checksum: int

    DIMS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
            "num_kv_heads", "head_dim")


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32: int


def _layer_tensors(cfg: ModelConfig, i: int) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    f16, u32 = np.dtype("<f2"), np.dtype("<u4")
    p = f"layers.{i}."
    out = {p + "input_layernorm": (f16, (cfg.hidden_size,)),
           p + "post_attention_layernorm": (f16, (cfg.hidden_size,))}
    for proj, (n, k) in cfg.projection_shapes().items():
        out[p + proj + ".qweight"] = (u32, (n, k // 8))
        out[p + proj + ".scales"] = (f16, (n, k // GROUP_SIZE))
        if proj in ("q_proj", "k_proj", "v_proj"):
            out[p + proj + ".bias"] = (f16, (n,))
    return out


def _global_tensors(cfg: ModelConfig, lm_head: str) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    f16, u32 = np.dtype("<f2"), np.dtype("<u4")
    v, h = cfg.vocab_size, cfg.hidden_size
    out = {"embed_tokens": (f16, (v, h)), "norm": (f16, (h,))}
    # a quantised head, tied or not: the embedding stays fp16 for the lookup
    if lm_head == "int8":
        out["lm_head.qweight"] = (np.dtype(np.int8), (v, h))
        out["lm_head.scales"] = (np.dtype("<f4"), (v,))
    elif lm_head in INT4_HEADS:  # a projection's form (_layer_tensors), V outputs of H inputs
        out["lm_head.qweight"] = (u32, (v, h // 8))
        out["lm_head.scales"] = (f16, (v, h // GROUP_SIZE))
    if lm_head in ("fp16", "int4+fp16") and not cfg.tie_word_embeddings:
        out["lm_head"] = (f16, (v, h))
    return out


def _iter_expected(cfg: ModelConfig, lm_head: str):
    glob = _global_tensors(cfg, lm_head)
    yield "embed_tokens", glob.pop("embed_tokens")
    for i in range(cfg.num_layers):
        yield from _layer_tensors(cfg, i).items()
    yield from glob.items()


def _check_lm_head(lm_head: str) -> str:
    if lm_head not in LM_HEADS:
        raise ValueError(f"lm_head={lm_head!r}: a .nanoqwen lm_head is one of {', '.join(LM_HEADS)}")
    return lm_head


def expected_tensors(cfg: ModelConfig, lm_head: str = "fp16") -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """Every tensor a file for `cfg` must hold (meta/* aside), with dtype and shape, in file
    order; lm_head: "fp16", "int8", "int4" or "int4+fp16" (LM_HEADS)."""
    return dict(_iter_expected(cfg, _check_lm_head(lm_head)))


def expected_count(cfg: ModelConfig, lm_head: str = "fp16") -> int:
    """len(expected_tensors(cfg, lm_head)), without building it."""
    return len(_global_tensors(cfg, lm_head)) + cfg.num_layers * len(_layer_tensors(cfg, 0))


def _expected_lookup(cfg: ModelConfig, lm_head: str):
    """name -> (dtype, shape) or None, without listing every layer: a damaged config claiming
    10^9 layers is answered by reading the table, not by building 2 * 10^10 names."""
    glob = _global_tensors(cfg, lm_head)
    layer = {n.split(".", 2)[2]: v for n, v in _layer_tensors(cfg, 0).items()}

    def lookup(name: str):
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() \
                and parts[1] == str(int(parts[1])) and int(parts[1]) < cfg.num_layers:
            return layer.get(parts[2])
        return glob.get(name)
    return lookup


def _check_tensor(where: str, name: str, dtype: np.dtype, shape: tuple, want) -> None:
    """`want`: the (dtype, shape) the config requires for `name`, None if it requires none."""
    if name.startswith("meta/"):
        if dtype != np.uint8 or len(shape) != 1:
            raise FormatError(f"{where}: {name} is {dtype} {shape}, meta tensors are 1-D uint8; "
                              "re-pack with `nq pack`")
        return
    if want is None:
        raise FormatError(f"{where}: unexpected tensor {name!r} for this config; re-pack with `nq pack`")
    edt, eshape = want
    if dtype != edt or tuple(shape) != eshape:
        raise FormatError(f"{where}: tensor {name} is {dtype} {tuple(shape)}, the config needs "
                          f"{edt} {eshape}; re-pack with `nq pack`")


def write_nanoqwen(path, config: ModelConfig, tensors: Iterable[tuple[str, np.ndarray]],
                   meta: dict[str, bytes] | None = None, source_revision: str = "",
                   check: bool = True, lm_head: str = "fp16") -> Path:
    """Stream `tensors` (and `meta/<name>` byte blobs) into a .nanoqwen file at `path`.

    lm_head: "fp16" (an `lm_head` tensor, none when tied), "int8" or "int4" (`lm_head.qweight`
    and `lm_head.scales`, header flag bit 1 or 2), "int4+fp16" (int4's and, untied, the fp16
    `lm_head`; bits 2 and 3): expected_tensors(config, lm_head) lists them.

    Each array is written as it arrives and may be dropped by the caller right after, so peak
    memory is one tensor.  With `check` (always, outside tests of the reader's refusals) every
    tensor's dtype/shape is checked against `config` and the set must be complete.  Bytes go
    to `<path>.tmp-<pid>`, renamed over `path` once complete; any error (a full disk too),
    Ctrl-C or SIGTERM removes it, leaving `path` as it was (see nq.loader.outfile).
    """
    path = check_output(path)
    rev = source_revision.encode("ascii")
    if len(rev) > 40:
        raise FormatError(f"{path}: source revision {source_revision!r} is longer than 40 bytes")
    expect = expected_tensors(config, lm_head)
    remove_stale(path.parent, path.name + ".tmp-*")
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    entries: list[Entry] = []

    def blobs():
        yield CONFIG_TENSOR, np.frombuffer(config.to_json().encode(), np.uint8)
        for name, data in (meta or {}).items():
            yield f"meta/{name}", np.frombuffer(bytes(data), np.uint8)
        yield from tensors

    try:
        with open(tmp, "wb") as f:
            f.write(b"\0" * HEADER_SIZE)
            pos = HEADER_SIZE
            seen = set()
            for name, arr in blobs():
                arr = np.asarray(arr)
                dt = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
                if dt not in _DTYPE_CODE:
                    raise FormatError(f"{path}: tensor {name} has dtype {arr.dtype}, which the "
                                      f"format cannot store ({sorted(map(str, _DTYPE_CODE))})")
                if name in seen:
                    raise FormatError(f"{path}: tensor {name} written twice")
                seen.add(name)
                if check:
                    _check_tensor(str(path), name, dt, arr.shape, expect.get(name))
                buf = np.ascontiguousarray(arr, dtype=dt).reshape(-1).view(np.uint8)
                f.write(buf.data)
                entries.append(Entry(name, dt, tuple(int(s) for s in arr.shape), pos,
                                     buf.nbytes, zlib.crc32(buf)))
                pos += buf.nbytes
                f.write(b"\0" * (-pos % ALIGN))
                pos += -pos % ALIGN
            if check:
                missing = [n for n in expect if n not in seen]
                if missing:
                    raise FormatError(f"{path}: the writer was not given {len(missing)} required "
                                      f"tensors (first: {missing[:3]}); the pack is incomplete")
            table = _encode_table(entries)
            f.write(table)
            flags = (FLAG_TIED if config.tie_word_embeddings else 0) | LM_HEAD_FLAGS.get(lm_head, 0)
            c = config
            fields = [MAGIC, VERSION, LAYOUT_VALUE_SHUFFLE, GROUP_SIZE, flags, c.vocab_size,
                      c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads,
                      c.num_kv_heads, c.head_dim, len(entries), pos, len(table),
                      pos + len(table), rev]
            crc = zlib.crc32(table, zlib.crc32(_encode_header(fields, 0, flags)))
            f.seek(0)
            f.write(_encode_header(fields, crc, flags))
            # On the disk before the rename: a power cut after it must not leave a complete-
            # looking name over unwritten blocks (ext4/xfs may order the rename first).
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_folder(path.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.errno is None:
            raise
        # a full disk says ENOSPC with no file name (or the temporary name): name the output
        raise OSError(e.errno, e.strerror, str(path)) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _needs_nq(flags: int) -> bytes:
    """The `needs nq` field: the newest FLAG_SINCE of the flags beyond v1.0's; empty (zero, as
    in every file from before the field) when every v1 reader reads the file."""
    if not flags & ~FLAG_TIED:
        return b""
    return max((v for f, v in FLAG_SINCE.items() if flags & f),
               key=lambda v: tuple(map(int, v.split(".")))).encode("ascii")


def _encode_header(fields: list, crc: int, flags: int) -> bytes:
    raw = bytearray(_HEADER.pack(*fields, crc).ljust(HEADER_SIZE, b"\0"))
    _NEEDS.pack_into(raw, _NEEDS_AT, _needs_nq(flags))
    return bytes(raw)


def _encode_table(entries: list[Entry]) -> bytes:
    out = bytearray()
    for e in entries:
        name = e.name.encode()
        out += struct.pack("<H", len(name)) + name
        out += struct.pack("<BB", _DTYPE_CODE[e.dtype], len(e.shape))
        out += struct.pack(f"<{len(e.shape)}Q", *e.shape)
        out += struct.pack("<QQI", e.offset, e.nbytes, e.crc32)
    return bytes(out)


def _corrupt(where: str, what: str) -> FormatError:
    return FormatError(f"{where}: {what}; the file is corrupt, re-pack with `nq pack`")


def _decode_table(where: str, table: bytes, count: int) -> dict[str, Entry]:
    if count * _MIN_ENTRY > len(table):
        raise _corrupt(where, f"the header claims {count} tensors, more than a {len(table)}-byte "
                              "table can hold")
    out: dict[str, Entry] = {}
    pos = 0
    try:
        for _ in range(count):
            (n,) = struct.unpack_from("<H", table, pos)
            if pos + 2 + n > len(table):
                raise struct.error(f"a name of {n} bytes runs past the table's end")
            name = table[pos + 2:pos + 2 + n].decode()
            pos += 2 + n
            code, ndim = struct.unpack_from("<BB", table, pos)
            shape = struct.unpack_from(f"<{ndim}Q", table, pos + 2)
            pos += 2 + 8 * ndim
            offset, nbytes, crc = struct.unpack_from("<QQI", table, pos)
            pos += 20
            if code not in DTYPES:
                raise FormatError(f"{where}: tensor {name} has unknown dtype code {code}; "
                                  "re-pack with `nq pack`")
            if name in out:
                raise _corrupt(where, f"tensor {name} appears twice in the table")
            out[name] = Entry(name, DTYPES[code], tuple(shape), offset, nbytes, crc)
    except (struct.error, UnicodeDecodeError) as e:
        raise _corrupt(where, f"the tensor table is malformed ({e})") from None
    if pos != len(table):
        raise _corrupt(where, f"the tensor table has {len(table) - pos} trailing bytes")
    return out


def _check_entries(where: str, entries: dict[str, Entry], table_offset: int) -> None:
    """Every payload inside [HEADER_SIZE, table_offset), aligned, sized by its shape, and no two
    overlapping: after this, np.frombuffer of any entry is a view inside the mapping."""
    spans = []
    for e in entries.values():
        if e.offset < HEADER_SIZE or e.offset + e.nbytes > table_offset:
            raise _corrupt(where, f"tensor {e.name} spans bytes [{e.offset}, {e.offset + e.nbytes}), "
                                  f"outside the payload area [{HEADER_SIZE}, {table_offset})")
        if e.offset % ALIGN:
            raise _corrupt(where, f"tensor {e.name} starts at byte {e.offset}, not a multiple of {ALIGN}")
        # math.prod: exact on Python ints (np.prod wraps in int64, or overflows on u64 dims)
        if e.nbytes != math.prod(e.shape) * e.dtype.itemsize:
            raise _corrupt(where, f"tensor {e.name} has {e.nbytes} bytes for shape {e.shape} {e.dtype}")
        spans.append((e.offset, e.offset + e.nbytes, e.name))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise _corrupt(where, f"tensors {a} and {b} overlap")


def release_pages(mm: mmap.mmap, offset: int, nbytes: int) -> None:
    """Drop a mapped range from this process's resident set (the page cache keeps it).

    Touched pages of a file mapping count in RSS until unmapped; streaming over a 15 GB
    checkpoint or a 4.5 GB .nanoqwen without this would show the whole file as resident.
    """
    if nbytes <= 0 or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = offset - offset % mmap.PAGESIZE
    end = min(len(mm), offset + nbytes)
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, end - start)
    except (OSError, ValueError):
        pass                     # only a memory-use hint; never worth failing a load over


class NanoqwenFile:
    """A .nanoqwen file mapped read-only; tensors are zero-copy views of the mapping.

    Opening checks the header, the header/table checksum, every table entry's bounds and the
    stored config against the header and the required tensor set; `verify()` also checks
    every payload's CRC-32.
    """

    def __init__(self, path, verify: bool = False):
        self.path = Path(path)
        where = str(self.path)
        try:
            st = self.path.stat()
        except FileNotFoundError:
            raise FormatError(f"{where}: no such file; create it with `nq pack`") from None
        if stat.S_ISDIR(st.st_mode):
            raise FormatError(f"{where}: is a directory, not a .nanoqwen file; give the file's "
                              "path (or pass the folder to `nq pack` if it is a Hugging Face snapshot)")
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{where}: not a regular file; give a .nanoqwen file made by `nq pack`")
        if st.st_size < HEADER_SIZE:
            raise FormatError(f"{where}: truncated file ({st.st_size} bytes, shorter than the "
                              f"{HEADER_SIZE}-byte header); re-pack with `nq pack`")
        with open(self.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._open(where, len(self._mm))
            if verify:
                self.verify()
        except BaseException:
            self._mm.close()     # a refused file leaves no mapping behind
            raise

    def _open(self, where: str, size: int) -> None:
        raw = bytes(self._mm[:HEADER_SIZE])
        fields = _HEADER.unpack_from(raw)
        if fields[0] != MAGIC:
            raise FormatError(f"{where}: not a .nanoqwen file (magic {fields[0]!r}, expected "
                              f"{MAGIC!r}); create one from a Hugging Face snapshot with `nq pack`")
        h = Header(*fields[1:-2], source_revision=fields[-2].rstrip(b"\0").decode("ascii", "replace"),
                   checksum=fields[-1])
        self.header = h
        # the nq the writer says this file needs ("" in files every v1 reader reads)
        self.needs_nq = _NEEDS.unpack_from(raw, _NEEDS_AT)[0].rstrip(b"\0").decode("ascii", "replace")
        needs = f"this file needs nq >= {self.needs_nq}, " if self.needs_nq else ""
        if h.version != VERSION:
            raise FormatError(f"{where}: format version {h.version}, this nq reads version "
                              f"{VERSION}; {needs}re-pack with this version's `nq pack`")
        if h.layout != LAYOUT_VALUE_SHUFFLE:
            raise FormatError(f"{where}: weight layout id {h.layout}, nq's kernels read only "
                              f"{LAYOUT_VALUE_SHUFFLE} (ValueShuffle); re-pack with `nq pack`")
        if h.group_size != GROUP_SIZE:
            raise FormatError(f"{where}: INT4 group size {h.group_size}, the kernels are built "
                              f"for {GROUP_SIZE}; re-pack with `nq pack`")
        if h.file_size != size or h.table_offset + h.table_size != size:
            raise FormatError(f"{where}: truncated or extended file ({size} bytes, the header "
                              f"says {h.file_size}, its table ends at {h.table_offset + h.table_size}); "
                              "re-download or re-pack with `nq pack`")
        if h.table_offset < HEADER_SIZE or h.table_size > MAX_TABLE:
            raise _corrupt(where, f"a {h.table_size}-byte tensor table at byte {h.table_offset} is "
                                  f"impossible (header {HEADER_SIZE} bytes, tables under {MAX_TABLE})")
        table = bytes(self._mm[h.table_offset:h.table_offset + h.table_size])
        zeroed = raw[:_HEADER_CRC_AT] + b"\0\0\0\0" + raw[_HEADER_CRC_AT + 4:]
        crc = zlib.crc32(table, zlib.crc32(zeroed))
        if crc != h.checksum:
            raise _corrupt(where, f"header/table checksum mismatch (stored {h.checksum:08x}, "
                                  f"computed {crc:08x})")
        if h.flags & ~KNOWN_FLAGS:
            raise FormatError(f"{where}: unknown header flags {h.flags & ~KNOWN_FLAGS:#x} (nq "
                              f"{__version__} knows {KNOWN_FLAGS:#x}); {needs or 'this file needs a newer nq, '}"
                              "upgrade nq or re-pack with this version's `nq pack`")
        bits = h.flags & _HEAD_BITS
        heads = [k for k, f in LM_HEAD_FLAGS.items() if f == bits]
        if bits and not heads:   # no writer sets these together: the tensors are ambiguous
            raise _corrupt(where, f"header flags {h.flags:#x} mark no lm_head nq writes "
                                  f"({', '.join(f'{k} {f:#x}' for k, f in LM_HEAD_FLAGS.items())})")
        self.lm_head = heads[0] if heads else "fp16"
        self._entries = _decode_table(where, table, h.tensor_count)
        _check_entries(where, self._entries, h.table_offset)
        self.config = self._read_config(where)

    def _read_config(self, where: str) -> ModelConfig:
        if CONFIG_TENSOR not in self._entries:
            raise FormatError(f"{where}: no {CONFIG_TENSOR} tensor; re-pack with `nq pack`")
        try:
            cfg = ModelConfig.from_json(self.meta(CONFIG_TENSOR))
        except ConfigError as e:
            raise FormatError(f"{where}: the stored config is unusable ({e}); re-pack with `nq pack`") from None
        h = self.header
        for dim in Header.DIMS:
            if getattr(h, dim) != getattr(cfg, dim):
                raise _corrupt(where, f"header {dim}={getattr(h, dim)} contradicts the stored "
                                      f"config ({getattr(cfg, dim)})")
        if bool(h.flags & FLAG_TIED) != cfg.tie_word_embeddings:
            raise FormatError(f"{where}: header tied-embedding flag contradicts the stored config; "
                              "re-pack with `nq pack`")
        lookup = _expected_lookup(cfg, self.lm_head)
        for e in self._entries.values():
            _check_tensor(where, e.name, e.dtype, e.shape, lookup(e.name))
        # every weight entry is now a distinct expected name, so a short count means missing ones
        n_weights = sum(not n.startswith("meta/") for n in self._entries)
        want = expected_count(cfg, self.lm_head)
        if n_weights != want:
            first = itertools.islice((n for n, _ in _iter_expected(cfg, self.lm_head)
                                      if n not in self._entries), 3)
            raise FormatError(f"{where}: missing {want - n_weights} required tensors "
                              f"(first: {', '.join(first)}); re-pack with `nq pack`")
        return cfg

    # ---- access ------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def entry(self, name: str) -> Entry:
        if name == "lm_head" and name not in self._entries and self.config.tie_word_embeddings \
                and self.lm_head == "fp16":
            name = "embed_tokens"
        try:
            return self._entries[name]
        except KeyError:
            quant = f" (its lm_head is {self.lm_head}: lm_head.qweight, lm_head.scales)" \
                if name == "lm_head" and self.lm_head != "fp16" else ""
            raise KeyError(f"{self.path}: no tensor {name!r}{quant}") from None

    def array(self, name: str) -> np.ndarray:
        """A read-only view into the mapping (no copy); `lm_head` aliases `embed_tokens` when
        tied (and the lm_head is fp16)."""
        e = self.entry(name)
        count = e.nbytes // e.dtype.itemsize
        return np.frombuffer(self._mm, e.dtype, count, e.offset).reshape(e.shape)

    def meta(self, name: str) -> bytes:
        """The bytes of `meta/<name>` (e.g. "tokenizer.json"); KeyError if not stored."""
        return self.array(name if name.startswith("meta/") else "meta/" + name).tobytes()

    def release(self, name: str) -> None:
        """Drop `name`'s pages from RSS once it has been copied elsewhere (e.g. to the GPU)."""
        e = self.entry(name)
        release_pages(self._mm, e.offset, e.nbytes)

    def verify(self) -> int:
        """Check every payload's CRC-32; returns the bytes checked, raises FormatError on a mismatch."""
        total = 0
        view = memoryview(self._mm)
        try:
            for e in self._entries.values():
                crc = 0
                for at in range(e.offset, e.offset + e.nbytes, VERIFY_CHUNK):
                    end = min(at + VERIFY_CHUNK, e.offset + e.nbytes)
                    crc = zlib.crc32(view[at:end], crc)
                    release_pages(self._mm, at, end - at)
                if crc != e.crc32:
                    raise FormatError(f"{self.path}: payload checksum mismatch in tensor {e.name} "
                                      f"(stored {e.crc32:08x}, computed {crc:08x}); the file is "
                                      "corrupt, re-download or re-pack with `nq pack`")
                total += e.nbytes
        finally:
            view.release()
        return total

    def describe(self) -> str:
        """Header, config and tensor table as text (what `nq info` prints)."""
        h, c = self.header, self.config
        lines = [f"{self.path}: .nanoqwen v{h.version}, layout {h.layout} (ValueShuffle), "
                 f"group {h.group_size}, {h.file_size / 2**30:.2f} GiB, {h.tensor_count} tensors",
                 f"source revision: {h.source_revision or '(unknown)'}",
                 f"config: {c.name}: vocab {c.vocab_size}, hidden {c.hidden_size}, intermediate "
                 f"{c.intermediate_size}, layers {c.num_layers}, heads {c.num_heads}/{c.num_kv_heads} "
                 f"(q/kv), head_dim {c.head_dim}, rope_theta {c.rope_theta:g}, eps {c.rms_norm_eps:g}, "
                 f"tied embeddings {c.tie_word_embeddings}",
                 f"lm_head: {self._lm_head_words()}",
                 f"{'tensor':<40} {'dtype':<8} {'shape':<18} {'offset':>12} {'bytes':>12}  crc32"]
        for e in self._entries.values():
            shape = "x".join(map(str, e.shape))
            lines.append(f"{e.name:<40} {e.dtype.name:<8} {shape:<18} {e.offset:>12} "
                         f"{e.nbytes:>12}  {e.crc32:08x}")
        return "\n".join(lines)

    def _lm_head_words(self) -> str:
        if self.lm_head == "fp16":
            return "fp16 (embed_tokens, tied)" if self.config.tie_word_embeddings else "fp16"
        tied = "; embed_tokens stays fp16 for the lookup" if self.config.tie_word_embeddings else ""
        needs = f"; needs nq >= {self.needs_nq}" if self.needs_nq else ""
        if self.lm_head in INT4_HEADS:
            rows = ""
            if self.lm_head == "int4+fp16" or self.config.tie_word_embeddings:
                src = "embed_tokens" if self.config.tie_word_embeddings else "the fp16 lm_head"
                rows = f"; its candidates rescored by {src}"
            return (f"{self.lm_head} (lm_head.qweight in the projections' INT4 ValueShuffle "
                    f"form, fp16 scales a {GROUP_SIZE}-group in lm_head.scales{tied}{rows})"
                    f"{needs}")
        return f"int8 (lm_head.qweight, one fp32 scale a row in lm_head.scales{tied}){needs}"

    def close(self) -> None:
        try:
            self._mm.close()
        except BufferError:
            pass                 # arrays still view the mapping; it closes when they are gone

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_nanoqwen(path, verify: bool = False) -> NanoqwenFile:
    return NanoqwenFile(path, verify=verify)
