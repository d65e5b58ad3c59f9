"""The one way a kernel is specialised, named and compiled.

Every kernel family builds a plain Python kernel body from a factory whose arguments are the
kernel's baked-in constants (shape, tiling, eps, ...); numba freezes closure ints and floats
as compile-time constants, which is how one source serves every model size.  The factory
hands the body here:

    kernel = compile_kernel(body, sig, name, launch_bounds=(256,), fastmath=True)

`name` must encode every constant the factory baked in (it names the kernel in profiles,
launcher errors and, later, the on-disk kernel cache's key); `kernel_name` builds one from
readable parts.  Under the CUDA simulator the body is returned as a simulator kernel (no
signature, no options: the simulator takes none).  Factories stay cached with
functools.cache on their arguments, so a kernel compiles once per process.
"""
from __future__ import annotations

from numba import cuda  # a module global: the simulator swaps it for its fake module

from nq.ptx import SIMULATOR

OPTIONS = ("launch_bounds", "fastmath", "lineinfo")


def _part(v) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float):
        return f"{v:g}".replace("-", "m").replace("+", "").replace(".", "p")
    return str(v)


def kernel_name(family: str, **constants) -> str:
    """`family_key1v1_key2v2...`: a readable identifier that encodes every baked-in constant
    (floats as 1e-06 -> 1em06, booleans as 0/1), in the order given."""
    return "_".join([family] + [f"{k}{_part(v)}" for k, v in constants.items()])


def compile_kernel(body, sig: str, name: str, **options):
    """The compiled kernel (eagerly, for sig) named `name`; options: launch_bounds,
    fastmath, lineinfo (numba.cuda.jit's)."""
    bad = set(options) - set(OPTIONS)
    if bad:
        raise TypeError(f"compile_kernel: unknown options {sorted(bad)}; allowed {OPTIONS}")
    body.__name__ = body.__qualname__ = name
    if SIMULATOR:
        return cuda.jit(body)
    return cuda.jit(sig, **options)(body)
