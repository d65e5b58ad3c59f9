"""Compile-check helpers for tests: sm_90 PTX without a GPU, instruction and local-memory checks.

    ptx = compile_ptx_sm90(kernel_pyfunc, "void(uint32[::1], float32[::1])")
    assert_uses(ptx, "ld.global.nc.v4.u32", "fma.rn.f16x2")
    assert_no_local_memory(ptx)
    regs, spill_bytes = ptxas_report(ptx)     # needs nvJitLink (pip) or a ptxas

`compile_ptx_sm90` works on a machine with no GPU even when the kernel calls
`@cuda.jit(device=True)` functions: numba-cuda's dispatcher asks the current device for its
compute capability there, so the call is made with that lookup stubbed to a cc (9, 0) device.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

SM90 = (9, 0)
SM90A = (9, 0, "a")


def compile_ptx_sm90(pyfunc, sig, cc=SM90, **kw) -> str:
    """PTX of pyfunc (a plain Python function, or a @cuda.jit dispatcher) for sm_90 (cc=SM90A:
    sm_90a, which wgmma needs).

    kw goes to numba.cuda.compile_ptx (device=, fastmath=, lineinfo=, ...).
    """
    from numba import cuda
    import numba.cuda.dispatcher as dispatcher

    pyfunc = getattr(pyfunc, "py_func", pyfunc)
    fake = SimpleNamespace(compute_capability=SM90, id=0, name=b"offline sm_90 stub")
    with mock.patch.object(dispatcher, "get_current_device", lambda: fake):
        ptx, _ = cuda.compile_ptx(pyfunc, sig, cc=cc, **kw)
    return ptx


def compiled_name(factory, *args) -> str:
    """The name a cached kernel factory (`rope_kv_kernel`, `split_kernel`, ...) gives its
    kernel through nq.kernels.build.compile_kernel, without compiling and without caching."""
    from nq.kernels import build

    class Name(str):   # stands in for the lazy dispatcher compile_kernel builds
        def compile(self, sig):
            pass

        def disable_compile(self):
            pass

    fake = SimpleNamespace(jit=lambda sig=None, **kw: (lambda body: Name(body.__name__)))
    with mock.patch.object(build, "cuda", fake), mock.patch.object(build, "SIMULATOR", False), \
            mock.patch.object(build, "cache_enabled", lambda: False):
        got = factory.__wrapped__(*args)
    return tuple(str(g) for g in got) if isinstance(got, tuple) else str(got)


def _body(ptx: str) -> str:
    """PTX without comments (asm markers, the NVVM banner), so matches are real instructions."""
    return re.sub(r"//[^\n]*", "", ptx)


def assert_no_local_memory(ptx: str) -> None:
    """No ld.local/st.local and no local depot: nothing spilled or demoted to a stack array."""
    body = _body(ptx)
    bad = [m for m in ("ld.local", "st.local", "__local_depot") if m in body]
    assert not bad, f"local memory traffic in the PTX: {bad}"


def assert_uses(ptx: str, *instructions: str) -> None:
    """Each instruction (a prefix such as "ld.global.nc.v4.u32") appears in the PTX body."""
    body = _body(ptx)
    missing = [i for i in instructions
               if not re.search(r"(^|[\s;{])" + re.escape(i) + r"(?=[\s.;])", body, re.M)]
    assert not missing, f"instructions not found in the PTX: {missing}"


def count(ptx: str, instruction: str) -> int:
    """How many times an instruction (prefix) occurs in the PTX body."""
    return len(re.findall(r"(^|[\s;{])" + re.escape(instruction) + r"(?=[\s.;])", _body(ptx), re.M))


_REGS = re.compile(r"[Uu]sed (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def have_ptxas() -> bool:
    """Whether ptxas_report can run here (cuda.core + nvJitLink, or a ptxas binary)."""
    try:
        import cuda.core  # noqa: F401
        return True
    except ImportError:
        return bool(shutil.which("ptxas")) or Path("/usr/local/cuda/bin/ptxas").exists()


def _arch(ptx: str) -> str:
    m = re.search(r"^\.target\s+(sm_\w+)", ptx, re.M)
    return m.group(1) if m else "sm_90"


def ptxas_log(ptx: str) -> str:
    """ptxas's verbose report for the PTX's .target (sm_90 or sm_90a): nvJitLink from pip first, else a ptxas on PATH.

    nvJitLink (cuda.core's Linker) must be at least as new as the NVVM that wrote the PTX; a
    ptxas older than the PTX `.version` is fed the PTX with its version line lowered to 9.0
    (the wrappers use nothing newer than PTX ISA 8.x).
    """
    try:
        from cuda.core import Linker, LinkerOptions, ObjectCode

        linker = Linker(ObjectCode.from_ptx(ptx.encode()),
                        options=LinkerOptions(arch=_arch(ptx), verbose=True))
        linker.link("cubin")
        return linker.get_info_log()
    except ImportError:
        pass
    ptxas = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"
    if not Path(ptxas).exists():
        raise RuntimeError("ptxas_report needs cuda.core + nvJitLink or a ptxas on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(re.sub(r"^\.version \d+\.\d+", ".version 9.0", ptx, count=1, flags=re.M))
        out = subprocess.run([ptxas, f"-arch={_arch(ptx)}", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"ptxas failed:\n{out.stderr}")
    return out.stderr + out.stdout


def ptxas_report(ptx: str) -> tuple[int, int]:
    """(registers, spill_bytes) of the PTX's kernels: the most registers any entry uses, and
    spill stores + spill loads summed over entries (0 is what a hot kernel must show)."""
    log = ptxas_log(ptx)
    regs = [int(r) for r in _REGS.findall(log)]
    spills = [int(s) + int(l) for s, l in _SPILL.findall(log)]
    if not regs:
        raise RuntimeError(f"no register count in the ptxas report:\n{log}")
    return max(regs), sum(spills)


def assert_one_block_an_sm(ptx: str, threads: int) -> int:
    """ptxas: no spill, and registers for a block of `threads` on one SM (65,536 of them); the
    registers used.  Skips the test where ptxas cannot run (the PTX checks before it stand)."""
    import pytest
    if not have_ptxas():
        pytest.skip("no nvJitLink or ptxas here: the PTX checks above stand")
    regs, spill = ptxas_report(ptx)
    assert spill == 0 and regs <= 65536 // threads, (regs, spill)
    return regs


def run_under_simulator(script: str, timeout: int) -> tuple[dict, str]:
    """Run `script` in a fresh Python under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1 must be
    set before numba is imported, hence the subprocess), from the repository root.  The script
    prints one `name value` line per case; returns ({name: float(value)}, stdout)."""
    import os
    import sys
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(root))
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=timeout, cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    values = dict((name, float(v)) for name, v in (line.split() for line in res.stdout.split("\n") if line))
    return values, res.stdout
