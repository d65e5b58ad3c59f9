"""nq/kernels/fastlaunch.py on the CPU: the parameter list is built once from numba's own
per-argument preparation, each call puts its integers in their slots and launches through
cuda.core's `launch`; anything unexpected takes numba's ordinary launch.  (The GPU tier runs
every prefill kernel through it: tests/runtime/test_engine_gpu.py's batched-prefill tests.)"""
import ctypes
import types

import numpy as np
import pytest
from numba.cuda import types as nbtypes

from nq.kernels import fastlaunch as F


class FakeKernel:
    """numba's compiled kernel as FastLaunch reads it: argument types, the per-argument
    preparation (an array becomes a few parameters), the cufunc's kernel handle."""

    def __init__(self, argtypes):
        self.argument_types = argtypes
        self.prepared = []
        self._codelibrary = types.SimpleNamespace(
            get_cufunc=lambda: types.SimpleNamespace(kernel="KERNEL"))

    def _prepare_args(self, t, v, stream, retr, params):
        self.prepared.append(id(v))
        params += [0, 0, v.size, v.itemsize, id(v)]


class FakeDispatcher:
    def __init__(self, argtypes):
        self.kern = FakeKernel(argtypes)
        self.overloads = {"sig": self.kern}
        self.plain = []

    def __getitem__(self, cfg):
        return lambda *args: self.plain.append((cfg, args))


@pytest.fixture
def launched(monkeypatch):
    calls = []
    import cuda.core
    from numba.cuda.cudadrv import driver
    monkeypatch.setattr(cuda.core, "launch", lambda *a: calls.append(a))
    monkeypatch.setattr(driver, "_to_core_stream", lambda s: ("stream", s))
    monkeypatch.setattr(F, "_config", lambda g, b, s, *c: ("config", g, b, s, *c))
    monkeypatch.setattr(F, "ENABLED", True)
    monkeypatch.setattr(F, "_LAST_STREAM", [None, None])
    return calls


ARR = nbtypes.Array(nbtypes.float32, 1, "C")


def test_arrays_prepared_once_integers_per_call(launched):
    x, y = np.zeros(8, np.float32), np.zeros(4, np.float32)
    d = FakeDispatcher([ARR, ARR, nbtypes.int32, nbtypes.int64])
    fl = F.FastLaunch(d, x, y, 0, 0)
    fl((3, 2), 128, "s", 1024, 7, 9)
    fl(5, 64, "s", 0, 11, 2**40)
    assert d.kern.prepared == [id(x), id(y)]          # once, at the first call
    (s1, c1, k1, *p1), (s2, c2, k2, *p2) = launched
    assert s1 == ("stream", "s") and c1 == ("config", (3, 2), (128,), 1024) and k1 == "KERNEL"
    assert c2 == ("config", (5,), (64,), 0)
    assert p1[:10] == [0, 0, 8, 4, id(x), 0, 0, 4, 4, id(y)] == p2[:10]
    assert isinstance(p1[10], ctypes.c_int32) and p1[10].value == 7
    assert isinstance(p1[11], ctypes.c_int64) and p1[11].value == 9
    assert p2[10].value == 11 and p2[11].value == 2**40
    with pytest.raises(TypeError, match="2 integer arguments"):
        fl(1, 32, "s", 0, 1)
    assert d.plain == []


def test_cluster_dims_reach_the_launch_configuration(launched, monkeypatch):
    x = np.zeros(8, np.float32)
    d = FakeDispatcher([ARR, nbtypes.int32])
    F.FastLaunch(d, x, 0)((1, 4), 64, "s", 512, 3, cluster=(16, 1, 1))
    assert launched[0][1] == ("config", (1, 4), (64,), 512, (16, 1, 1))
    # the ordinary launch has no cluster argument: refused, unless clusters of one CTA under
    # the simulator (grid then in blocks)
    monkeypatch.setattr(F, "ENABLED", False)
    with pytest.raises(RuntimeError, match="cluster launch needs cuda.core"):
        F.FastLaunch(d, x, 0)((1, 4), 64, "s", 512, 3, cluster=(16, 1, 1))
    monkeypatch.setattr(F, "SIMULATOR", True)
    F.FastLaunch(d, x, 0)((2, 4), 64, "s", 512, 3, cluster=(1, 1, 1))
    assert d.plain[-1] == (((2, 4, 1), 64, "s", 512), (x, 3))


def test_unexpected_argument_types_take_the_ordinary_launch(launched):
    x = np.zeros(8, np.float32)
    d = FakeDispatcher([ARR, nbtypes.float64, nbtypes.int32])
    fl = F.FastLaunch(d, x, 0.5, 0)
    fl(4, 32, "s", 0, 3)
    assert launched == [] and d.plain == [((4, 32, "s", 0), (x, 0.5, 3))]


def test_switched_off_is_the_ordinary_launch(launched, monkeypatch):
    monkeypatch.setattr(F, "ENABLED", False)
    x = np.zeros(8, np.float32)
    d = FakeDispatcher([ARR, nbtypes.int32])
    F.FastLaunch(d, x, 0)(2, 32, "s", 0, 5)
    assert launched == [] and d.kern.prepared == [] and d.plain == [((2, 32, "s", 0), (x, 5))]
