"""nq/timeline.py: laps add up to the time since start, asides are not summed, and the process's
age (the first part of `nq generate --verbose`) is read from /proc."""
import subprocess
import sys
import time

import pytest

from nq.timeline import Timeline, process_age


def test_laps_cover_the_time_since_start_and_asides_are_apart():
    tl = Timeline()
    tl.start(before=0.25)
    t0 = time.perf_counter()
    time.sleep(0.02)
    tl.lap("a")
    time.sleep(0.01)
    tl.lap("b")
    tl.lap("a")                        # a repeated name adds to its part
    tl.aside("thread work", 5.0)
    wall = time.perf_counter() - t0
    names = [n for n, _ in tl.parts]
    assert names == ["process start (python, nq.cli import)", "a", "b"]
    assert abs(tl.total() - 0.25 - wall) < 0.005   # the laps are the wall time, nothing left out
    assert tl.until("a") == pytest.approx(0.25 + dict(tl.parts)["a"])
    assert tl.until("missing") is None
    text = "\n".join(tl.lines())
    assert "beside it: thread work:" in text and "sum of the parts:" in text
    assert f"{tl.total() * 1e3:10.1f} ms" in text  # 5 s beside it: not in the sum


def _env():
    import os
    from pathlib import Path
    root = str(Path(__file__).resolve().parent.parent)
    return dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_process_age_is_read_from_proc():
    age = process_age()
    assert age is not None and 0 < age < 24 * 3600
    # a fresh interpreter that sleeps 0.3 s first is at least that old (the clock tick is 10 ms)
    out = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.3); "
                          "from nq.timeline import process_age; print(process_age())"],
                         capture_output=True, text=True, check=True, env=_env())
    assert 0.28 <= float(out.stdout) < 5.0
