"""The `nq` command facing bad input and interruptions: every failure is one line saying which
file, what is wrong and what to do (never a traceback, never `[Errno 21]`), checked before
the work it would spoil; Ctrl-C ends a run with what it has and exit status 130.
"""
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nq import cli
from nq.cli import main
from nq.errors import os_error_words

REPO = Path(__file__).resolve().parents[1]


def _default_sigint():
    # a background job's children start with SIGINT ignored; nq must see it as a terminal would
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_nq(*argv, **kw):
    return subprocess.run([sys.executable, "-m", "nq", *argv], cwd=REPO, capture_output=True,
                          timeout=120, **kw)


# ---- OS errors in words --------------------------------------------------------------------
@pytest.mark.parametrize("err, words", [
    (OSError(errno.EACCES, "Permission denied", "/x/m.nanoqwen"),
     "/x/m.nanoqwen: permission denied; check the permissions of the file and its folder"),
    (OSError(errno.EISDIR, "Is a directory", "/x"), "/x: is a directory; give a file's path"),
    (OSError(errno.ENOSPC, "No space left on device"),
     "No space left on the device; free some space or write elsewhere"),
    (OSError(errno.EROFS, "Read-only file system", "/ro/m"), "/ro/m: read-only file system"),
    (FileExistsError("m exists; pass --force"), "m exists; pass --force"),   # nq's own words
    (OSError(errno.ECONNRESET, "Connection reset by peer"), "[Errno 104] Connection reset by peer"),
])
def test_os_errors_in_words(err, words):
    assert os_error_words(err).startswith(words)


def test_info_on_a_directory(tmp_path, capsys):
    assert main(["info", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"nq: error: {tmp_path}: is a directory, not a .nanoqwen file" in err
    assert "Errno" not in err


def test_pack_force_onto_a_directory_is_refused_before_packing(tmp_path, monkeypatch, capsys):
    from nq.loader import hf
    monkeypatch.setattr(hf, "resolve_snapshot", lambda *a, **k: pytest.fail("started packing"))
    monkeypatch.setattr(hf, "pack", lambda *a, **k: pytest.fail("started packing"))
    (tmp_path / "out").mkdir()
    assert main(["pack", "Qwen/Qwen2.5-0.5B-Instruct", str(tmp_path / "out"), "--force"]) == 2
    assert f"{tmp_path / 'out'}: is a directory; give the output file's path, e.g. " \
           f"{tmp_path / 'out' / 'model.nanoqwen'}" in capsys.readouterr().err


def test_permission_denied(tiny_nanoqwen, tmp_path, monkeypatch, capsys):
    """Unreadable model and prompt files.  Root reads through any mode bits, so as root the
    open itself is made to fail as it would for a user."""
    model, prompt = tmp_path / "m.nanoqwen", tmp_path / "prompt.txt"
    model.write_bytes(tiny_nanoqwen.read_bytes())
    prompt.write_text("hi")
    model.chmod(0)
    prompt.chmod(0)
    if os.geteuid() == 0:
        real_open = open

        def deny(path, *a, **k):
            if Path(path) in (model, prompt):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return real_open(path, *a, **k)
        monkeypatch.setattr("builtins.open", deny)
        monkeypatch.setattr(Path, "read_bytes", lambda p: deny(p) and b"")
    assert main(["info", str(model)]) == 2
    assert f"{model}: permission denied; check the permissions" in capsys.readouterr().err
    monkeypatch.setattr(cli, "make_backend", lambda *a: pytest.fail("loaded the model"))
    assert main(["generate", "--backend", "numpy", "-m", str(tiny_nanoqwen), "-f",
                 str(prompt)]) == 2
    assert f"{prompt}: permission denied; check the permissions" in capsys.readouterr().err


@pytest.mark.parametrize("make, words", [
    (lambda p: p.write_bytes(b"caf\xe9 au lait"),
     "prompt.txt: not UTF-8 text (byte 0xe9 at offset 3); convert it, e.g. `iconv"),
    (lambda p: p.mkdir(), "prompt.txt: is a directory; give a file's path"),
    (lambda p: None, "prompt.txt: no such file or directory; check the path"),
])
def test_prompt_file_errors(tiny_nanoqwen, tmp_path, monkeypatch, capsys, make, words):
    monkeypatch.setattr(cli, "make_backend", lambda *a: pytest.fail("loaded the model"))
    make(tmp_path / "prompt.txt")
    assert main(["generate", "--backend", "numpy", "-m", str(tiny_nanoqwen), "-f",
                 str(tmp_path / "prompt.txt")]) == 2
    err = capsys.readouterr().err
    assert words in err and "Errno" not in err


def test_stdin_that_is_not_utf8(tiny_nanoqwen):
    r = run_nq("generate", "--backend", "numpy", "-m", str(tiny_nanoqwen), "-f", "-",
               input=b"\xff\xfe h\x00i\x00")
    assert r.returncode == 2
    assert b"nq: error: stdin: not UTF-8 text (byte 0xff at offset 0)" in r.stderr


def test_prompt_over_the_context_is_refused_before_any_model_work(tiny_nanoqwen, monkeypatch,
                                                                  capsys):
    monkeypatch.setattr(cli, "make_backend", lambda *a: pytest.fail("loaded the model"))
    from nq.loader.format import NanoqwenFile
    from nq.text import Tokenizer
    text = "def fibonacci(n): return n " * 40
    n_ids = len(Tokenizer.from_nanoqwen(NanoqwenFile(tiny_nanoqwen)).encode(text))
    assert main(["generate", "--backend", "numpy", "-m", str(tiny_nanoqwen), "-p", text,
                 "-c", "64"]) == 2
    err = capsys.readouterr().err
    assert "tokens, the context -c is 64: no room to generate; shorten the prompt or raise -c" \
           in err
    assert f"the prompt is {n_ids} tokens" in err and "trained on 32768" in err


# ---- Ctrl-C ---------------------------------------------------------------------------------
def _generate(model, *extra):
    return subprocess.Popen([sys.executable, "-m", "nq", "generate", "--backend", "numpy", "-m",
                             str(model), "-p", "def f(x):", "-n", "3000", "--temp", "0",
                             "--ignore-eos", *extra], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=_default_sigint)


def test_ctrl_c_during_generate_prints_the_stats_and_exits_130(tiny_nanoqwen):
    proc = _generate(tiny_nanoqwen)
    shown = b""
    while len(shown) < 20:                     # tokens are streaming
        chunk = os.read(proc.stdout.fileno(), 64)
        assert chunk, proc.communicate()
        shown += chunk
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    err = err.decode()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert "prompt tokens" in err and "(ended by an interrupt); TTFT" in err
    generated = int(err.split("prompt tokens, ")[1].split(" generated")[0])
    assert 0 < generated < 3000


def _wait_for_numpy(proc, timeout=30.0):
    """Until the child maps numpy's core: the interpreter is up and nq's imports have begun
    (a signal before that meets Python's own start-up, which nq cannot handle)."""
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        try:
            if "_multiarray_umath" in Path(f"/proc/{proc.pid}/maps").read_text():
                return
        except OSError:
            pass
        time.sleep(0.002)
    raise AssertionError("the child never imported numpy")


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.15, 0.3, 0.6])
def test_ctrl_c_during_start_up_has_no_traceback(tiny_nanoqwen, delay):
    """Wherever the interrupt lands (imports, argument parsing, the file, the weights, the
    first tokens), the run ends quietly with 130."""
    if not Path("/proc/self/maps").exists():
        pytest.skip("needs /proc to see the child's imports")
    proc = _generate(tiny_nanoqwen, "--json")
    _wait_for_numpy(proc)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    err = err.decode()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    # before generation: "nq: interrupted"; during it: the JSON object, stop_reason included
    assert "nq: interrupted" in err or json.loads(out)["stats"]["stop_reason"] == "interrupted"


def test_a_signal_inside_signals_deferred_is_raised_as_the_block_ends():
    # a SIGTERM that lands inside the block (a tqdm bar's __init__ in `nq pack`) waits for
    # it to finish, then ends the run as it would have: Terminated from the handler in force
    import os
    import signal

    from nq.errors import Terminated, signals_as_interrupts, signals_deferred
    done = []
    with signals_as_interrupts():
        with pytest.raises(Terminated) as e:
            with signals_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(1000):   # bytecodes where the handler would otherwise run
                    pass
                done.append(True)
        assert e.value.signum == signal.SIGTERM and done == [True]
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL   # handlers restored
        with signals_deferred():        # nothing noted: nothing raised
            pass
