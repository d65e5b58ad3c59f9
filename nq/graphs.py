"""CUDA-graph capture and replay of numba kernel launches, through cuda.bindings.

Why: launching a numba kernel costs 16-50 µs of host time, a replayed graph ~0.8 µs a
kernel (DEVICE.md), and one decode step of the 7B is ~170 launches.  So decode is captured
once and replayed; everything that changes from step to step (position, token, length) lives
in device memory that the captured kernels read, never in launch arguments.

Rules for what runs under `capture`: every kernel is compiled and launched once before
(compilation or a host→device argument copy inside a capture invalidates it), no host numpy
array is passed to a kernel, and nothing allocates.
"""
from __future__ import annotations

from cuda.bindings import driver as cu


def _check(result):
    """cuda.bindings returns (CUresult, *values); raise on an error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise RuntimeError(f"CUDA driver call failed: {name.decode() if name else err}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def stream_handle(stream) -> cu.CUstream:
    """The driver handle of a numba stream (or anything with `.handle` or an int)."""
    h = getattr(stream, "handle", stream)
    return cu.CUstream(int(h))


class CapturedGraph:
    """A graph captured from the launches `fn()` makes on `stream`, ready to replay.

    >>> g = CapturedGraph(stream, lambda: step(stream))   # captures, instantiates
    >>> g.replay()                                          # ~µs of host time
    """

    def __init__(self, stream, fn, name: str = "graph"):
        self.name = name
        self.stream = stream
        h = stream_handle(stream)
        _check(cu.cuStreamBeginCapture(
            h, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        try:
            fn()
        except BaseException:
            # End the capture so the stream is usable again, then drop the broken graph.
            graph = _check(cu.cuStreamEndCapture(h))
            if graph is not None:
                cu.cuGraphDestroy(graph)
            raise
        self._graph = _check(cu.cuStreamEndCapture(h))
        self.num_nodes = _check(cu.cuGraphGetNodes(self._graph, 0))[1]
        self._exec = _check(cu.cuGraphInstantiate(self._graph, 0))
        _check(cu.cuGraphUpload(self._exec, h))

    def replay(self, stream=None) -> None:
        _check(cu.cuGraphLaunch(self._exec, stream_handle(stream or self.stream)))

    def __del__(self):
        try:
            if getattr(self, "_exec", None) is not None:
                cu.cuGraphExecDestroy(self._exec)
            if getattr(self, "_graph", None) is not None:
                cu.cuGraphDestroy(self._graph)
        except Exception:  # interpreter shutdown: the driver may already be gone
            pass

    def __repr__(self):
        return f"<CapturedGraph {self.name}: {self.num_nodes} nodes>"
