"""What a start is made of (`nq generate --verbose`): named parts that add up to the wall time.

Every part is a lap: the time since the previous lap, so nothing between two timing points is
left unnamed and the parts sum to the time since `start()` by construction.  `start()` opens
with the time the process had already spent before it (the interpreter, site and `nq.cli`'s
imports), read from /proc, so the total is the wall time since the command was started (to
10 ms, the kernel's clock tick), not since `main()`.  Work that runs beside the main thread
(the weight upload's thread) is booked with `aside`: shown, but not summed, since the main
thread's laps already hold the wall time it took.

    TIMELINE.start()                 # cli, first thing
    TIMELINE.lap("file open")        # the seconds since the previous lap, named
    TIMELINE.aside("weights upload (thread)", 0.31)

Only the main thread calls `lap`; other threads call `aside`.
"""
from __future__ import annotations

import os
import threading
import time


def process_age() -> float | None:
    """Seconds since this process was started (Linux /proc, 10 ms resolution); None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(after_name[19])     # field 22, starttime, in clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class Timeline:
    def __init__(self):
        self._lock = threading.Lock()
        self.start(before=None)

    def start(self, before: float | None | str = "process") -> None:
        """Begin a new timeline now; its first part is the process's age (`before="process"`),
        or the seconds given, named "process start (python, nq.cli import)"."""
        if before == "process":
            before = process_age()
        with self._lock:
            self.parts: list[tuple[str, float]] = []
            self.side: list[tuple[str, float]] = []
            self.last = time.perf_counter()
            if before is not None:
                self.parts.append(("process start (python, nq.cli import)", float(before)))

    def lap(self, name: str) -> float:
        """Book the time since the previous lap as `name` (a repeated name adds up); returns it."""
        now = time.perf_counter()
        with self._lock:
            sec = now - self.last
            self.last = now
            for i, (n, s) in enumerate(self.parts):
                if n == name:
                    self.parts[i] = (n, s + sec)
                    break
            else:
                self.parts.append((name, sec))
        return sec

    def aside(self, name: str, seconds: float) -> None:
        """Book work done beside the main thread (not summed into the total)."""
        with self._lock:
            self.side.append((name, float(seconds)))

    def total(self) -> float:
        """The sum of the parts: the seconds from the process's start to the last lap."""
        return sum(s for _, s in self.parts)

    def until(self, name: str) -> float | None:
        """The seconds from the start to the end of part `name` (None if there is none)."""
        t = 0.0
        for n, s in self.parts:
            t += s
            if n == name:
                return t
        return None

    def lines(self) -> list[str]:
        out = [f"{name + ':':44s}{sec * 1e3:10.1f} ms" for name, sec in self.parts]
        out += [f"{'  beside it: ' + name + ':':44s}{sec * 1e3:10.1f} ms"
                for name, sec in self.side]
        out.append(f"{'sum of the parts:':44s}{self.total() * 1e3:10.1f} ms")
        return out


TIMELINE = Timeline()
