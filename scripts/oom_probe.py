"""Not enough GPU memory at load (issue #18), shown with `nq generate` on the 7B shape: a context
whose KV cache alone exceeds the GPU, and one whose KV cache fits the free memory but not beside
the 5.5 GB of weights, are both refused (exit 2) before anything is allocated, with the bytes needed, the
bytes free and the largest -c that fits.

    python3 scripts/oom_probe.py [MODEL]      # default /tmp/r7b-text.nanoqwen (written if missing)

The second context is computed from this GPU's free memory (measured in a child process, as the
`nq generate` that follows will see it: the same CUDA context overhead).  Exit status 0 when both
are refused with the message, within seconds and without a traceback.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FREE = """
from numba import cuda
from nq.config import PRESETS
from nq.runtime import memory as M
free, total = cuda.current_context().get_memory_info()
c = PRESETS["7b"]
print(free, total, (M.largest_context(c, free, 2048, True) + M.largest_context(c, free, 2048, False)) // 2)
"""


def main() -> int:
    model = sys.argv[1] if len(sys.argv) > 1 else "/tmp/r7b-text.nanoqwen"
    if not Path(model).exists():
        subprocess.run([sys.executable, str(ROOT / "scripts/make_random_nanoqwen.py"), "7b", model,
                        "--text-ids"], check=True)
    free, total, between = map(int, subprocess.run([sys.executable, "-c", FREE], cwd=ROOT,
                                                   capture_output=True, text=True,
                                                   check=True).stdout.split())
    print(f"GPU: {free} bytes free of {total}")
    ok = True
    for what, ctx in (("KV cache alone larger than the GPU", 3_000_000),
                      ("KV cache fits, not beside the weights", between)):
        cmd = [sys.executable, "-m", "nq", "generate", "-m", model, "-c", str(ctx), "-p", "hi",
               "-n", "4"]
        t = time.perf_counter()
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        dt = time.perf_counter() - t
        msg = [line for line in r.stderr.splitlines() if "GPU memory" in line]
        line = msg[0] if msg else ""
        good = (r.returncode == 2 and "Traceback" not in r.stderr and "bytes" in line
                and "free" in line and "use -c" in line)
        ok &= good
        print(f"\n{what}: nq generate -m {Path(model).name} -c {ctx} -p hi -n 4 -> exit "
              f"{r.returncode} in {dt:.1f} s: {'PASS' if good else 'FAIL'}")
        print("  " + (line or r.stderr[-2000:]))
    print(f"\nverdict refused before allocation with bytes needed and free: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
