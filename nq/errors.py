"""What the `nq` command says when something outside nq fails: an OSError in words, and
SIGTERM/SIGHUP turned into an interrupt so that the clean-up Ctrl-C runs also runs for them.

Without the second, `kill PID` (or a closed terminal) ends a pack where it stands and leaves
its `<out>.tmp-PID` behind; with it, the writer's `except BaseException` removes the file.
"""
from __future__ import annotations

import contextlib
import errno
import signal
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


def _raise_terminated(signum, frame):
    raise Terminated(signum)


@contextlib.contextmanager
def signals_as_interrupts(signals=(signal.SIGTERM, signal.SIGHUP)):
    """Inside: these signals raise Terminated; the previous handlers come back on exit (a test
    calling nq.cli.main leaves pytest's own handling as it was).  Only the main thread may set
    handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _raise_terminated) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
