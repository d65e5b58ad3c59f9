"""The prefill GEMM tests' cases, shared by the mma.sync and wgmma GPU tests
(tests/kernels/int4/test_gemm_gpu.py, test_gemm_wgmma_gpu.py): every projection of the 0.5B and
7B configs, and their weights as decode uploads them."""
import functools

import numpy as np

from nq.config import PRESETS
from nq.kernels.int4.layout import mma_layout, tile_rows
from nq.loader.quant import quantize_pack


def projections(cfg, qkv_ks, gate_up_ks):
    h, i = cfg.hidden_size, cfg.intermediate_size
    return [("qkv", cfg.qkv_size, h, ("rows", qkv_ks)), ("o_proj", h, cfg.q_size, "mma"),
            ("gate_up", i, h, ("rows", gate_up_ks)), ("down", h, i, "mma")]


SHAPES = ([("0.5b",) + p for p in projections(PRESETS["0.5b"], 7, 7)]
          + [("7b",) + p for p in projections(PRESETS["7b"], 14, 4)]
          # gate_up as decode uploads it (gemv_mma's fragment layout; the default since d292fd2)
          + [(m, "gate_up", PRESETS[m].intermediate_size, PRESETS[m].hidden_size, "mma")
             for m in ("0.5b", "7b")])


@functools.lru_cache(maxsize=None)
def weights(model, kind, n, k, layout):
    """(uploaded qw, sc on the device, file-layout qw, sc on the host)."""
    rng = np.random.default_rng(n * 7 + k)
    rows = 2 * n if kind == "gate_up" else n
    if model == "0.5b":
        qw, sc = quantize_pack(rng.standard_normal((rows, k)).astype(np.float32) * 0.05)
    else:
        qw = rng.integers(0, 2**32, (rows, k // 8), dtype=np.uint32)
        sc = rng.uniform(0.002, 0.02, (rows, k // 128)).astype(np.float16)
    from numba import cuda
    up = mma_layout(qw) if layout == "mma" else tile_rows(qw, layout[1])
    return cuda.to_device(up), cuda.to_device(sc), qw, sc
