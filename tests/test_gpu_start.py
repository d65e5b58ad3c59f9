"""nq/gpu_start.py: the CUDA driver's thread calls cuInit, cuDeviceGet and
cuDevicePrimaryCtxRetain in that order and keeps the context; without libcuda, a device or a
working driver it does nothing and raises nothing; start() and wait() book their parts on the
timeline."""
import ctypes
import sys

import pytest

from nq import gpu_start
from nq.timeline import Timeline


class FakeCuda:
    """libcuda.so.1 as ctypes shows it: each function returns a CUresult (0: success)."""

    def __init__(self, fail=None, device=3, context=0x5000):
        self.calls, self.fail, self.device, self.context = [], fail, device, context

    def _result(self, name):
        self.calls.append(name)
        return 100 if name == self.fail else 0      # 100: CUDA_ERROR_NO_DEVICE

    def cuInit(self, flags):
        assert flags == 0
        return self._result("cuInit")

    def cuDeviceGet(self, dev, ordinal):
        assert ordinal == 0
        dev._obj.value = self.device
        return self._result("cuDeviceGet")

    def cuDevicePrimaryCtxRetain(self, ctx, dev):
        assert dev.value == self.device            # the device cuDeviceGet wrote
        ctx._obj.value = self.context
        return self._result("cuDevicePrimaryCtxRetain")


@pytest.fixture
def fresh(monkeypatch):
    """gpu_start with nothing retained and no threads started in this process."""
    monkeypatch.setattr(gpu_start, "_RETAINED", [])
    monkeypatch.setattr(gpu_start, "_THREADS", [])
    monkeypatch.setattr(gpu_start, "_DRIVER", [])
    for k in ("NQ_DRIVER_THREAD", "NUMBA_DISABLE_CUDA", "NUMBA_ENABLE_CUDASIM"):
        monkeypatch.delenv(k, raising=False)


def test_the_driver_is_started_and_its_context_kept(fresh):
    lib = FakeCuda()
    names = []

    def load(name):
        names.append(name)
        return lib
    sec = gpu_start.init_driver(load)
    assert sec is not None and sec >= 0
    assert names == ["libcuda.so.1"]
    assert lib.calls == ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain"]
    # kept for the process: numba uses the same context, so it is never released here
    assert len(gpu_start._RETAINED) == 1 and gpu_start._RETAINED[0][1].value == 0x5000


@pytest.mark.parametrize("fail", ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain"])
def test_a_driver_error_is_swallowed(fresh, fail):
    lib = FakeCuda(fail=fail)
    assert gpu_start.init_driver(lambda name: lib) is None
    assert lib.calls[-1] == fail                   # nothing is called after a failure
    assert gpu_start._RETAINED == []


def test_no_libcuda_or_a_broken_one_is_swallowed(fresh, monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")
    assert gpu_start.init_driver(missing) is None
    assert gpu_start.init_driver(lambda name: object()) is None    # no cuInit symbol
    monkeypatch.setattr(ctypes, "CDLL", missing)                   # the default loader
    assert gpu_start.init_driver() is None
    assert gpu_start._RETAINED == []


def test_start_and_wait_book_the_threads_on_the_timeline(fresh, monkeypatch):
    monkeypatch.setattr(gpu_start, "init_driver", lambda: 0.25)
    monkeypatch.setattr(gpu_start, "import_numba_and_engine",
                        lambda tl: tl.aside(gpu_start.IMPORTS_PART, 0.5))
    tl = Timeline()
    assert gpu_start.wait() is False               # nothing started: returns at once
    gpu_start.start(tl)
    gpu_start.start(tl)                            # a second start is a no-op
    assert gpu_start.wait() is True
    assert sorted(tl.side) == sorted([(gpu_start.DRIVER_PART, 0.25),
                                      (gpu_start.IMPORTS_PART, 0.5)])
    assert tl.total() == 0                         # beside the main thread: not summed


@pytest.mark.parametrize("env", [{"NQ_DRIVER_THREAD": "0"}, {"NUMBA_ENABLE_CUDASIM": "1"},
                                 {"NUMBA_DISABLE_CUDA": "1"}])
def test_the_driver_is_left_to_numba_when_asked_or_unused(fresh, monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(gpu_start, "init_driver", lambda: pytest.fail("driver started"))
    monkeypatch.setattr(gpu_start, "import_numba_and_engine", lambda tl: None)
    gpu_start.start()
    assert gpu_start.wait() is True and [t.name for t in gpu_start._THREADS] == ["nq-gpu-imports"]


def test_a_failed_start_is_silent(fresh, monkeypatch):
    """No libcuda and numba that does not import: the threads swallow both and book nothing;
    make_backend then says what is wrong (tests/test_cli.py: no GPU, `--backend numpy`)."""
    def missing(name):
        raise OSError(name)
    monkeypatch.setattr(ctypes, "CDLL", missing)
    monkeypatch.setitem(sys.modules, "numba", None)       # `from numba import cuda` fails
    tl = Timeline()
    gpu_start.start(tl)
    assert gpu_start.wait() is True and tl.side == []


def test_retained_joins_the_driver_thread_and_hands_out_checked_calls(fresh, monkeypatch):
    """What nq/runtime/preload.py's thread gets: the context once the driver's thread is done
    (None without one), and calls that raise with the call's and the error's names."""
    assert gpu_start.retained() is None
    lib = FakeCuda()
    monkeypatch.setattr(gpu_start, "import_numba_and_engine", lambda tl: None)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: lib)
    gpu_start.start()
    cu, ctx = gpu_start.retained()
    assert ctx.value == 0x5000 and cu.lib is lib
    cu("cuInit", 0)                                       # CUDA_SUCCESS: nothing raised
    lib.fail = "cuInit"
    with pytest.raises(RuntimeError, match=r"cuInit failed: CUDA error \(100\)"):
        cu("cuInit", 0)                                   # (the fake has no cuGetErrorName)
