"""Fuzzed reading of .nanoqwen files: truncations and byte flips anywhere in a valid file.

The reader must answer every damaged file with a FormatError (a message naming the file and
the fix) or, where a flip lands in a payload, open it and let `verify()` catch it, never
another exception and never a read outside the file.  Seeded, so a failure reproduces.
"""
import numpy as np
import pytest

from nq.loader.format import HEADER_SIZE, FormatError, NanoqwenFile

CASES = 120


def _check(path):
    """Open, describe, read every tensor, verify: only FormatError may escape."""
    try:
        nf = NanoqwenFile(path)
    except FormatError as e:
        assert str(path) in str(e)
        return "refused"
    text = nf.describe()
    assert "layers.0.q_proj.qweight" in text
    for name in nf.names():
        a = nf.array(name)
        int(np.asarray(a).reshape(-1)[:1].size)  # touch it: must be inside the mapping
    try:
        nf.verify()
    except FormatError:
        return "verify"
    return "opened"


@pytest.fixture(scope="module")
def good(tiny_nanoqwen):
    return tiny_nanoqwen.read_bytes()


def test_truncations_are_refused(good, tmp_path):
    rng = np.random.default_rng(0)
    cuts = sorted(set(rng.integers(0, len(good) - 1, CASES).tolist()) | {0, 7, HEADER_SIZE - 1,
                                                                         HEADER_SIZE})
    for cut in cuts:
        p = tmp_path / f"cut{cut}.nanoqwen"
        p.write_bytes(good[:cut])
        assert _check(p) == "refused", cut


@pytest.mark.parametrize("region", ["header", "table", "payload"])
def test_byte_flips_are_caught(good, tmp_path, region):
    ok = NanoqwenFile(_write(tmp_path / "ok.nanoqwen", good))  # where the table lies
    table_start = ok.header.table_offset
    lo, hi = {"header": (0, HEADER_SIZE), "table": (table_start, len(good)),
              "payload": (HEADER_SIZE, table_start)}[region]
    rng = np.random.default_rng({"header": 1, "table": 2, "payload": 3}[region])
    outcomes = {}
    for i in range(CASES):
        at = int(rng.integers(lo, hi))
        data = bytearray(good)
        data[at] ^= 1 << int(rng.integers(0, 8))
        p = _write(tmp_path / f"{region}{i}.nanoqwen", bytes(data))
        outcome = _check(p)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if region in ("header", "table"):
            assert outcome == "refused", (region, at)  # the header+table CRC covers them
    if region == "payload":  # flips in payload bytes: verify() finds them (padding: harmless)
        assert outcomes.get("refused", 0) == 0 and outcomes.get("verify", 0) > CASES // 2


def _write(path, data):
    path.write_bytes(data)
    return path
