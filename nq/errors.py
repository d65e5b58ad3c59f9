"""What the `nq` command says when something outside nq fails: an OSError in words, and
signals turned into interrupts that end a run cleanly wherever they land.

SIGTERM/SIGHUP raise as Ctrl-C does, so the same clean-up runs: without it `kill PID` (or a
closed terminal) ends a pack where it stands and leaves its `<out>.tmp-PID` behind.  And no
signal is raised inside an import (see `_interrupt`).
"""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import threading

# errno -> what it means for the file named, and what to do (instead of "[Errno 28] ...")
_OS_ERRORS = {
    errno.EACCES: "permission denied; check the permissions of the file and its folder, or "
                  "use another path",
    errno.EISDIR: "is a directory; give a file's path",
    errno.ENOTDIR: "a part of this path is a file, not a folder; check the path",
    errno.ENOENT: "no such file or directory; check the path",
    errno.ENOSPC: "no space left on the device; free some space or write elsewhere",
    errno.EDQUOT: "disk quota exceeded; free some space or write elsewhere",
    errno.EFBIG: "file too large for the file system or for this shell's file size limit "
                 "(`ulimit -f`); raise the limit or write elsewhere",
    errno.EROFS: "read-only file system; write elsewhere",
    errno.ENAMETOOLONG: "file name too long; use a shorter path",
    errno.EMFILE: "too many open files; raise the limit (`ulimit -n`)",
    errno.EIO: "input/output error: the disk or network file system failed; check it (dmesg)",
}
_OS_ERRORS[errno.EPERM] = _OS_ERRORS[errno.EACCES]


def os_error_words(e: OSError) -> str:
    """An OSError as `FILE: what is wrong; what to do` (its str() if nq has no words for it)."""
    what = _OS_ERRORS.get(e.errno)
    if what is None:
        return str(e)
    return f"{e.filename}: {what}" if e.filename is not None else what[0].upper() + what[1:]


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where Ctrl-C raises KeyboardInterrupt."""

    def __init__(self, signum: int):
        super().__init__()
        self.signum = signum


_active = 0                      # how many signals_as_interrupts blocks are open


def _in_import(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _interrupt(signum, frame):
    """KeyboardInterrupt for SIGINT, Terminated for the others; but inside an import, the same
    signal again 20 ms later: an exception raised in Python's import machinery becomes an
    ImportError (numpy: "PyCapsule_Import could not import module") or is dropped ("Exception
    ignored in ... _get_module_lock"), so a Ctrl-C in the first second would print a traceback,
    or be lost."""
    if _in_import(frame):
        threading.Timer(0.02, _again, (signum,)).start()
        return
    raise KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def _again(signum):
    if _active:                  # not once the command has ended and its handlers are gone
        os.kill(os.getpid(), signum)


@contextlib.contextmanager
def signals_as_interrupts(signals=(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)):
    """Inside: these signals raise KeyboardInterrupt/Terminated (see _interrupt); the previous
    handlers come back on exit (a test calling nq.cli.main leaves pytest's as it was).  A
    SIGINT that is ignored (a background job) stays ignored.  Only the main thread may set
    handlers; elsewhere this does nothing."""
    global _active
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in signals}
    for s in signals:
        if previous[s] != signal.SIG_IGN or s != signal.SIGINT:
            signal.signal(s, _interrupt)
    _active += 1
    try:
        yield
    finally:
        _active -= 1
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def signals_deferred(signals=(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)):
    """Inside: these signals are only noted, and the first is handled as the block ends (by
    the handler it would have met), so a constructor it would interrupt halfway finishes
    first.  A tqdm bar cut off inside its __init__ is garbage-collected with no `pos`, and its
    __del__ then prints a traceback ("Exception ignored in ... tqdm.__del__") after nq's own
    "SIGTERM" line.  Handlers, not the thread's signal mask: any thread may be the one the OS
    delivers to, and Python runs the handler in the main thread either way.  Off the main
    thread this does nothing (only it may set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted = []
    previous = {s: signal.getsignal(s) for s in signals}
    for s in signals:
        if previous[s] is not signal.SIG_IGN:
            signal.signal(s, lambda signum, frame: noted.append(signum))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if noted:
            handler = previous[noted[0]]
            if callable(handler):
                handler(noted[0], None)               # _interrupt: raises as it would have
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), noted[0])        # the default action, now


def interrupted(e: KeyboardInterrupt) -> int:
    """Say how the run ended (stderr) and return its exit status, 128 + the signal."""
    signum = getattr(e, "signum", signal.SIGINT)
    name = "interrupted" if signum == signal.SIGINT else signal.Signals(signum).name
    print(f"\nnq: {name}", file=sys.stderr)
    return 128 + signum
