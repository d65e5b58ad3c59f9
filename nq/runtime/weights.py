"""Model weights on the GPU: uploaded from a mmapped .nanoqwen, or made random on the device.

The GEMV kernels read the INT4 projections in their own layout (nq/kernels/int4/layout.py:
a launcher's `prepare` concatenates q|k|v and gate|up along the output rows, then permutes
each row's 16-byte chunks or, for the tensor-core GEMV, builds mma fragments); everything else
is uploaded as stored.  Each buffer is its own allocation, and numba aligns every allocation
to at least 256 bytes, so every 16-byte load is aligned.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from nq.config import GROUP_SIZE, ModelConfig


@dataclasses.dataclass
class DeviceLayer:
    input_norm: object      # (H,) fp16
    post_norm: object       # (H,) fp16
    qkv_w: object           # (q+2kv, H/8) uint32, tiled
    qkv_s: object           # (q+2kv, H/128) fp16
    qkv_b: object           # (q+2kv,) fp16
    o_w: object
    o_s: object
    gu_w: object            # (2I, H/8) uint32: gate rows then up rows, tiled
    gu_s: object
    down_w: object
    down_s: object


@dataclasses.dataclass
class DeviceWeights:
    cfg: ModelConfig
    embed: object           # (vocab, H) fp16
    norm: object            # (H,) fp16
    lm_head: object         # (vocab, H) fp16 (the embedding itself when tied)
    layers: list
    load_s: float = 0.0     # host->device copy and re-tiling, after the kernels are compiled

    @property
    def nbytes_per_token(self) -> int:
        """Bytes one decode step reads: every layer's weights, the final norm and lm_head,
        plus one embedding row."""
        per_layer = sum(getattr(L, f.name).nbytes for L in self.layers
                        for f in dataclasses.fields(L))
        return per_layer + self.norm.nbytes + self.lm_head.nbytes + self.embed.shape[1] * 2


def gemvs(cfg: ModelConfig, tilings=None, check_layout: bool = True):
    """The four GEMV launchers of cfg (compiled on first use, cached).  tilings: {kind: Tiling
    or MmaTiling} overrides for experiments; each must keep the default's `layout()` (a Tiling's
    ks, or the mma fragments), which fixes the weights `upload` writes; threads, prefetch,
    span, ... are free.  check_layout=False lets the layout change too: only for timing random
    weights, whose values have no layout."""
    from nq.kernels.int4 import make_down_gemv, make_gate_up_gemv, make_o_proj_gemv, make_qkv_gemv
    makers = {"qkv": make_qkv_gemv, "o_proj": make_o_proj_gemv, "gate_up": make_gate_up_gemv,
              "down": make_down_gemv}
    out = {kind: make(cfg) for kind, make in makers.items()}
    for kind, t in (tilings or {}).items():
        if kind not in makers:
            raise ValueError(f"gemvs: unknown GEMV kind {kind!r}; one of {sorted(makers)}")
        d = out[kind].tiling
        if check_layout and t.layout() != d.layout():
            raise ValueError(f"gemvs: {kind} tiling {t.tag()} reads another weight layout than "
                             f"the uploaded one ({d.tag()}; layout(): a Tiling's ks, or an "
                             f"MmaTiling's fragments); keep it (or re-upload)")
        out[kind] = makers[kind](cfg, t)
    return out


def upload(nf, stream=0) -> DeviceWeights:
    """Copy a NanoqwenFile's tensors to the device; the projections are re-tiled on the GPU.

    Each projection group (q|k|v, o, gate|up, down) is copied from the mmapped file as it is
    into one staging buffer, its parts stacked along the output rows, then permuted into the
    GEMV's layout by nq/kernels/int4/retile.py (the host path, a launcher's `prepare`, is the
    reference; it costs ~17 s of NumPy for the 7B on a small CPU, the GPU a few ms).
    """
    from numba import cuda

    from nq.kernels.int4.layout import chunk_permutation
    from nq.kernels.int4.retile import compile_retile_rows, retile, retile_mma
    from nq.kernels.int4.tiling import MmaTiling

    cfg = nf.config
    g = gemvs(cfg)     # JIT compilation (~12 s for the 7B's kernels) is not part of load_s
    compile_retile_rows()
    t0 = time.perf_counter()
    stage_words = max(gm.n_rows * gm.k // 8 for gm in g.values())
    stage = cuda.device_array(stage_words, np.uint32)  # (largest group's rows * K/8,) uint32
    perms = {}

    def dev(a):
        return cuda.to_device(np.ascontiguousarray(a), stream=stream)

    def dev_named(name):
        """Copy a file tensor (synchronously from pageable memory), then drop its pages."""
        d = dev(nf.array(name))
        nf.release(name)
        return d

    def proj(kind, i, names):
        gm = g[kind]
        k8 = gm.k // 8
        mma = isinstance(gm.tiling, MmaTiling)
        key = None if mma else (gm.k, gm.tiling.ks)
        if not mma and key not in perms:
            perms[key] = dev(chunk_permutation(gm.k, gm.tiling.ks).astype(np.int32))
        src = stage[: gm.n_rows * k8].reshape(gm.n_rows, k8)
        qw = cuda.device_array((gm.n_rows, k8), np.uint32)
        sc = cuda.device_array((gm.n_rows, gm.k // GROUP_SIZE), np.float16)
        row = 0
        for n in names:
            part_q = nf.array(f"layers.{i}.{n}.qweight")
            part_s = nf.array(f"layers.{i}.{n}.scales")
            rows = part_q.shape[0]
            if row + rows > gm.n_rows or part_q.shape[1] != k8:
                raise ValueError(f"{nf.path}: layers.{i}.{n} is {part_q.shape}, the "
                                 f"{gm.name} kernel expects rows of {k8} words")
            src[row: row + rows].copy_to_device(part_q, stream=stream)
            sc[row: row + rows].copy_to_device(part_s, stream=stream)
            nf.release(f"layers.{i}.{n}.qweight")
            nf.release(f"layers.{i}.{n}.scales")
            row += rows
        if row != gm.n_rows:
            raise ValueError(f"{nf.path}: layer {i} {names} have {row} rows, {gm.name} expects "
                             f"{gm.n_rows}")
        if mma:
            retile_mma(src, qw, stream)
        else:
            retile(src, qw, perms[key], stream)
        return qw, sc

    layers = []
    for i in range(cfg.num_layers):
        qkv_w, qkv_s = proj("qkv", i, ("q_proj", "k_proj", "v_proj"))
        o_w, o_s = proj("o_proj", i, ("o_proj",))
        gu_w, gu_s = proj("gate_up", i, ("gate_proj", "up_proj"))
        d_w, d_s = proj("down", i, ("down_proj",))
        bias = np.concatenate([nf.array(f"layers.{i}.{n}.bias") for n in ("q_proj", "k_proj", "v_proj")])
        layers.append(DeviceLayer(
            input_norm=dev_named(f"layers.{i}.input_layernorm"),
            post_norm=dev_named(f"layers.{i}.post_attention_layernorm"),
            qkv_w=qkv_w, qkv_s=qkv_s, qkv_b=dev(bias), o_w=o_w, o_s=o_s,
            gu_w=gu_w, gu_s=gu_s, down_w=d_w, down_s=d_s))
    embed = dev_named("embed_tokens")
    lm_head = embed if cfg.tie_word_embeddings else dev_named("lm_head")
    w = DeviceWeights(cfg, embed=embed, norm=dev_named("norm"), lm_head=lm_head, layers=layers)
    cuda.synchronize()
    w.load_s = time.perf_counter() - t0
    return w


def random_device_weights(cfg: ModelConfig, seed: int = 0, stream=0) -> DeviceWeights:
    """Weights of cfg's shapes, made on the GPU: INT4 nibbles uniform in [-8, 7] with scales
    that give each projection output unit scale for unit inputs, norms near 1."""
    from numba import cuda

    from nq.kernels.fill import fill_f16, fill_u32

    t0 = time.perf_counter()
    counter = iter(range(seed * 100_000, (seed + 1) * 100_000))
    h = cfg.hidden_size

    def f16(shape, center, radius):
        a = cuda.device_array(shape, np.float16)
        fill_f16(a, next(counter), center, radius, stream)
        return a

    def int4(n, k):
        w = cuda.device_array((n, k // 8), np.uint32)
        fill_u32(w, next(counter), stream)
        # nibbles uniform in [-8, 7] have std ~4.6; scale so a unit input gives unit output
        s = 1.0 / (4.6 * np.sqrt(k))
        return w, f16((n, k // GROUP_SIZE), s, 0.25 * s)

    layers = []
    for _ in range(cfg.num_layers):
        qkv_w, qkv_s = int4(cfg.qkv_size, h)
        o_w, o_s = int4(h, cfg.q_size)
        gu_w, gu_s = int4(2 * cfg.intermediate_size, h)
        d_w, d_s = int4(h, cfg.intermediate_size)
        layers.append(DeviceLayer(
            input_norm=f16((h,), 1.0, 0.1), post_norm=f16((h,), 1.0, 0.1),
            qkv_w=qkv_w, qkv_s=qkv_s, qkv_b=f16((cfg.qkv_size,), 0.0, 0.1),
            o_w=o_w, o_s=o_s, gu_w=gu_w, gu_s=gu_s, down_w=d_w, down_s=d_s))
    embed = f16((cfg.vocab_size, h), 0.0, 0.17)
    lm_head = embed if cfg.tie_word_embeddings else f16((cfg.vocab_size, h), 0.0, 1.7 / np.sqrt(h))
    w = DeviceWeights(cfg, embed=embed, norm=f16((h,), 1.0, 0.1), lm_head=lm_head, layers=layers)
    cuda.synchronize()
    w.load_s = time.perf_counter() - t0
    return w
