"""Writing an output file safely: the path checked before the work, and stale temporaries.

`check_output` refuses a path that cannot take the file (a directory, an unwritable folder)
before minutes of packing are spent on it.  nq writes every file it must not leave
half-written (a `.nanoqwen`, a kernel-cache entry) to a temporary name ending in `-<pid>` and
renames it into place once complete; any error, Ctrl-C or SIGTERM removes it.  Only SIGKILL,
a crash of the interpreter or a power cut can leave one behind, so the next pack and
`nq cache clear` remove the temporary files whose writer is gone, and never one a live
process (another pack running beside this one) is still writing.
"""
from __future__ import annotations

import os
import re
from pathlib import Path


class OutputPathError(ValueError):
    """An output path nq cannot write; the message says which and what to do."""


def check_output(path) -> Path:
    """Refuse an output path that cannot receive a .nanoqwen, before any work is done: a
    directory, something other than a regular file, a folder that cannot be created or
    written.  (Running as root, permissions are only found out when writing.)"""
    path = Path(path)
    if path.is_dir():
        raise OutputPathError(f"{path}: is a directory; give the output file's path, e.g. "
                              f"{path / 'model.nanoqwen'}")
    if path.exists() and not path.is_file():
        raise OutputPathError(f"{path}: exists and is not a regular file; choose another "
                              "output path")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent                     # the nearest ancestor that exists
    if not folder.is_dir():
        raise OutputPathError(f"{folder}: is a file, so {path} cannot be created below it; "
                              "choose another output path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputPathError(f"{folder}: cannot create files here (permission denied); "
                              "choose another output path or fix the folder's permissions")
    return path


def fsync_folder(folder) -> None:
    """Make a rename in `folder` durable; a no-op where directories cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def writer_pid(path: Path) -> int | None:
    """The pid a temporary name ends with (`m.nanoqwen.tmp-123`, `.tmp-ab12-123`), else None."""
    m = re.search(r"-(\d+)$", Path(path).name)
    return int(m.group(1)) if m else None


def alive(pid: int) -> bool:
    """Whether process `pid` exists (signal 0 checks without sending anything)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:      # another user's process: it exists
        return True
    return True


def remove_stale(folder, pattern: str) -> list[tuple[Path, int]]:
    """Delete the files in `folder` matching `pattern` whose writer's pid is gone (or that
    carry no pid); returns (path, bytes) of each removed."""
    folder = Path(folder)
    removed = []
    if not folder.is_dir():
        return removed
    for p in folder.glob(pattern):
        pid = writer_pid(p)
        if pid is not None and (pid == os.getpid() or alive(pid)):
            continue
        try:
            size = p.stat().st_size
            p.unlink()
        except FileNotFoundError:    # its writer finished or another cleaner got there first
            continue
        removed.append((p, size))
    return removed
