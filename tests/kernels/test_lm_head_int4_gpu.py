"""GPU tests of the INT4 lm_head (nq/kernels/lm_head_int4.py) against fp64 (H200: -m gpu).

The weights are random INT4 g128 rows in the packer's format (nq/loader/quant.py: every
nibble value, fp16 group scales), put in the kernel's layout by the launcher's `prepare`; the
reference is the same GEMV in fp64 over the dequantised rows, h = rmsnorm(x) included.  The
vocabularies are cut to 20,011 rows (each preset's width, 625+ row blocks for a grid of 264:
a block walks several), so the host's fp64 reference stays small.  Outputs are poisoned with NaN first, so an
unwritten row fails.

Tolerance 1e-5 of the logits' largest magnitude with the digits (the default: each group's
products summed exactly by dp4a, fp32 across groups; 1.7e-6 in the simulator), 5e-3 with the
fp16 staging (fp16 partial sums, gemv.py's module doc).
"""
from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from numba import cuda  # noqa: E402  (the marker deselects this module on CPU-only runs)

from nq.config import PRESETS  # noqa: E402
from nq.kernels import lm_head_int4 as L  # noqa: E402
from nq.kernels.int4.tiling import Tiling  # noqa: E402
from nq.kernels.lm_head import make_lm_head  # noqa: E402
from nq.loader.quant import dequantize_packed  # noqa: E402

VOCAB = 20011


def run(vocab, k, seed, **tiling):
    rng = np.random.default_rng(seed)
    cfg = SimpleNamespace(vocab_size=vocab, hidden_size=k, rms_norm_eps=1e-6)  # all it reads
    x = (rng.standard_normal(k) * 2).astype(np.float32)
    x[3] = 300.0                                                   # an outlier channel
    nw = (1 + 0.2 * rng.standard_normal(k)).astype(np.float16)
    qw = rng.integers(0, 2 ** 32, size=(vocab, k // 8), dtype=np.uint32)
    sc = rng.uniform(1e-3, 2e-3, size=(vocab, k // 128)).astype(np.float16)
    head = make_lm_head(cfg, L.Int4Rows(None, None), **tiling)
    assert isinstance(head, L.LmHeadInt4)
    w = L.Int4Rows(*(cuda.to_device(a) for a in head.prepare(qw, sc)))
    out = cuda.to_device(np.full(vocab, np.nan, np.float32))
    head(cuda.to_device(x), cuda.to_device(nw), w, out, 0)
    got = out.copy_to_host()
    assert np.isfinite(got).all(), f"{int((~np.isfinite(got)).sum())} rows not written"
    x64 = x.astype(np.float64)
    h = x64 / np.sqrt(np.mean(x64 * x64) + cfg.rms_norm_eps) * nw.astype(np.float64)
    return got, dequantize_packed(qw, sc).astype(np.float64) @ h, head


@pytest.mark.parametrize("size", ["7b", "0.5b", "32b"])
def test_lm_head_int4_against_fp64(size):
    cfg = PRESETS[size]
    got, ref, head = run(VOCAB, cfg.hidden_size, seed=cfg.hidden_size)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert head.tiling.i8 and err < 1e-5, err


@pytest.mark.parametrize("tiling", [dict(tiling=Tiling(ks=4, rows=1, threads=256, i8=1)),
                                    dict(tiling=Tiling(ks=4, rows=2, threads=128, i8=1,
                                                       early=1), grid=7),
                                    dict(tiling=Tiling(ks=8, rows=1, threads=256)),
                                    dict(blocks_per_sm=1)], ids=str)
@pytest.mark.parametrize("vocab,k", [(VOCAB, 3584), (1001, 640)])
def test_lm_head_int4_tilings(vocab, k, tiling):
    """An odd vocabulary (a part-empty last row block), a grid far smaller than the work (a
    block walks many row blocks), the fp16 staging."""
    got, ref, head = run(vocab, k, seed=vocab + k, **tiling)
    tol = 1e-5 if head.tiling.i8 else 5e-3
    assert np.abs(got - ref).max() / np.abs(ref).max() < tol


def test_default_kernel_does_not_spill_on_the_device():
    """head_tiling's min_blocks caps its registers; read the local memory of what the
    device's JIT built."""
    for size in ("7b", "0.5b", "14b", "32b"):
        for rescore in (False, True):    # the plain head, and the one bounding its rescoring
            kern = L.make_lm_head_int4(PRESETS[size], rescore=rescore).kernel
            print(size, rescore, "registers", kern.get_regs_per_thread(),
                  "local", kern.get_local_mem_per_thread())
            assert kern.get_local_mem_per_thread() == 0, (size, rescore,
                                                          kern.get_regs_per_thread())


@pytest.mark.parametrize("head,tie", [("int4", False), ("int4", True), ("int4+fp16", False)],
                         ids=["untied", "tied", "int4+fp16"])
def test_engine_with_an_int4_head_file_greedy_equals_the_reference(tmp_path, head, tie):
    """A tiny model packed with `--lm-head int4` end to end: the upload re-tiles the head as
    `prepare` does (1800 rows: three slices of the stage buffer), and 32 greedy ids equal the
    NumPy reference engine's over the file's dequantised head (tied, and `int4+fp16`: its
    candidates rescored by the fp16 rows, the embedding's or the kept lm_head's, in both)."""
    from head_files import packed_with_head
    from nq.loader.weights import load_host_weights
    from nq.ref import RefModel
    from nq.runtime.engine import Engine
    from nq.runtime.weights import upload_mismatches
    from nq.sample import SamplingParams

    cfg, nf = packed_with_head(tmp_path, head, tie)
    eng = Engine.from_file(nf, max_len=128)
    assert isinstance(eng.w.lm_head, L.Int4Rows) and upload_mismatches(nf, eng.w) == []
    host = load_host_weights(nf)   # tied: with the embedding's rows, to rescore as the step
    rescored = tie or head == "int4+fp16"
    assert (eng.w.lm_head.exact is not None) == rescored == ("lm_head.exact" in host)
    ref = RefModel(cfg, host)
    prompt = [5, 17, 99, 3, 1200, 42, 7]
    ref.reset()
    logits, want = ref.forward(np.array(prompt))[-1], []
    for _ in range(32):
        want.append(int(np.argmax(logits)))
        logits = ref.forward(np.array([want[-1]]))[-1]
    eng.reset()
    got = list(eng.generate_ids(prompt, 32, SamplingParams(temperature=0.0, repeat_penalty=1.0)))
    assert got == want
