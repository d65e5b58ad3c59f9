"""The weights' copy to the GPU, started before numba is imported.

Why.  A warm 7B start waited 0.35-0.39 s for its weights (H200, 2026-12-01): the upload began
only once numba, the engine's modules and the upload's kernels were in, ~1.2 s after the
command, and ran beside the kernel loads at 9 GB/s.  The copies themselves need no numba: the
file's tensors go, as stored, into device buffers whose shapes the file alone fixes.  So once
nq/gpu_start.py's driver thread holds the primary context, `start(nf)` (`nq generate`, right
after the file opens) puts every weight buffer in one device allocation, the *arena*, through
ctypes, and a thread of its own copies the file into it through the pinned ring
(nq/runtime/staging.py, `DriverDevice`) while numba imports.  `runtime.weights.upload` then
`take`s the arena, wraps its buffers as numba device arrays, and does on the GPU only what
needs numba's kernels: the projections arrive as stored and are re-tiled in place (through a
staging buffer).  The bytes on the device are the ordinary upload's: the same buffers, the
same copies, the same re-tiling launches; only the thread and the time differ.

Layout (`buffers`): per layer the four projection groups' qweight and scales (q|k|v and
gate|up stacked along the rows, as the GEMVs read them), the q|k|v bias and the two norms;
then the embedding, the final norm and the lm_head (none when tied; rows + scales when int8
or int4).
Each buffer starts at a multiple of 256 bytes, as numba's own allocations do.

The GIL.  The ring's thread and its readers hold the GIL for a few bytecodes between driver
calls and reads, while numba's import holds it for ~0.7 s of Python.  A thread waiting for the
GIL gets it when the holder's switch interval is up (5 ms by default), which would cap the ring
at a few hundred GIL hand-overs a second (~4 a 16 MB piece: ~1 GB/s).  While the ring runs
the interval is SWITCH_S.

Nothing starts (and upload works as before) with NQ_PRELOAD=0, without the driver's thread
(NQ_DRIVER_THREAD=0, the simulator), without a GPU, or when the arena does not fit in the free
memory.  An error while copying (a file that changed, a driver error) is kept, and upload
copies again, the ordinary way, into the same arena: it meets the same error if it lasts.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
import weakref

import numpy as np

from nq import gpu_start
from nq.runtime import staging
from nq.loader.weights import rescore_rows_of

ALIGN = 256
SWITCH_S = 0.0005       # the GIL's switch interval while the ring runs (Python's is 0.005)
MARGIN = 512 << 20      # free memory left beside the arena (runtime/memory.py's MARGIN)
PART = "weights upload before numba"

# the projection groups, each stacked along the output rows into one GEMV's weights
GROUPS = (("qkv", ("q_proj", "k_proj", "v_proj")), ("o_proj", ("o_proj",)),
          ("gate_up", ("gate_proj", "up_proj")), ("down", ("down_proj",)))


@dataclasses.dataclass(frozen=True)
class Buffer:
    name: str                   # "layers.0.qkv.qweight", "embed_tokens", ...
    parts: tuple[str, ...]      # the file's tensors, stacked along the rows in this order
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int                 # bytes into the arena
    nbytes: int


def buffers(nf) -> list[Buffer]:
    """Every device buffer of nf's weights, in the arena's order (module docstring).  The file
    was checked against its config when opened, so the stacked parts agree in all but rows."""
    out, at = [], 0

    def add(name: str, parts: list[str]) -> None:
        nonlocal at
        es = [nf.entry(p) for p in parts]
        shape = (sum(e.shape[0] for e in es),) + tuple(es[0].shape[1:])
        out.append(Buffer(name, tuple(parts), shape, es[0].dtype, at, sum(e.nbytes for e in es)))
        at += -(-out[-1].nbytes // ALIGN) * ALIGN

    for i in range(nf.config.num_layers):
        for kind, names in GROUPS:
            for what in ("qweight", "scales"):
                add(f"layers.{i}.{kind}.{what}", [f"layers.{i}.{n}.{what}" for n in names])
        add(f"layers.{i}.qkv.bias", [f"layers.{i}.{n}.bias" for n in GROUPS[0][1]])
        for n in ("input_layernorm", "post_attention_layernorm"):
            add(f"layers.{i}.{n}", [f"layers.{i}.{n}"])
    heads = (("lm_head.qweight", "lm_head.scales") if nf.lm_head != "fp16" else
             () if nf.config.tie_word_embeddings else ("lm_head",))
    if rescore_rows_of(nf) == "lm_head":     # an "int4+fp16" file's rescoring rows
        heads += ("lm_head",)
    for n in ("embed_tokens", "norm") + heads:
        add(n, [n])
    return out


def arena_bytes(bufs: list[Buffer]) -> int:
    return bufs[-1].offset + bufs[-1].nbytes if bufs else 0


def copies(nf, bufs: list[Buffer], base: int) -> list[staging.Copy]:
    """The ring's copies that fill every buffer of an arena at device address `base`."""
    plan = []
    for b in bufs:
        at = base + b.offset
        for p in b.parts:
            e = nf.entry(p)
            plan.append(staging.Copy(e.offset, e.nbytes, at))
            at += e.nbytes
    return plan


class Preload:
    """One file's arena and the thread that fills it (module docstring)."""

    def __init__(self, nf, timeline=None):
        self.nf, self.timeline = nf, timeline
        self.bufs = buffers(nf)
        self.nbytes = arena_bytes(self.bufs)
        self.ptr = 0                # the arena's device address once allocated
        self.copied = False         # every byte is on the device
        self.error: BaseException | None = None
        self.allocated = threading.Event()      # set once ptr is known (or never will be)
        self._thread = threading.Thread(target=self._run, name="nq-preload", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import ctypes
        try:
            got = gpu_start.retained()       # joins the driver's thread
            if got is None:
                return
            cu, ctx = got
            cu("cuCtxSetCurrent", ctx)
            free, total = ctypes.c_size_t(), ctypes.c_size_t()
            cu("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
            if free.value < self.nbytes + MARGIN:   # upload's memory check says what to do
                return
            ptr = ctypes.c_uint64()
            cu("cuMemAlloc_v2", ctypes.byref(ptr), max(self.nbytes, 1))
            self.ptr = ptr.value
            # freed with the last array that views it (numba's arrays hold the Preload as
            # their owner); at exit the process's teardown frees it
            weakref.finalize(self, cu.lib.cuMemFree_v2, ptr.value).atexit = False
            self.allocated.set()
            t = time.perf_counter()
            old = sys.getswitchinterval()
            sys.setswitchinterval(min(old, SWITCH_S))
            dev = staging.DriverDevice(cu)
            try:
                n = staging.run(self.nf.path, copies(self.nf, self.bufs, self.ptr), dev)
            finally:
                sys.setswitchinterval(old)
                dev.close()
            self.copied = True
            sec = time.perf_counter() - t
            self._book(f"{PART} ({n / 1e9:.2f} GB, {n / 1e9 / max(sec, 1e-9):.1f} GB/s, "
                       "thread)", sec)
        except Exception as e:  # noqa: BLE001 -- upload copies again and reports what lasts
            self.error = e
            self._book(f"{PART} failed, copied again ({type(e).__name__}: {e})"[:120], 0.0)
        finally:
            self.allocated.set()

    def _book(self, name: str, sec: float) -> None:
        if self.timeline is not None:
            self.timeline.aside(name, sec)

    def wait(self) -> bool:
        """Join the thread; True if every byte is in the arena."""
        self._thread.join()
        return self.copied

    def array(self, b: Buffer):
        """Buffer b of the arena as a numba device array (it keeps the arena alive)."""
        from numba import cuda
        desc = {"shape": b.shape, "typestr": b.dtype.str, "data": (self.ptr + b.offset, False),
                "strides": None, "version": 3}
        return cuda.from_cuda_array_interface(desc, owner=self, sync=False)


_PENDING: list[Preload] = []


def wanted() -> bool:
    """False with NQ_PRELOAD=0, or where the driver's thread does not start (gpu_start)."""
    return os.environ.get("NQ_PRELOAD", "1").strip() != "0" and gpu_start.driver_thread_wanted()


def start(nf, timeline=None) -> Preload | None:
    """Start copying nf's weights to the GPU (returns at once); None where it is not wanted
    or already started.  Errors here are left for upload to report."""
    if not wanted() or _PENDING:
        return None
    try:
        _PENDING.append(Preload(nf, timeline))
    except Exception:  # noqa: BLE001
        return None
    return _PENDING[-1]


def take(nf) -> Preload | None:
    """The preload of nf (the very NanoqwenFile given to `start`), once its arena is
    allocated; handed out once.  None if there is none or it could not allocate."""
    for p in _PENDING:
        if p.nf is nf:
            _PENDING.remove(p)
            p.allocated.wait()
            return p if p.ptr else None
    return None
