"""The .nanoqwen v1 writer and reader: round trip, zero-copy views, and every refusal."""
import os
import zlib

import numpy as np
import pytest

from nq.config import tiny_config
from nq.loader import format as fm
from nq.loader.format import FormatError, NanoqwenFile, open_nanoqwen, write_nanoqwen


def random_tensors(cfg, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for name, (dt, shape) in fm.expected_tensors(cfg).items():
        if dt == np.uint32:
            out.append((name, rng.integers(0, 2**32, size=shape, dtype=np.uint32)))
        else:
            out.append((name, rng.standard_normal(shape).astype(dt)))
    return out


@pytest.fixture
def written(tmp_path):
    cfg = tiny_config(num_layers=1)
    tensors = random_tensors(cfg)
    path = write_nanoqwen(tmp_path / "m.nanoqwen", cfg, iter(tensors),
                          meta={"tokenizer.json": b'{"x": 1}'}, source_revision="a" * 40)
    return path, cfg, dict(tensors)


def reseal(path, header=None, entries=None):
    """Rewrite a file's header fields / table entries and recompute the checksum, so a test
    reaches the check behind the checksum."""
    raw = bytearray(path.read_bytes())
    fields = list(fm._HEADER.unpack_from(raw))
    names = ["magic"] + [f.name for f in fm.dataclasses.fields(fm.Header)]
    h = dict(zip(names, fields))
    table = bytes(raw[h["table_offset"]:h["table_offset"] + h["table_size"]])
    ents = list(fm._decode_table("t", table, h["tensor_count"]).values())
    if entries:
        ents = entries(ents)
    table = fm._encode_table(ents)
    h.update(tensor_count=len(ents), table_size=len(table),
             file_size=h["table_offset"] + len(table))
    h.update(header or {})
    vals = [h[n] for n in names[:-1]]
    hdr = fm._HEADER.pack(*vals, 0).ljust(fm.HEADER_SIZE, b"\0")
    crc = zlib.crc32(table, zlib.crc32(hdr))
    hdr = fm._HEADER.pack(*vals, crc).ljust(fm.HEADER_SIZE, b"\0")
    path.write_bytes(hdr + bytes(raw[fm.HEADER_SIZE:h["table_offset"]]) + table)


def test_round_trip(written):
    path, cfg, tensors = written
    nf = open_nanoqwen(path, verify=True)
    assert nf.config == cfg
    assert nf.header.source_revision == "a" * 40 and nf.header.version == 1
    assert nf.header.group_size == 128 and nf.header.hidden_size == cfg.hidden_size
    for name, arr in tensors.items():
        got = nf.array(name)
        assert got.dtype == arr.dtype and np.array_equal(got, arr), name
        assert nf.entry(name).offset % 128 == 0
    assert nf.meta("tokenizer.json") == b'{"x": 1}'
    assert nf.meta("meta/tokenizer.json") == b'{"x": 1}'
    assert set(nf.names()) == set(tensors) | {"meta/nq_config.json", "meta/tokenizer.json"}
    assert nf.verify() == sum(nf.entry(n).nbytes for n in nf.names())
    text = nf.describe()
    assert "layers.0.down_proj.qweight" in text and "a" * 40 in text and "hidden 256" in text


def test_arrays_are_zero_copy_views_of_the_mapping(written):
    nf = NanoqwenFile(written[0])
    whole = np.frombuffer(nf._mm, np.uint8)
    arr = nf.array("layers.0.gate_proj.qweight")
    assert np.shares_memory(arr, whole) and not arr.flags.owndata and not arr.flags.writeable


def test_tied_lm_head_aliases_embedding(tmp_path):
    cfg = tiny_config(num_layers=1, tie=True)
    tensors = random_tensors(cfg)
    assert "lm_head" not in dict(tensors)
    nf = NanoqwenFile(write_nanoqwen(tmp_path / "t.nanoqwen", cfg, tensors))
    assert "lm_head" not in nf.names() and nf.header.flags & fm.FLAG_TIED
    assert np.shares_memory(nf.array("lm_head"), nf.array("embed_tokens"))


def test_refuses_wrong_magic(written):
    path = written[0]
    raw = bytearray(path.read_bytes())
    raw[:8] = b"GGUF\0\0\0\0"
    path.write_bytes(raw)
    with pytest.raises(FormatError, match=r"m\.nanoqwen: not a \.nanoqwen file.*nq pack"):
        NanoqwenFile(path)


@pytest.mark.parametrize("field,value,message", [
    ("version", 2, "format version 2, this nq reads version 1"),
    ("layout", 2, "weight layout id 2.*ValueShuffle"),
    ("group_size", 64, "INT4 group size 64"),
    ("hidden_size", 512, "header hidden_size=512 contradicts the stored config"),
    ("flags", 1, "tied-embedding flag contradicts"),
])
def test_refuses_header_fields(written, field, value, message):
    reseal(written[0], header={field: value})
    with pytest.raises(FormatError, match=message + ".*re-pack"):
        NanoqwenFile(written[0])


def test_refuses_truncated_files(written):
    path = written[0]
    raw = path.read_bytes()
    path.write_bytes(raw[:-100])
    with pytest.raises(FormatError, match="truncated or extended file"):
        NanoqwenFile(path)
    path.write_bytes(raw[:100])
    with pytest.raises(FormatError, match="truncated file .100 bytes"):
        NanoqwenFile(path)
    with pytest.raises(FormatError, match="no such file"):
        NanoqwenFile(path.with_name("absent.nanoqwen"))


def test_refuses_entry_outside_the_file(written):
    def move(ents):
        return [fm.Entry(e.name, e.dtype, e.shape, 1 << 40, e.nbytes, e.crc32)
                if e.name == "norm" else e for e in ents]
    reseal(written[0], entries=move)
    with pytest.raises(FormatError, match="tensor norm spans bytes.*outside the payload area"):
        NanoqwenFile(written[0])


def test_refuses_checksum_mismatch(written):
    path = written[0]
    raw = bytearray(path.read_bytes())
    raw[200] ^= 1                                      # a reserved header byte
    path.write_bytes(raw)
    with pytest.raises(FormatError, match="header/table checksum mismatch.*corrupt"):
        NanoqwenFile(path)


def test_refuses_payload_corruption_on_verify(written):
    path = written[0]
    nf = NanoqwenFile(path)
    at = nf.entry("layers.0.up_proj.scales").offset + 3
    nf.close()
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x40
    path.write_bytes(raw)
    nf = NanoqwenFile(path)                            # opening does not read payloads
    with pytest.raises(FormatError, match="payload checksum mismatch in tensor layers.0.up_proj.scales"):
        nf.verify()
    with pytest.raises(FormatError, match="payload checksum mismatch"):
        open_nanoqwen(path, verify=True)


def test_refuses_missing_and_misshapen_tensors(written, tmp_path):
    reseal(written[0], entries=lambda ents: [e for e in ents if e.name != "layers.0.k_proj.bias"])
    with pytest.raises(FormatError, match="missing 1 required tensors.*layers.0.k_proj.bias"):
        NanoqwenFile(written[0])
    cfg = tiny_config(num_layers=1)
    tensors = dict(random_tensors(cfg))
    tensors["norm"] = np.zeros(8, np.float16)
    bad = write_nanoqwen(tmp_path / "bad.nanoqwen", cfg, tensors.items(), check=False)
    with pytest.raises(FormatError, match=r"tensor norm is float16 \(8,\), the config needs float16 \(256,\)"):
        NanoqwenFile(bad)


def test_writer_refusals_leave_no_file(tmp_path):
    cfg = tiny_config(num_layers=1)
    tensors = random_tensors(cfg)
    out = tmp_path / "w.nanoqwen"

    def failing():
        yield from tensors[:5]
        raise RuntimeError("source went away")
    with pytest.raises(RuntimeError, match="source went away"):
        write_nanoqwen(out, cfg, failing())
    with pytest.raises(FormatError, match="not given 1 required tensors"):
        write_nanoqwen(out, cfg, tensors[:-1])
    bad = [(n, a.astype(np.float32) if n == "norm" else a) for n, a in tensors]
    with pytest.raises(FormatError, match="tensor norm is float32"):
        write_nanoqwen(out, cfg, bad)
    assert os.listdir(tmp_path) == []


def test_the_file_reaches_the_disk_before_its_name(tmp_path, monkeypatch):
    # fsync of the finished temporary file, then the rename, then the folder (durable rename)
    import os

    from nq.loader import format as fmt
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def replace(a, b):
        events.append(("rename", os.path.basename(b)))
        real_replace(a, b)
    monkeypatch.setattr(fmt.os, "fsync", fsync)
    monkeypatch.setattr(fmt.os, "replace", replace)
    cfg = tiny_config(num_layers=1, tie=True)
    write_nanoqwen(tmp_path / "d.nanoqwen", cfg, random_tensors(cfg))
    names = events
    assert names[0][0] == "fsync" and names[0][1].startswith("d.nanoqwen.tmp-")
    assert names[1] == ("rename", "d.nanoqwen")
    assert names[2] == ("fsync", tmp_path.name)
