"""Quantised-lm_head files on the device, under the CUDA simulator: runtime.weights.upload puts
lm_head.qweight and lm_head.scales there as the head's pair (tied models beside their fp16
embedding) -- int8 as the file holds them (Int8Rows), INT4 re-tiled on the device in slices
of rows as the launcher's host `prepare` lays them out (Int4Rows; 1800 rows are more than the
stage buffer's 768, so three slices, the last short); upload_mismatches compares either --
and the launcher the engine's step asks for (`lm_head.make_lm_head(cfg, weights.lm_head)`) is
that head's kernel, which computes the head of the reference engine's host weights (the
file's head dequantised); a tied INT4 head's candidates then rescored by the embedding's fp16
rows (nq/kernels/lm_head_rescore.py), as its reference says."""
import numpy as np
import pytest

from nq.config import tiny_config
from nq.loader.hf import pack
from nq.loader.synth import make_hf_snapshot

SIM = r"""
import sys
import numpy as np
from numba import cuda
sys.path.insert(0, "tests")
import sim_warp
sim_warp.patch_simulator()
from nq.kernels.lm_head import make_lm_head, ref_lm_head
from nq.kernels.lm_head_int4 import Int4Rows, LmHeadInt4
from nq.kernels.lm_head_int8 import Int8Rows, LmHeadInt8
from nq.kernels.lm_head_rescore import ref_rescore
from nq.loader.format import NanoqwenFile
from nq.loader.weights import load_host_weights
from nq.runtime.weights import upload, upload_mismatches
PAIR = {"int8": (Int8Rows, LmHeadInt8, dict(threads=64, grid=2)),
        "int4": (Int4Rows, LmHeadInt4, dict(grid=2))}    # int4: the upload's tiling
for tag, path in PATHS:
    nf = NanoqwenFile(path)
    rows, launcher, tiling = PAIR[nf.lm_head]
    w = upload(nf)
    print(f"mismatches_{tag}", len(upload_mismatches(nf, w)))
    print(f"not_pair_{tag}", float(not isinstance(w.lm_head, rows)))
    print(f"shared_{tag}", float(w.lm_head.qweight is w.embed))
    head = make_lm_head(nf.config, w.lm_head, **tiling)
    print(f"launcher_{tag}", float(not isinstance(head, launcher)))
    host = load_host_weights(nf)
    x = np.random.default_rng(0).standard_normal(nf.config.hidden_size).astype(np.float32)
    out = cuda.to_device(np.full(nf.config.vocab_size, np.nan, np.float32))
    head(cuda.to_device(x), w.norm, w.lm_head, out)
    ref = ref_lm_head(x, host["norm"], nf.config.rms_norm_eps, host["lm_head"])
    rescored = getattr(w.lm_head, "exact", None) is not None
    print(f"rescored_{tag}", float(rescored))
    if rescored:   # a tied INT4 head: the candidates' logits from the fp16 embedding
        ref = ref_rescore(ref, w.lm_head.bound.copy_to_host(), x, nf.array("norm"),
                          nf.config.rms_norm_eps, nf.array("embed_tokens"))[0]
    got = out.copy_to_host()
    print(f"err_{tag}", float(np.abs(got - ref).max() / np.abs(ref).max()))
"""


@pytest.mark.slow
@pytest.mark.parametrize("head,vocab", [("int8", 512), ("int4", 1800)])
def test_upload_and_head_of_a_quantised_head_file_under_the_simulator(tmp_path, head, vocab):
    from ptx_util import run_under_simulator
    paths = []
    for tie in (False, True):
        cfg = tiny_config(num_layers=1, tie=tie, vocab_size=vocab)
        snap = make_hf_snapshot(tmp_path / f"s{tie}", cfg, seed=1)
        paths.append((f"tied{int(tie)}", str(pack(snap, tmp_path / f"m{tie}.nanoqwen",
                                                    progress=False, lm_head=head))))
    errs, out = run_under_simulator(SIM.replace("PATHS", repr(paths)), timeout=900)
    for tag in ("tied0", "tied1"):
        assert errs[f"mismatches_{tag}"] == 0 and errs[f"not_pair_{tag}"] == 0, out
        assert errs[f"shared_{tag}"] == 0 and errs[f"launcher_{tag}"] == 0, out
        # a tied INT4 head is rescored by the embedding's rows; nothing else is
        assert errs[f"rescored_{tag}"] == (head == "int4" and tag == "tied1"), out
        # int8: fp32 sums (test_lm_head_int8_cpu.py); int4: exact group sums by dp4a, fp32
        # across groups (test_lm_head_int4_cpu.py)
        assert errs[f"err_{tag}"] < (1e-6 if head == "int8" else 5e-6), out
    assert np.isfinite(list(errs.values())).all()
