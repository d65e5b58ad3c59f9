"""Model weights on the GPU: uploaded from a mmapped .nanoqwen, or made random on the device.

The GEMV kernels read the INT4 projections in their own layout (nq/kernels/int4/layout.py:
a launcher's `prepare` concatenates q|k|v and gate|up along the output rows, then permutes
each row's 16-byte chunks or, for the tensor-core GEMV, builds mma fragments); everything else
is uploaded as stored.  Each buffer is its own allocation, and numba aligns every allocation
to at least 256 bytes, so every 16-byte load is aligned.
"""
from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np

from nq.config import GROUP_SIZE, ModelConfig
from nq.loader.format import INT4_HEADS
from nq.loader.weights import rescore_rows_of
from nq.ptx import SIMULATOR


@dataclasses.dataclass
class DeviceLayer:
    input_norm: object      # (H,) fp16
    post_norm: object       # (H,) fp16
    qkv_w: object           # (q+2kv, H/8) uint32, tiled
    qkv_s: object           # (q+2kv, H/128) fp16
    qkv_b: object           # (q+2kv,) fp16
    o_w: object
    o_s: object
    gu_w: object            # (2I, H/8) uint32: gate rows then up rows, tiled (or mma fragments)
    gu_s: object
    down_w: object
    down_s: object


@dataclasses.dataclass
class DeviceWeights:
    cfg: ModelConfig
    embed: object           # (vocab, H) fp16
    norm: object            # (H,) fp16
    lm_head: object         # (vocab, H) fp16 (the embedding itself when tied), or a file's int8
                            # head: Int8Rows(qweight (vocab, H) int8, scales (vocab,) fp32),
                            # or INT4: Int4Rows(qweight (vocab, H/8) uint32 tiled, scales fp16)
    layers: list
    load_s: float = 0.0     # host->device copy and re-tiling, after the kernels are compiled
    _thread: object = None  # the upload's thread while it runs (upload(background=True))
    _error: BaseException | None = None
    _keep: object = None
    startup: dict = dataclasses.field(default_factory=dict)   # seconds by part (timeline laps)

    def _start(self, fill) -> None:
        def target():
            try:
                fill()
            except BaseException as e:  # noqa: BLE001 -- handed to wait()
                self._error = e
        self._thread = threading.Thread(target=target, name="nq-upload", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Return once the weights are on the device (at once unless uploading in the
        background); an upload's error is raised here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self._keep = None
        if self._error is not None:
            raise self._error

    @property
    def nbytes_per_token(self) -> int:
        """Bytes one decode step reads: every layer's weights, the final norm and lm_head,
        plus one embedding row."""
        per_layer = sum(getattr(L, f.name).nbytes for L in self.layers
                        for f in dataclasses.fields(L))
        return per_layer + self.norm.nbytes + self.lm_head.nbytes + self.embed.shape[1] * 2


def gemvs(cfg: ModelConfig, tilings=None, check_layout: bool = True, kinds=None):
    """The four GEMV launchers of cfg (compiled on first use, cached).  tilings: {kind: Tiling
    or MmaTiling} overrides for experiments; each must keep the default's `layout()` (a Tiling's
    ks, or the mma fragments), which fixes the weights `upload` writes; threads, prefetch,
    span, ... are free.  check_layout=False lets the layout change too: only for timing random
    weights, whose values have no layout.  kinds: only these launchers (the fused step has no
    o_proj GEMV), compiled; by default all four."""
    from nq.kernels.int4 import make_down_gemv, make_gate_up_gemv, make_o_proj_gemv, make_qkv_gemv
    from nq.kernels.int4.launch import gemv_tiling
    makers = {"qkv": make_qkv_gemv, "o_proj": make_o_proj_gemv, "gate_up": make_gate_up_gemv,
              "down": make_down_gemv}
    tilings = tilings or {}
    for kind, t in tilings.items():
        if kind not in makers:
            raise ValueError(f"gemvs: unknown GEMV kind {kind!r}; one of {sorted(makers)}")
        d = gemv_tiling(kind, cfg)
        if check_layout and t.layout() != d.layout():
            raise ValueError(f"gemvs: {kind} tiling {t.tag()} reads another weight layout than "
                             f"the uploaded one ({d.tag()}; layout(): a Tiling's ks, or an "
                             f"MmaTiling's fragments); keep it (or re-upload)")
    # only the kernels returned are compiled (an overridden default is not)
    return {kind: make(cfg, tilings.get(kind)) for kind, make in makers.items()
            if kinds is None or kind in kinds}


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    """What the upload needs of a projection's GEMV: its weight rows, K, and the tiling whose
    `layout()` the weights are re-tiled into -- no compiled kernel."""
    name: str
    n_rows: int
    k: int
    tiling: object


def weight_layouts(cfg: ModelConfig) -> dict:
    """{kind: WeightLayout} of the four projections as gemvs(cfg) builds them, compiling
    nothing: the upload's kernels are then only the re-tiling ones, and a first start compiles
    the GEMVs in the engine's batch beside the rest (nq/kernels/int4/launch.py gemv_tiling)."""
    from nq.kernels.int4.launch import gemv_shape, gemv_tiling
    out = {}
    for kind in ("qkv", "o_proj", "gate_up", "down"):
        _, k, rows = gemv_shape(kind, cfg)
        t = gemv_tiling(kind, cfg)
        out[kind] = WeightLayout(f"{kind} GEMV ({t.tag()})", rows, k, t)
    return out


def upload(nf, stream=None, background: bool = False, preloaded=None) -> DeviceWeights:
    """Copy a NanoqwenFile's tensors to the device; the projections are re-tiled on the GPU.

    Every device buffer is allocated first (here, on the calling thread; nq/runtime/preload.py's
    `buffers` lists them); then the file's tensors go to them as stored, through
    nq/runtime/staging.py's pinned ring (the simulator: plain copies), and each projection group
    (q|k|v, o, gate|up, down, stacked along the output rows) is permuted in place into the
    GEMV's layout by nq/kernels/int4/retile.py, through one staging buffer (the host path, a
    launcher's `prepare`, is the reference; it costs ~17 s of NumPy for the 7B on a small CPU,
    the GPU a few ms).

    background=True returns at once with the copies running on a thread of their own, on a
    stream of their own (the engine loads its kernels meanwhile); `DeviceWeights.wait()`
    joins it and re-raises its error.  preloaded: nq/runtime/preload.py's Preload of nf, whose
    arena holds the buffers and whose thread has copied (or is copying) the file into them;
    only the re-tiling is then left (or, if its copies failed, everything).  The bytes are the
    same every way.
    """
    from numba import cuda

    from nq.kernels.build import parallel_compiles
    from nq.kernels.int4.retile import compile_retile_mma, compile_retile_rows
    from nq.timeline import TIMELINE

    cfg = nf.config
    g = weight_layouts(cfg)   # the GEMVs' layouts; their kernels are the engine's to compile
    with parallel_compiles():  # a first start compiles them in parallel processes
        compile_retile_rows()
        compile_retile_mma()
    laps = {"upload kernels": TIMELINE.lap("upload kernels")}
    t0 = time.perf_counter()
    stream = stream if stream is not None else cuda.stream()
    w, items = _allocate(nf, g, stream, preloaded)
    w.startup = dict(laps, **{"weight buffers": TIMELINE.lap("weight buffers")})
    if SIMULATOR:
        _copy_plain(nf, items)
        w._keep = None
        w.load_s = time.perf_counter() - t0
        return w

    def fill() -> None:
        from nq.runtime import staging
        t = time.perf_counter()
        cuda.current_context()      # this thread's CUDA context (numba pushes the primary one)
        copied = preloaded is not None and preloaded.wait()
        plan = []
        for it in items:
            if callable(it):
                plan.append(it)
            elif not copied:
                name, dst = it
                plan.append(staging.Copy(nf.entry(name).offset, dst.nbytes,
                                         dst.__cuda_array_interface__["data"][0]))
        nbytes = staging.run(nf.path, plan, staging.CudaDevice(stream))
        w.load_s = time.perf_counter() - t
        TIMELINE.aside("weights re-tiled (copied before numba)" if copied else
                       f"weights upload ({nbytes / 1e9:.2f} GB, "
                       f"{nbytes / 1e9 / max(w.load_s, 1e-9):.1f} GB/s)", w.load_s)

    if not background:
        fill()
        w._keep = None
        return w
    w._start(fill)
    return w


def _allocate(nf, g, stream, preloaded=None):
    """(DeviceWeights with every buffer allocated and nothing copied, the copy plan): the plan is
    (tensor name, device view of its bytes) pairs, then the re-tiling launches, in stream
    order.  preloaded: the buffers are views of its arena instead of allocations of their own."""
    from numba import cuda

    from nq.kernels.int4.layout import chunk_permutation
    from nq.kernels.int4.retile import retile, retile_mma
    from nq.runtime.preload import GROUPS, buffers

    cfg = nf.config
    arrays, items = {}, []
    for b in buffers(nf):
        d = preloaded.array(b) if preloaded is not None else cuda.device_array(b.shape, b.dtype)
        arrays[b.name] = d
        row = 0
        for part in b.parts:
            rows = nf.entry(part).shape[0]
            items.append((part, d[row: row + rows]))
            row += rows
    stage_words = max(gm.n_rows * gm.k // 8 for gm in g.values())
    stage = cuda.device_array(stage_words, np.uint32)  # (largest group's rows * K/8,) uint32
    perms = {}

    def proj(kind, i, names):
        gm = g[kind]
        k8 = gm.k // 8
        qw, sc = arrays[f"layers.{i}.{kind}.qweight"], arrays[f"layers.{i}.{kind}.scales"]
        if qw.shape != (gm.n_rows, k8) or sc.shape != (gm.n_rows, gm.k // GROUP_SIZE):
            raise ValueError(f"{nf.path}: layer {i} {names} stack to {qw.shape} words and "
                             f"{sc.shape} scales, the {gm.name} kernel expects ({gm.n_rows}, "
                             f"{k8}) and ({gm.n_rows}, {gm.k // GROUP_SIZE}); re-pack with "
                             "`nq pack`")
        layout, ks = gm.tiling.layout()   # ("mma", 16) or ("rows", ks): what the kernel reads
        if layout == "mma":   # copied aside as stored, then gathered into fragments in place
            src = stage[: gm.n_rows * k8].reshape(gm.n_rows, k8)
            items.append(lambda: (src.copy_to_device(qw, stream=stream),
                                  retile_mma(src, qw, stream)))
            return
        retile_rows(qw, ks)

    def retile_rows(qw, ks):
        # each row's chunks permuted alone (`tile_rows`), through the stage buffer a slice of
        # rows at a time: one slice for a projection group (the buffer is the largest's), a
        # few for an INT4 lm_head's vocabulary of rows
        k8 = qw.shape[1]
        key = (k8 * 8, ks)
        if key not in perms:
            perms[key] = cuda.to_device(chunk_permutation(k8 * 8, ks).astype(np.int32),
                                        stream=stream)
        step = stage.shape[0] // k8
        for r in range(0, qw.shape[0], step):
            n = min(step, qw.shape[0] - r)
            src, dst = stage[: n * k8].reshape(n, k8), qw[r: r + n]
            # the rows arrived as stored: copied aside, then permuted back into place
            items.append(lambda src=src, dst=dst: (src.copy_to_device(dst, stream=stream),
                                                   retile(src, dst, perms[key], stream)))

    layers = []
    for i in range(cfg.num_layers):
        for kind, names in GROUPS:
            proj(kind, i, names)
        at = f"layers.{i}."
        layers.append(DeviceLayer(
            input_norm=arrays[at + "input_layernorm"],
            post_norm=arrays[at + "post_attention_layernorm"],
            qkv_w=arrays[at + "qkv.qweight"], qkv_s=arrays[at + "qkv.scales"],
            qkv_b=arrays[at + "qkv.bias"],
            o_w=arrays[at + "o_proj.qweight"], o_s=arrays[at + "o_proj.scales"],
            gu_w=arrays[at + "gate_up.qweight"], gu_s=arrays[at + "gate_up.scales"],
            down_w=arrays[at + "down.qweight"], down_s=arrays[at + "down.scales"]))
    embed = arrays["embed_tokens"]
    if nf.lm_head == "int8":     # `nq pack --lm-head int8`: tied or not, its own tensors
        from nq.kernels.lm_head_int8 import Int8Rows
        lm_head = Int8Rows(arrays["lm_head.qweight"], arrays["lm_head.scales"])
    elif nf.lm_head in INT4_HEADS:   # `nq pack --lm-head int4[+fp16]`: re-tiled as a projection
        from nq.kernels.lm_head_int4 import Int4Rows, head_tiling
        from nq.loader.quant import row_bounds
        lm_head = Int4Rows(arrays["lm_head.qweight"], arrays["lm_head.scales"])
        rows = rescore_rows_of(nf)      # fp16 rows at hand: the candidates are rescored
        if rows is not None:
            lm_head = lm_head._replace(
                exact=arrays[rows],
                bound=cuda.to_device(row_bounds(nf.array("lm_head.scales")), stream=stream))
        retile_rows(lm_head.qweight, head_tiling(cfg).layout()[1])
    else:
        lm_head = embed if cfg.tie_word_embeddings else arrays["lm_head"]
    w = DeviceWeights(cfg, embed=embed, norm=arrays["norm"], lm_head=lm_head, layers=layers)
    w._keep = (stage, perms, preloaded)   # the plan's launches read them until it is done
    return w, items


def _copy_plain(nf, items) -> None:
    """The plan with plain copies from the mapping (the simulator's path)."""
    from numba import cuda
    for it in items:
        if callable(it):
            it()
        else:
            name, dst = it
            dst.copy_to_device(np.ascontiguousarray(nf.array(name)))
            nf.release(name)
    cuda.synchronize()


def upload_mismatches(nf, w: DeviceWeights) -> list[str]:
    """The tensors whose device copy in w differs from the host reference (the launchers'
    `prepare` for the projections, the file's bytes for the rest): [] when the upload is exact.
    For tests and `nq verify`: it reads every buffer back."""
    g = gemvs(nf.config)
    bad = []

    def same(name, dev, want):
        got = dev.copy_to_host()
        if got.shape != want.shape or got.tobytes() != np.ascontiguousarray(want).tobytes():
            bad.append(name)

    groups = (("qkv", ("q_proj", "k_proj", "v_proj"), "qkv_w", "qkv_s"),
              ("o_proj", ("o_proj",), "o_w", "o_s"),
              ("gate_up", ("gate_proj", "up_proj"), "gu_w", "gu_s"),
              ("down", ("down_proj",), "down_w", "down_s"))
    for i, L in enumerate(w.layers):
        for kind, names, fw, fs in groups:
            qw, sc = g[kind].prepare([(nf.array(f"layers.{i}.{n}.qweight"),
                                       nf.array(f"layers.{i}.{n}.scales")) for n in names])
            same(f"layers.{i}.{kind} qweight", getattr(L, fw), qw)
            same(f"layers.{i}.{kind} scales", getattr(L, fs), sc)
        same(f"layers.{i}.qkv bias", L.qkv_b, np.concatenate(
            [nf.array(f"layers.{i}.{n}.bias") for n in ("q_proj", "k_proj", "v_proj")]))
        same(f"layers.{i}.input_layernorm", L.input_norm, nf.array(f"layers.{i}.input_layernorm"))
        same(f"layers.{i}.post_attention_layernorm", L.post_norm,
             nf.array(f"layers.{i}.post_attention_layernorm"))
    plain = [("embed_tokens", w.embed), ("norm", w.norm)]
    if nf.lm_head in INT4_HEADS:  # re-tiled: against the host's layout, as the projections
        from nq.kernels.int4.layout import prepare_weights
        from nq.kernels.lm_head_int4 import head_tiling
        qw, sc = prepare_weights([(nf.array("lm_head.qweight"), nf.array("lm_head.scales"))],
                                 head_tiling(nf.config).layout()[1])
        same("lm_head qweight", w.lm_head.qweight, qw)
        same("lm_head scales", w.lm_head.scales, sc)
        if w.lm_head.bound is not None:   # the rescoring's bounds, and its own fp16 rows
            from nq.loader.quant import row_bounds
            same("lm_head bound", w.lm_head.bound, row_bounds(nf.array("lm_head.scales")))
            if rescore_rows_of(nf) == "lm_head":
                plain.append(("lm_head", w.lm_head.exact))
    elif nf.lm_head == "int8":
        plain += [("lm_head.qweight", w.lm_head.qweight), ("lm_head.scales", w.lm_head.scales)]
    else:
        plain.append(("lm_head", w.lm_head))
    for name, dev in plain:
        same(name, dev, nf.array(name))
    return bad


def random_device_weights(cfg: ModelConfig, seed: int = 0, stream=0,
                          lm_head: str = "fp16") -> DeviceWeights:
    """Weights of cfg's shapes, made on the GPU: INT4 nibbles uniform in [-8, 7] with scales
    that give each projection output unit scale for unit inputs, norms near 1.  lm_head="int8",
    "int4" or "int4+fp16": the head as `nq pack --lm-head ...` stores it (bytes or nibbles
    uniform, the fp16 head's spread; int4+fp16 and a tied int4 with fp16 rows to rescore its
    candidates, random ones unrelated to the INT4 rows: for timing)."""
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
    if lm_head == "int8":        # bytes uniform in [-128, 127] have std ~74
        from nq.kernels.lm_head_int8 import Int8Rows
        q = cuda.device_array((cfg.vocab_size, h), np.int8)
        fill_u32(q.view(np.uint32), next(counter), stream)
        head = Int8Rows(q, cuda.to_device(np.full(cfg.vocab_size, 0.98 / (74 * np.sqrt(h)),
                                                  np.float32), stream=stream))
    elif lm_head in INT4_HEADS:  # as a projection, the fp16 head's spread (1.7 / sqrt(h))
        from nq.kernels.lm_head_int4 import Int4Rows
        from nq.loader.weights import rescore_enabled
        from nq.loader.quant import row_bounds
        q, sc = int4(cfg.vocab_size, h)
        fill_f16(sc, next(counter), 1.7 / (4.6 * np.sqrt(h)), 0.25 * 1.7 / (4.6 * np.sqrt(h)),
                 stream)
        head = Int4Rows(q, sc)
        # fp16 rows to rescore with, as a file of this kind has them: the tied embedding or
        # (int4+fp16) their own
        if rescore_enabled() and (cfg.tie_word_embeddings or lm_head == "int4+fp16"):
            exact = embed if cfg.tie_word_embeddings else f16((cfg.vocab_size, h), 0.0,
                                                                1.7 / np.sqrt(h))
            head = head._replace(exact=exact, bound=cuda.to_device(
                row_bounds(sc.copy_to_host(stream=stream)), stream=stream))
    else:
        head = embed if cfg.tie_word_embeddings else f16((cfg.vocab_size, h), 0.0, 1.7 / np.sqrt(h))
    w = DeviceWeights(cfg, embed=embed, norm=f16((h,), 1.0, 0.1), lm_head=head, layers=layers)
    cuda.synchronize()
    w.load_s = time.perf_counter() - t0
    return w
