"""CUDA-graph capture and replay of numba kernel launches, through cuda.bindings.

Why: launching a numba kernel costs 16-50 µs of host time, a replayed graph ~0.8 µs a
kernel (DEVICE.md), and one decode step of the 7B is ~170 launches.  So decode is captured
once and replayed; everything that changes from step to step (position, token, length) lives
in device memory that the captured kernels read, never in launch arguments.

Rules for what runs under `capture`: every kernel is compiled and launched once before
(compilation or a host→device argument copy inside a capture invalidates it), no host numpy
array is passed to a kernel, and nothing allocates.

`programmatic=True` turns every kernel-to-kernel edge of the captured chain into a
programmatic dependency (programmatic dependent launch, PDL): the next kernel may be
scheduled once every CTA of the previous one has executed `griddepcontrol.launch_dependents`,
and runs its independent prologue (weight loads, L2 prefetch, barrier set-up) while the
previous kernel finishes.  numba's launcher cannot pass cuLaunchKernelEx's launch attribute,
so the edges are rewritten after capture, before instantiation.  Only for graphs whose every
kernel executes `griddepcontrol.wait` (nq/ptx/griddep.py) before it touches data another
kernel of the graph writes or reads -- every kernel of the decode step does.

Retired: a preferred shared-memory carveout set on every kernel node (so that each SM keeps
one configuration and a next kernel's blocks never wait for it to drain; code at 0f4633d).
The driver's own choice per kernel beat every uniform one in the 7B step (H200, 2026-12-03,
ms a step at 512 / 8K / 32K): 100 % +0.081 / +0.084 / +0.087, 75 % +0.003 / +0.235 / +0.142,
50 % +0.014 / +0.246 / +0.152, 0 % +0.24 / +0.48 / +0.41 (docs/PERF.md 0.14).
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

    def __init__(self, stream, fn, name: str = "graph", programmatic: bool = False,
                 full_into: tuple[str, ...] = ()):
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
        self.programmatic_edges = (make_programmatic(self._graph, full_into) if programmatic
                                   else 0)
        self._exec = _check(cu.cuGraphInstantiate(self._graph, 0))
        _check(cu.cuGraphUpload(self._exec, h))

    def replay(self, stream=None) -> None:
        _check(cu.cuGraphLaunch(self._exec, stream_handle(stream or self.stream)))

    def median_ms(self, reps: int = 20, warmup: int = 3) -> float:
        """The median of `reps` replays' times by CUDA events on the graph's stream, after
        `warmup` replays (the benches' timing of a captured graph)."""
        import statistics

        from numba import cuda
        for _ in range(warmup):
            self.replay()
        evs = [cuda.event() for _ in range(reps + 1)]
        evs[0].record(self.stream)
        for r in range(reps):
            self.replay()
            evs[r + 1].record(self.stream)
        evs[-1].synchronize()
        return statistics.median(cuda.event_elapsed_time(evs[r], evs[r + 1])
                                 for r in range(reps))

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


def make_programmatic(graph, full_into: tuple[str, ...] = ()) -> int:
    """Rewrite each kernel -> kernel edge of `graph` as a programmatic one; returns how many.
    An edge into a kernel whose (mangled) name contains one of `full_into` stays a full
    dependency: that kernel starts only when the one before has ended (a diagnostic,
    scripts/step_variants.py's `pdl.full=`).
    (Every kernel of the step executes griddepcontrol.wait before it reads upstream data; a
    kernel that did not -- l2_pace's, on a side stream, retired with it at 20358ec -- needs
    its edges left as full dependencies.)

    A programmatic edge leaves the dependent kernel's port open once every CTA of the upstream
    kernel has triggered (griddepcontrol.launch_dependents) or exited; memory visibility is
    then the dependent's griddepcontrol.wait's job (CUDA programming guide, "Programmatic
    Dependent Launch and Synchronization", graph edges with port PROGRAMMATIC).
    """
    n = _check(cu.cuGraphGetEdges(graph, 0))[-1]
    if not n:
        return 0
    src, dst, _, n = _check(cu.cuGraphGetEdges(graph, n))
    kernel = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL
    pairs = [(a, b) for a, b in zip(src[:n], dst[:n])
             if _check(cu.cuGraphNodeGetType(a)) == kernel and _check(cu.cuGraphNodeGetType(b)) == kernel
             and not (full_into and any(f in kernel_name(b) for f in full_into))]
    for a, b in pairs:
        data = cu.CUgraphEdgeData()
        data.from_port = cu.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
        data.to_port = 0
        data.type = cu.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
        _check(cu.cuGraphRemoveDependencies(graph, [a], [b], None, 1))
        _check(cu.cuGraphAddDependencies(graph, [a], [b], [data], 1))
    return len(pairs)


def kernel_name(node) -> str:
    """The (mangled) function name of a kernel node."""
    params = _check(cu.cuGraphKernelNodeGetParams(node))
    return _check(cu.cuFuncGetName(params.func)).decode(errors="replace")
