"""Prompt feed: state[STATE_TOKEN] = prompt[state[STATE_POS] - start] while inside the prompt.

Why it exists: with it, one captured decode graph also runs prefill.  The engine uploads the
prompt once, then replays the graph once per prompt token; this kernel (the first node of the
graph) puts the right prompt token into the state before `embed` reads it, and past the
prompt it does nothing, so argmax's (or the device sampler's) token flows on.  Prefill as a loop
of decode steps is the simple correct path; tensor-core prefill replaces it later.

feed_meta int32 (2,): [start position of the prompt, prompt length].
"""
from __future__ import annotations

import functools

import numpy as np

from nq.kernels.build import compile_kernel
from nq.paged import STATE_POS, STATE_TOKEN
from nq.ptx import griddepcontrol_launch_dependents, griddepcontrol_wait


def feed_reference(prompt: np.ndarray, feed_meta: np.ndarray, state: np.ndarray) -> None:
    p = int(state[STATE_POS]) - int(feed_meta[0])
    if 0 <= p < int(feed_meta[1]):
        state[STATE_TOKEN] = prompt[p]


def feed_body(prompt, feed_meta, state):
    # prompt (max_len,) int32; feed_meta (2,) int32; state (STATE_LEN,) int32. One thread.
    griddepcontrol_wait()  # PDL (nq/ptx/griddep.py): every kernel of the step waits first
    griddepcontrol_launch_dependents()
    p = state[STATE_POS] - feed_meta[0]
    if p >= 0 and p < feed_meta[1]:
        state[STATE_TOKEN] = prompt[p]


FEED_SIG = "void(int32[::1], int32[::1], int32[::1])"


@functools.cache
def feed_kernel():
    """feed compiled for sm_90 (no baked-in constants: named feed)."""
    return compile_kernel(feed_body, FEED_SIG, "feed")


def feed_launcher(prompt, feed_meta, state):
    """Check dtypes once; return `launch(stream=0)`."""
    for name, a in (("prompt", prompt), ("feed_meta", feed_meta), ("state", state)):
        if a.dtype != np.int32 or len(a.shape) != 1:
            raise ValueError(f"feed: {name} must be a 1-d int32 device array")
    kern = feed_kernel()

    def launch(stream=0):
        kern[1, 1, stream](prompt, feed_meta, state)

    return launch
