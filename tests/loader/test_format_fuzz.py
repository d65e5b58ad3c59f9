"""The .nanoqwen reader under fuzzing: over 10,000 damaged files, each one refused with a
FormatError naming the file, or opened with every view inside the mapping.

One small base file (1 layer, hidden 128, ~60 KB) is written once; each case rewrites it with
one mutation: a truncation or extension, raw bit flips in the header or the tensor table (the
header checksum catches those), and the same flips with the checksum recomputed, so that what
lies behind the checksum is exercised too: header fields set to edge values (0, 2^32-1,
2^64-1, the file size +-1), table entries with overflowing offsets, sizes and shapes, unknown
dtype codes, lying name lengths, invalid UTF-8, duplicate, missing and unknown names, huge
tensor counts, and stored configs with wrong JSON types or 10^9 layers.  Flips inside a
payload must open and then fail verify().  A case may not take a second, and the whole run
may not grow the process by more than 256 MB.  Seeded: a failure names its case number, and
`_case(rng_for(i))` rebuilds it.
"""
import dataclasses
import json
import resource
import struct
import time
import zlib

import numpy as np
import pytest

from nq.config import ModelConfig
from nq.loader.format import (_HEADER, _HEADER_CRC_AT, ALIGN, CONFIG_TENSOR, DTYPES, HEADER_SIZE,
                              FormatError, NanoqwenFile, expected_tensors, write_nanoqwen)

CASES = 10_400
SEED = 20240611
CFG = ModelConfig(vocab_size=8, hidden_size=128, intermediate_size=128, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=64, tie_word_embeddings=True, name="fuzz")
# _HEADER fields: 0 magic .. 4 flags, 5-11 dims, 12 count, 13 table offset, 14 table size,
# 15 file size, 16 revision, 17 crc
COUNT, TOFF, TSIZE, FSIZE = 12, 13, 14, 15
U32_EDGES = [0, 1, 2, 7, 8, 64, 127, 128, 255, 256, 257, 2**15, 2**16 - 1, 2**16, 2**31 - 1,
             2**31, 2**32 - 1]
U64_EDGES = U32_EDGES + [2**32, 2**40, 2**63 - 1, 2**63, 2**64 - 1]


@dataclasses.dataclass
class Raw:
    """One table entry as raw fields, so a mutation can make any of them lie."""
    name: bytes
    code: int
    shape: list
    offset: int
    nbytes: int
    crc: int
    nlen: int | None = None      # the stored name length; None: len(name)
    ndim: int | None = None      # the stored ndim; None: len(shape)

    def encode(self) -> bytes:
        nlen = len(self.name) if self.nlen is None else self.nlen
        ndim = len(self.shape) if self.ndim is None else self.ndim
        return (struct.pack("<H", nlen % 2**16) + self.name
                + struct.pack("<BB", self.code % 256, ndim % 256)
                + b"".join(struct.pack("<Q", d % 2**64) for d in self.shape)
                + struct.pack("<QQI", self.offset % 2**64, self.nbytes % 2**64, self.crc % 2**32))


@dataclasses.dataclass
class Base:
    data: bytes
    fields: list
    entries: list                # Raw, in table order
    payloads: dict               # name -> payload bytes


def build(fields, entries, body: bytes) -> bytes:
    """Header (sizes from the parts, checksum recomputed) + body + table."""
    table = b"".join(e.encode() for e in entries)
    f = list(fields)
    f[COUNT], f[TOFF], f[TSIZE] = len(entries), HEADER_SIZE + len(body), len(table)
    f[FSIZE] = HEADER_SIZE + len(body) + len(table)
    return recrc(_HEADER.pack(*f).ljust(HEADER_SIZE, b"\0") + body + table)


def relayout(base: Base, fields, entries, payloads: dict) -> bytes:
    """Lay `payloads` out afresh (aligned, in entry order) and build the file around them."""
    body = bytearray()
    for e in entries:
        body += b"\0" * (-(HEADER_SIZE + len(body)) % ALIGN)
        e.offset = HEADER_SIZE + len(body)
        blob = payloads.get(e.name.decode(errors="replace"), b"")
        e.nbytes, e.crc = len(blob), zlib.crc32(blob)
        body += blob
    body += b"\0" * (-(HEADER_SIZE + len(body)) % ALIGN)
    return build(fields, entries, bytes(body))


def recrc(data: bytes) -> bytes:
    """Recompute the header checksum over whatever table the (possibly damaged) header points
    at, as the reader would read it: what lies behind the checksum is then reachable."""
    if len(data) < HEADER_SIZE:
        return data
    f = _HEADER.unpack_from(data)
    table = data[f[TOFF]:f[TOFF] + f[TSIZE]]
    head = data[:_HEADER_CRC_AT] + b"\0" * 4 + data[_HEADER_CRC_AT + 4:HEADER_SIZE]
    crc = zlib.crc32(table, zlib.crc32(head))
    return data[:_HEADER_CRC_AT] + struct.pack("<I", crc) + data[_HEADER_CRC_AT + 4:]


def make_base(path) -> Base:
    rng = np.random.default_rng(0)
    tensors = []
    for name, (dt, shape) in expected_tensors(CFG).items():
        if dt == np.uint32:
            tensors.append((name, rng.integers(0, 2**32, shape, dtype=np.uint32)))
        else:
            tensors.append((name, rng.standard_normal(shape).astype(dt)))
    write_nanoqwen(path, CFG, tensors, meta={"tokenizer.json": b'{"model": {}}'})
    data = path.read_bytes()
    fields = list(_HEADER.unpack_from(data))
    nf = NanoqwenFile(path)
    entries, payloads = [], {}
    for name in nf.names():
        e = nf.entry(name)
        entries.append(Raw(name.encode(), {v: k for k, v in DTYPES.items()}[e.dtype],
                           list(e.shape), e.offset, e.nbytes, e.crc32))
        payloads[name] = data[e.offset:e.offset + e.nbytes]
    nf.close()
    return Base(data, fields, entries, payloads)


# ---- mutations: each takes (rng, base) and returns (kind, file bytes) ------------------------
def _flip(data: bytes, rng, lo: int, hi: int, flips: int) -> bytes:
    out = bytearray(data)
    for _ in range(flips):
        out[int(rng.integers(lo, hi))] ^= 1 << int(rng.integers(8))
    return bytes(out)


def m_truncate(rng, b):
    n = len(b.data)
    toff = b.fields[TOFF]
    cut = int(rng.choice([rng.integers(0, n), rng.integers(0, HEADER_SIZE + 1),
                          rng.integers(toff - 2, n), n - 1]))
    return "truncate", b.data[:cut]


def m_extend(rng, b):
    return "extend", b.data + rng.bytes(int(rng.integers(1, 300)))


def m_flip_raw(rng, b):
    where = rng.choice(["header", "table"])
    lo, hi = (0, HEADER_SIZE) if where == "header" else (b.fields[TOFF], len(b.data))
    return f"flip {where}", _flip(b.data, rng, lo, hi, int(rng.integers(1, 4)))


def m_flip_sealed(rng, b):
    where = rng.choice(["header", "table"])
    lo, hi = (0, _HEADER_CRC_AT) if where == "header" else (b.fields[TOFF], len(b.data))
    return f"flip {where} +crc", recrc(_flip(b.data, rng, lo, hi, int(rng.integers(1, 4))))


def m_header_field(rng, b):
    i = int(rng.integers(1, 16))
    size = len(b.data)
    edges = (U64_EDGES + [size - 1, size, size + 1, b.fields[TOFF] - 1, b.fields[TOFF] + 1]
             if i in (TOFF, TSIZE, FSIZE) else U32_EDGES + [b.fields[i] + 1, b.fields[i] - 1])
    f = list(b.fields)
    f[i] = int(rng.choice(edges)) % (2**64 if i in (TOFF, TSIZE, FSIZE) else 2**32)
    return "header field", recrc(_HEADER.pack(*f).ljust(HEADER_SIZE, b"\0") + b.data[HEADER_SIZE:])


def m_entry_field(rng, b):
    entries = [dataclasses.replace(e, shape=list(e.shape)) for e in b.entries]
    e = entries[int(rng.integers(len(entries)))]
    what = rng.choice(["offset", "nbytes", "dim", "ndim", "code", "nlen", "name", "crc"])
    if what == "offset":
        e.offset = int(rng.choice(U64_EDGES + [e.offset + 1, e.offset + ALIGN, len(b.data),
                                              b.fields[TOFF], e.offset - ALIGN]))
    elif what == "nbytes":
        e.nbytes = int(rng.choice(U64_EDGES + [e.nbytes + 1, e.nbytes - 1, 2 * e.nbytes]))
    elif what == "dim":
        if e.shape:
            e.shape[int(rng.integers(len(e.shape)))] = int(rng.choice(U64_EDGES))
    elif what == "ndim":
        e.shape = e.shape + [1] if rng.random() < 0.5 else e.shape[:-1]
        if rng.random() < 0.3:
            e.ndim = int(rng.choice([0, 1, 2, 3, 200, 255]))    # lies about the dims stored
    elif what == "code":
        e.code = int(rng.choice([0, 9, 100, 255] + list(DTYPES)))
    elif what == "nlen":
        e.nlen = int(rng.choice([0, 1, len(e.name) - 1, len(e.name) + 1, 2**16 - 1]))
    elif what == "name":
        others = [x.name for x in entries if x is not e]
        e.name = rng.choice([others[int(rng.integers(len(others)))], b"", b"\xff\xfe",
                             b"layers.1.q_proj.qweight", b"layers.01.q_proj.qweight",
                             b"layers.-1.q_proj.qweight", b"meta/extra", b"x" * 300,
                             b"lm_head", "é".encode()])
    else:
        e.crc ^= 1 << int(rng.integers(32))
    return f"entry {what}", build(b.fields, entries, b.data[HEADER_SIZE:b.fields[TOFF]])


def m_entry_list(rng, b):
    entries = [dataclasses.replace(e, shape=list(e.shape)) for e in b.entries]
    what = rng.choice(["drop", "duplicate", "swap offsets", "reverse", "count"])
    i, j = (int(x) for x in rng.integers(len(entries), size=2))
    if what == "drop":
        del entries[i]
    elif what == "duplicate":
        entries.insert(j, dataclasses.replace(entries[i]))
    elif what == "swap offsets":
        entries[i].offset, entries[j].offset = entries[j].offset, entries[i].offset
    elif what == "reverse":
        entries.reverse()
    data = build(b.fields, entries, b.data[HEADER_SIZE:b.fields[TOFF]])
    if what == "count":  # the table is intact, the count is not
        f = list(_HEADER.unpack_from(data))
        f[COUNT] = int(rng.choice([0, f[COUNT] - 1, f[COUNT] + 1, 2**31, 2**32 - 1]))
        data = recrc(_HEADER.pack(*f).ljust(HEADER_SIZE, b"\0") + data[HEADER_SIZE:])
    return f"entries {what}", data


CONFIG_VALUES = [0, -1, 1, 2, 64, 128, 2**31, 2**40, 10**9, 10**30, 2.0, 64.0, 1e-300, True,
                 False, None, "2", "", [], {}, float("nan"), float("inf")]


def m_config(rng, b):
    d = json.loads(b.payloads[CONFIG_TENSOR])
    fields = list(b.fields)
    what = rng.choice(["value", "value", "value", "drop", "extra", "not an object", "bytes"])
    if what == "value":
        key = str(rng.choice(sorted(d)))
        d[key] = CONFIG_VALUES[int(rng.integers(len(CONFIG_VALUES)))]
        names = ["vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim"]
        if key in names and isinstance(d[key], int) and 0 <= d[key] < 2**32 and rng.random() < 0.7:
            fields[5 + names.index(key)] = int(d[key])    # the header agrees: go deeper
        blob = json.dumps(d).encode()
    elif what == "drop":
        del d[str(rng.choice(sorted(d)))]
        blob = json.dumps(d).encode()
    elif what == "extra":
        d["rope_scaling"] = {"type": "yarn"}
        blob = json.dumps(d).encode()
    elif what == "not an object":
        blob = rng.choice([b"[]", b"1", b'"x"', b"null", b"{", b""])
    else:
        blob = rng.bytes(int(rng.integers(0, 40)))
    payloads = dict(b.payloads)
    payloads[CONFIG_TENSOR] = blob
    entries = [dataclasses.replace(e, shape=list(e.shape)) for e in b.entries]
    for e in entries:
        if e.name == CONFIG_TENSOR.encode():
            e.shape = [len(blob)]
    return f"config {what}", relayout(b, fields, entries, payloads)


def m_payload(rng, b):
    return "payload flip", _flip(b.data, rng, HEADER_SIZE, b.fields[TOFF], 1)


MUTATIONS = [(m_truncate, 1), (m_extend, 0.5), (m_flip_raw, 2), (m_flip_sealed, 3),
             (m_header_field, 2), (m_entry_field, 4), (m_entry_list, 1.5), (m_config, 2.5),
             (m_payload, 0.5)]
_WEIGHTS = np.array([w for _, w in MUTATIONS]) / sum(w for _, w in MUTATIONS)


def rng_for(i: int):
    return np.random.default_rng([SEED, i])


def _case(rng, base):
    fn = MUTATIONS[int(rng.choice(len(MUTATIONS), p=_WEIGHTS))][0]
    return fn(rng, base)


def _check(path) -> str:
    """Open; if it opens, every view is inside the mapping and verify() runs.  Only a
    FormatError naming the file may escape."""
    try:
        nf = NanoqwenFile(path)
    except FormatError as e:
        assert str(path) in str(e)
        return "refused"
    size = len(nf._mm)
    assert nf.describe()
    for name in nf.names():
        e = nf.entry(name)
        assert HEADER_SIZE <= e.offset and e.offset + e.nbytes <= size, name
        a = nf.array(name)
        assert a.nbytes == e.nbytes and a.shape == e.shape
        if a.size:
            a.reshape(-1)[-1].tobytes()     # the last byte is readable
        del a
    try:
        nf.verify()
    except FormatError as e:
        assert str(path) in str(e)
        return "verify"
    finally:
        nf.close()
    return "opened"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_base(tmp_path_factory.mktemp("fuzz") / "base.nanoqwen")


def test_fuzzed_files_end_in_format_errors(base, tmp_path, capsys):
    path = tmp_path / "case.nanoqwen"
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tally: dict[str, dict[str, int]] = {}
    slowest = 0.0
    t0 = time.perf_counter()
    for i in range(CASES):
        kind, data = _case(rng_for(i), base)
        path.write_bytes(data)
        t = time.perf_counter()
        try:
            outcome = _check(path)
        except Exception as e:
            raise AssertionError(f"case {i} ({kind}): {type(e).__name__}: {e}") from e
        slowest = max(slowest, time.perf_counter() - t)
        tally.setdefault(kind, {}).setdefault(outcome, 0)
        tally[kind][outcome] += 1
        if kind in ("truncate", "extend", "flip header", "flip table"):
            assert outcome == "refused", (i, kind)
    elapsed = time.perf_counter() - t0
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    with capsys.disabled():
        print(f"\nformat fuzz: {CASES} cases in {elapsed:.1f} s (slowest {slowest * 1e3:.1f} ms, "
              f"max RSS +{grown:.0f} MB)")
        for kind in sorted(tally):
            print(f"  {kind:24s} {tally[kind]}")
    assert slowest < 1.0 and grown < 256
    # every kind of damage came up, and each was refused at least once ("opened" is fine for
    # damage that leaves a valid file: a revision byte, a meta name, a reordered table)
    assert len(tally) == 26 and all(t.get("refused", 0) + t.get("verify", 0)
                                    for kind, t in tally.items() if kind != "entries reverse")


def test_payload_flips_fail_verify(base, tmp_path):
    """A flip inside a tensor's bytes opens (payloads are checked by verify, not on open) and
    verify() names it; a flip in alignment padding changes nothing anyone reads."""
    path = tmp_path / "p.nanoqwen"
    nf = NanoqwenFile(_write(path, base.data))
    spans = [(nf.entry(n).offset, nf.entry(n).offset + nf.entry(n).nbytes, n) for n in nf.names()]
    nf.close()
    rng = np.random.default_rng(3)
    for _ in range(200):
        at = int(rng.integers(HEADER_SIZE, base.fields[TOFF]))
        data = bytearray(base.data)
        data[at] ^= 1 << int(rng.integers(8))
        outcome = _check(_write(path, bytes(data)))
        inside = [n for lo, hi, n in spans if lo <= at < hi]
        if not inside:
            assert outcome == "opened", at
        elif inside[0] == CONFIG_TENSOR:
            assert outcome in ("refused", "verify"), at   # the config is read on open
        else:
            assert outcome == "verify", (at, inside)


def test_refusal_messages_name_the_fault(base, tmp_path):
    """A few of the mutations above, by hand, with the words the reader must use."""
    path = tmp_path / "m.nanoqwen"

    def refused(data, pattern):
        with pytest.raises(FormatError, match=pattern):
            NanoqwenFile(_write(path, data))

    f = list(base.fields)
    f[COUNT] = 2**32 - 1
    refused(recrc(_HEADER.pack(*f).ljust(HEADER_SIZE, b"\0") + base.data[HEADER_SIZE:]),
            r"claims 4294967295 tensors, more than a \d+-byte table can hold")
    entries = [dataclasses.replace(e) for e in base.entries]
    entries[3].name = entries[2].name
    refused(build(base.fields, entries, base.data[HEADER_SIZE:base.fields[TOFF]]),
            r"appears twice in the table")
    entries = [dataclasses.replace(e, shape=list(e.shape)) for e in base.entries]
    big = next(e for e in entries if e.name == b"embed_tokens")
    big.shape = [2**32, 2**32]                       # prod wraps to 0 in int64: must not pass
    big.nbytes = 0
    refused(build(base.fields, entries, base.data[HEADER_SIZE:base.fields[TOFF]]),
            r"embed_tokens has 0 bytes for shape \(4294967296, 4294967296\)")
    big.shape, big.nbytes = [2**63, 2], 2048         # u64 dims: exact products, no overflow
    refused(build(base.fields, entries, base.data[HEADER_SIZE:base.fields[TOFF]]),
            r"embed_tokens has \d+ bytes for shape")
    entries = [dataclasses.replace(e, shape=list(e.shape)) for e in base.entries]
    entries[1].offset += 2                           # meta/tokenizer.json: 13 bytes, padded
    refused(build(base.fields, entries, base.data[HEADER_SIZE:base.fields[TOFF]]),
            r"not a multiple of 128")
    d = json.loads(base.payloads[CONFIG_TENSOR])
    d["num_layers"] = 10**9
    f = list(base.fields)
    f[8] = 10**9
    entries = [dataclasses.replace(e, shape=list(e.shape)) for e in base.entries]
    payloads = dict(base.payloads, **{CONFIG_TENSOR: json.dumps(d).encode()})
    next(e for e in entries if e.name == CONFIG_TENSOR.encode()).shape = [len(payloads[CONFIG_TENSOR])]
    t = time.perf_counter()
    refused(relayout(base, f, entries, payloads), r"missing 18999999981 required tensors")
    assert time.perf_counter() - t < 0.5             # counted, not listed
    d["num_layers"] = 1.0
    payloads[CONFIG_TENSOR] = json.dumps(d).encode()
    next(e for e in entries if e.name == CONFIG_TENSOR.encode()).shape = [len(payloads[CONFIG_TENSOR])]
    refused(relayout(base, base.fields, entries, payloads), r"num_layers is 1.0, not int")


def test_directory_and_special_files(tmp_path):
    with pytest.raises(FormatError, match=r"is a directory, not a .nanoqwen file"):
        NanoqwenFile(tmp_path)
    with pytest.raises(FormatError, match=r"not a regular file"):
        NanoqwenFile("/dev/null")


def _write(path, data):
    path.write_bytes(data)
    return path
