"""What the GPU engine will allocate, counted before it allocates anything: a context that
cannot fit is refused with the bytes needed, the bytes free and the largest `-c` that fits,
instead of a CUDA_ERROR_OUT_OF_MEMORY from the middle of the load (issue #18).

    KV cache            pool_bytes(pages_for(max_len) + 1)        56 KiB a token for the 7B
    decode buffers      prompt + out_ids (8 B a token) + activations and attention partials
    prefill workspace   nq/runtime/prefill.workspace_bytes(chunk)  ~200 MB for the 7B at 2048
    weights             every tensor of the .nanoqwen, its lm_head as the file has it (counted
                        only before they are uploaded)
    MARGIN              what the load allocates besides: kernel modules, the captured graph,
                        the GEMMs' tile buffers, numba's own; 512 MiB is ~4x what it measured
                        (hence room for the driver's rounding to 2 MiB pages)
"""
from __future__ import annotations

import numpy as np

from nq.config import DEFAULT_LM_HEAD
from nq.paged import PAGE, pages_for, pool_bytes

MARGIN = 512 << 20
GB = 1e9


class DeviceMemoryError(RuntimeError):
    """The engine would not fit in the GPU's free memory; the message says what to change."""


def weight_bytes(cfg, lm_head: str = DEFAULT_LM_HEAD) -> int:
    """Bytes of every tensor a .nanoqwen of cfg with that lm_head holds (the device copy is
    the same size; a rescored INT4 head's row bounds, 4 bytes a row, are within MARGIN)."""
    from nq.loader.format import expected_tensors
    return sum(int(np.prod(shape)) * dt.itemsize
               for dt, shape in expected_tensors(cfg, lm_head).values())


def engine_bytes(cfg, max_len: int, prefill_chunk: int, weights: bool,
                 lm_head: str = DEFAULT_LM_HEAD) -> dict[str, int]:
    """The device bytes an Engine of max_len tokens allocates, by part; weights: count the
    weights too (a file's, whose lm_head is `lm_head`), not yet uploaded."""
    from nq.runtime.prefill import workspace_bytes
    act = 4 * (cfg.hidden_size + cfg.qkv_size + cfg.q_size + cfg.vocab_size) \
        + 2 * (cfg.q_size + cfg.intermediate_size)
    parts = {"KV cache": pool_bytes(cfg, pages_for(max_len) + 1),
             "decode buffers": 8 * int(max_len) + act + (8 << 20),  # + attention partials
             "prefill workspace": workspace_bytes(cfg, min(int(prefill_chunk), int(max_len)))}
    if weights:
        parts["weights"] = weight_bytes(cfg, lm_head)
    parts["margin"] = MARGIN
    return parts


def largest_context(cfg, free: int, prefill_chunk: int, weights: bool,
                    lm_head: str = DEFAULT_LM_HEAD) -> int:
    """The largest max_len (a multiple of 1024) whose engine fits in `free` bytes, or 0."""
    def fits(k: int) -> bool:
        return sum(engine_bytes(cfg, 1024 * k, prefill_chunk, weights,
                                lm_head).values()) <= free
    lo, hi = 0, int(free // (pool_bytes(cfg, 1) / PAGE) // 1024) + 1  # fits(lo); not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return 1024 * lo


def check_fits(cfg, max_len: int, prefill_chunk: int, weights: bool, free: int,
               total: int, lm_head: str = DEFAULT_LM_HEAD) -> None:
    """Raise DeviceMemoryError if an engine of max_len tokens does not fit in `free` bytes."""
    parts = engine_bytes(cfg, max_len, prefill_chunk, weights, lm_head)
    need = sum(parts.values())
    if need <= free:
        return
    fits = largest_context(cfg, free, prefill_chunk, weights, lm_head)
    what = ", ".join(f"{k} {v / GB:.2f}" for k, v in parts.items())
    fix = (f"use -c {fits} or less" if fits else
           "not even a short context fits: free the GPU (nvidia-smi shows who holds it)")
    held = total - free
    raise DeviceMemoryError(
        f"not enough GPU memory for a context of {max_len} tokens: it needs {need / GB:.2f} GB "
        f"({need} bytes: {what} GB), the GPU has {free / GB:.2f} GB free ({free} bytes) of "
        f"{total / GB:.2f} GB ({held / GB:.2f} GB held by this or other processes); {fix}")


def check_device_memory(cfg, max_len: int, prefill_chunk: int, weights: bool,
                        held: int = 0, lm_head: str = DEFAULT_LM_HEAD) -> None:
    """check_fits against the current GPU's free memory (nothing is checked in the simulator).
    held: bytes of the weights this engine has allocated already (nq/runtime/preload.py's
    arena), counted as free, since `weights` counts them; lm_head: the file's."""
    from numba import cuda
    from numba.core import config
    if config.ENABLE_CUDASIM:
        return
    free, total = cuda.current_context().get_memory_info()
    check_fits(cfg, max_len, prefill_chunk, weights, int(free) + int(held), int(total), lm_head)
