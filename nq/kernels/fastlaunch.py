"""Launching a kernel again and again on the same arrays, at a fraction of numba's host cost.

Why.  Decode runs as a captured graph, but the prefill launches eagerly: 1 + 8 kernels a layer,
225 a chunk of the 7B.  Measured on the H200 (2026-12-01, scripts/ttft_probe.py), numba's
`kernel[grid, block, stream, smem](*args)` costs ~90 us of host time a launch here (the
launch configuration object, the dispatcher's checks, and turning every array into its
2 + 3 + 2*ndim kernel parameters again), so a 64-token prompt spent 21.6 of its 23 ms
enqueueing, and a 512-token one 21 of 24: the host, not the GPU, set the pace.

What.  `FastLaunch(kernel, *args)` keeps the arrays of a launch and turns them into kernel
parameters once, with numba's own `_prepare_args`, so the parameters are exactly those numba
would pass; a call `fl(grid, block, stream, smem, *scalars)` puts the integer arguments of this
launch (m, start, ...) in their slots and hands the list to cuda.core's `launch`, the call
numba's launch ends in.  Everything else numba does per launch is skipped: the kernel was
compiled for one signature, its arrays were checked by the launcher when it was built.

Under the simulator, with NQ_FAST_LAUNCH=0, or for a kernel whose arguments are not arrays and
integers, a call is the ordinary `kernel[grid, block, stream, smem](*args)`.
"""
from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

from nq.ptx import SIMULATOR

ENABLED = os.environ.get("NQ_FAST_LAUNCH", "1") != "0" and not SIMULATOR


@functools.lru_cache(maxsize=4096)
def _config(grid, block, smem, cluster=None):
    """cuda.core's launch configuration; with cluster, grid counts clusters, not blocks."""
    from cuda.core import LaunchConfig
    if cluster is None:
        return LaunchConfig(grid=grid, block=block, shmem_size=int(smem))
    return LaunchConfig(grid=grid, cluster=cluster, block=block, shmem_size=int(smem))


_LAST_STREAM: list = [None, None]   # (numba stream, its cuda.core stream): a prefill uses one


def _core_stream(stream):
    """numba's conversion of a launch's stream to cuda.core's, remembered for the last one."""
    if _LAST_STREAM[0] is not stream:
        from numba.cuda.cudadrv import driver
        _LAST_STREAM[:] = [stream, driver._to_core_stream(stream)]
    return _LAST_STREAM[1]


def _dims(d) -> tuple:
    return tuple(int(v) for v in d) if isinstance(d, (tuple, list)) else (int(d),)


class FastLaunch:
    """One kernel's launches over fixed arrays; the integer arguments vary per call.

    args: the kernel's arguments in order, with any integer argument given as a placeholder
    (its value comes with each call, in order)."""

    def __init__(self, kernel, *args):
        self.kernel, self.args = kernel, args   # the arrays stay alive as long as this object
        self._ready = None if ENABLED else False

    def _prepare(self) -> bool:
        """Build the parameter list once the kernel is compiled (it may still be compiling in a
        `build.parallel_compiles` block when the launcher is made)."""
        try:
            from numba.cuda import types as nbtypes
            kern = next(iter(self.kernel.overloads.values()))
            params, slots = [], []
            for t, v in zip(kern.argument_types, self.args, strict=True):
                if isinstance(t, nbtypes.Array):
                    kern._prepare_args(t, v, 0, [], params)
                elif isinstance(t, nbtypes.Integer):
                    slots.append((len(params), getattr(ctypes, f"c_{t}")))
                    params.append(None)
                else:
                    raise TypeError(f"argument type {t}")
            from cuda.core import launch
            self._ready = (kern._codelibrary.get_cufunc().kernel, params, slots, launch)
            return True
        except Exception:  # noqa: BLE001 -- an unexpected numba layout: the ordinary launch
            self._ready = False
            return False

    def __call__(self, grid, block, stream, smem, *ints, cluster=None) -> None:
        """Launch; cluster=(cx, cy, cz) launches thread block clusters of that shape, grid
        then counting clusters (cuda.core's convention)."""
        if self._ready is None:
            self._prepare()
        if self._ready is False:
            if cluster is not None:
                grid = tuple(g * c for g, c in zip((_dims(grid) + (1, 1))[:3],
                                                   (_dims(cluster) + (1, 1))[:3]))
                if not SIMULATOR or any(c != 1 for c in _dims(cluster)):
                    raise RuntimeError(
                        "a cluster launch needs cuda.core's launcher (NQ_FAST_LAUNCH=0 turns "
                        "it off: unset it), or the simulator with clusters of one CTA")
            self._plain(grid, block, stream, smem, ints)
            return
        kernel, params, slots, launch = self._ready
        if len(ints) != len(slots):
            raise TypeError(f"{len(slots)} integer arguments expected, got {len(ints)}")
        call = list(params)
        for (i, ctype), v in zip(slots, ints):
            call[i] = ctype(int(v))
        config = (_config(_dims(grid), _dims(block), smem) if cluster is None else
                  _config(_dims(grid), _dims(block), smem, _dims(cluster)))
        launch(_core_stream(stream), config, kernel, *call)

    def _plain(self, grid, block, stream, smem, ints) -> None:
        it = iter(ints)
        args = [next(it) if _is_int(a) else a for a in self.args]
        self.kernel[grid, block, stream, smem](*args)


def _is_int(a) -> bool:
    return isinstance(a, (int, np.integer))


def allow_large_cluster(kernel) -> None:
    """Opt a loaded numba kernel into cluster sizes above the portable 8 (a no-op under the
    simulator, which launches no clusters); a launch of 16-CTA clusters needs it."""
    if SIMULATOR:
        return
    from numba.cuda.cudadrv import driver as drv
    from numba.cuda.cudadrv.driver import binding
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
    for k in kernel.overloads.values():
        fn = k._codelibrary.get_cufunc()
        drv.driver.cuKernelSetAttribute(attr, 1, fn.handle, fn.device.id)
