"""`nq pack` interrupted or out of disk leaves nothing behind: no .nanoqwen, no temporary file.

Ctrl-C, SIGTERM and SIGHUP reach the writer as KeyboardInterrupt (nq.errors), whose clean-up
removes `<out>.tmp-PID`; a write that fails (ENOSPC, EFBIG) removes it too and says which file
and what to do.  SIGKILL cannot be handled: the next pack (and `nq cache clear`) removes a
temporary file whose process is gone, and leaves one whose process still runs.

The signal tests run `nq pack` in a subprocess whose quantiser is slowed (0.2 s a projection)
so that the signal lands mid-write.
"""
import errno
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nq.cli import main
from nq.config import tiny_config
from nq.loader import format as fmt
from nq.loader.synth import make_hf_snapshot

REPO = Path(__file__).resolve().parents[2]
SLOW_PACK = ("import sys, time; from nq.loader import hf; q = hf.quantize_pack; "
             "hf.quantize_pack = lambda w: (time.sleep(0.2), q(w))[1]; "
             "from nq.cli import main; raise SystemExit(main(sys.argv[1:]))")


@pytest.fixture(scope="module")
def snap(tmp_path_factory):
    return make_hf_snapshot(tmp_path_factory.mktemp("hf") / "snap", tiny_config(num_layers=1))


def _default_sigint():
    # a background job's children start with SIGINT ignored; nq must see it as a terminal would
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_pack(snap, out, preexec=_default_sigint):
    return subprocess.Popen([sys.executable, "-c", SLOW_PACK, "pack", str(snap), str(out)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=preexec)


def _wait_for_tmp(folder: Path, proc, timeout=60.0) -> Path:
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        tmp = list(folder.glob("*.tmp-*"))
        if tmp and tmp[0].stat().st_size > 0:
            return tmp[0]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError("the pack never started writing")


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143),
                                         (signal.SIGHUP, 129)])
def test_a_signal_mid_pack_leaves_nothing(snap, tmp_path, sig, status):
    out = tmp_path / "out" / "m.nanoqwen"
    proc = _start_pack(snap, out)
    _wait_for_tmp(out.parent, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == status, err
    assert "Traceback" not in err and ("interrupted" if sig == signal.SIGINT
                                       else signal.Signals(sig).name) in err
    assert list(out.parent.iterdir()) == []


def test_sigkill_leftover_is_removed_by_the_next_pack(snap, tmp_path):
    out = tmp_path / "m.nanoqwen"
    proc = _start_pack(snap, out)
    left = _wait_for_tmp(tmp_path, proc)
    proc.kill()
    proc.communicate(timeout=60)
    assert left.exists()                                    # SIGKILL: nothing could run
    live = tmp_path / f"m.nanoqwen.tmp-{os.getppid()}"     # a pack that is still running
    live.write_bytes(b"x")
    assert main(["pack", str(snap), str(out)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["m.nanoqwen", live.name])
    fmt.NanoqwenFile(out, verify=True)


def test_cache_clear_removes_unfinished_packs(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NQ_CACHE", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()
    (tmp_path / f"Org--M--abc.nanoqwen.tmp-{gone.pid}").write_bytes(b"\0" * 1000)
    live = tmp_path / f"Org--M--abc.nanoqwen.tmp-{os.getpid()}"
    live.write_bytes(b"x")
    assert main(["cache", "clear"]) == 0
    assert "removed 1 unfinished packs" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == [live]


def test_file_size_limit_mid_pack(snap, tmp_path):
    """RLIMIT_FSIZE makes the write fail with EFBIG half-way, as a full disk fails with ENOSPC."""
    def limit():
        _default_sigint()
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
    out = tmp_path / "m.nanoqwen"
    r = subprocess.run([sys.executable, "-m", "nq", "pack", str(snap), str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=120, preexec_fn=limit)
    assert r.returncode == 2, r.stderr
    assert f"nq: error: {out}: file too large for the file system or for this shell's file " \
           "size limit (`ulimit -f`)" in r.stderr
    assert "Traceback" not in r.stderr and list(tmp_path.iterdir()) == []


def test_no_space_mid_pack(snap, tmp_path, monkeypatch, capsys):
    """ENOSPC from a write half-way (the free-space check passed: another writer filled the
    disk meanwhile) removes the temporary file and names the output."""
    real_open = open

    class Full:
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, b):
            self.written += len(b)
            if self.written > 100_000:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(fmt, "open", lambda p, mode: Full(real_open(p, mode)), raising=False)
    out = tmp_path / "m.nanoqwen"
    assert main(["pack", str(snap), str(out)]) == 2
    assert f"nq: error: {out}: no space left on the device; free some space or write " \
           "elsewhere" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_real_full_file_system(snap, tmp_path, capsys):
    """A 256 KB tmpfs (where mounting one is allowed: root with CAP_SYS_ADMIN)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        out = mnt / "m.nanoqwen"
        # the free-space check refuses it up front ...
        assert main(["pack", str(snap), str(out)]) == 2
        assert "the packed model needs 0.8 MiB" in capsys.readouterr().err
        # ... and with the check fooled, the write itself fails and cleans up
        (mnt / "filler").write_bytes(b"")
        real = shutil.disk_usage
        shutil.disk_usage = lambda p: real(p)._replace(free=2**40)
        try:
            r = main(["pack", str(snap), str(out)])
        finally:
            shutil.disk_usage = real
        assert r == 2 and sorted(p.name for p in mnt.iterdir()) == ["filler"]
        assert f"{out}: no space left on the device" in capsys.readouterr().err
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
