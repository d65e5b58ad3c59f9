"""Token embedding: state[STATE_TOKEN] -> residual x fp32 (hidden,) from the fp16 table.

The token id is read on device (nq/runtime/kv_cache.py's state layout), so the decode graph that
starts with this kernel replays unchanged at every step.  Grid ceil(hidden/256), block 256:
a 7 KiB row is one coalesced read.
"""
from __future__ import annotations

import functools

import numpy as np

from nq.kernels.build import compile_kernel, kernel_name
from nq.paged import STATE_TOKEN

THREADS = 256


def embed_reference(emb: np.ndarray, token: int) -> np.ndarray:
    """emb (vocab, hidden) fp16 -> x (hidden,) fp32."""
    return np.asarray(emb[token], np.float32)


@functools.cache
def embed_body(hidden: int):
    """The kernel body for rows of `hidden` values."""
    from numba import cuda
    from numba.cuda.types import float32

    from nq.ptx import griddepcontrol_launch_dependents, griddepcontrol_wait

    H = hidden

    def embed(emb, state, x):
        # emb (vocab, H) f16; state int32; x (H,) f32
        griddepcontrol_wait()  # PDL: state.token comes from feed / the last argmax
        griddepcontrol_launch_dependents()
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if i < H:
            x[i] = float32(emb[state[STATE_TOKEN], i])

    return embed


EMBED_SIG = "void(float16[:, ::1], int32[::1], float32[::1])"


@functools.cache
def embed_kernel(hidden: int):
    """embed compiled for sm_90, named embed_h{hidden}."""
    return compile_kernel(embed_body(hidden), EMBED_SIG, kernel_name("embed", h=hidden))


def embed_launcher(emb, state, x):
    """Check shapes once; return `launch(stream=0)` writing x = emb[state[STATE_TOKEN]]."""
    h = emb.shape[1]
    if emb.dtype != np.float16 or x.dtype != np.float32 or tuple(x.shape) != (h,):
        raise ValueError(f"embed: emb {emb.dtype}{tuple(emb.shape)}, x {x.dtype}{tuple(x.shape)}; "
                         f"want float16 (vocab, H) and float32 (H,)")
    if state.dtype != np.int32:
        raise ValueError("embed: state must be int32")
    kern = embed_kernel(h)
    grid = -(-h // THREADS)

    def launch(stream=0):
        kern[grid, THREADS, stream](emb, state, x)

    return launch
