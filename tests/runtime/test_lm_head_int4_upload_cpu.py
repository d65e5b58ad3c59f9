"""An INT4-lm_head file on the device, under the CUDA simulator: runtime.weights.upload puts
lm_head.qweight and lm_head.scales there as an Int4Rows pair (tied models beside their fp16
embedding), the words re-tiled on the device in slices of rows as the launcher's host
`prepare` lays them out (upload_mismatches compares), and the launcher the engine's step asks
for (`lm_head.make_lm_head(cfg, weights.lm_head)`) is the INT4 kernel, which computes the head
of the reference engine's host weights (dequantised)."""
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
from nq.loader.format import NanoqwenFile
from nq.loader.weights import load_host_weights
from nq.runtime.weights import upload, upload_mismatches
for tag, path in PATHS:
    nf = NanoqwenFile(path)
    w = upload(nf)
    print(f"mismatches_{tag}", len(upload_mismatches(nf, w)))
    print(f"not_int4_{tag}", float(not isinstance(w.lm_head, Int4Rows)))
    print(f"shared_{tag}", float(w.lm_head.qweight is w.embed))
    head = make_lm_head(nf.config, w.lm_head, grid=2)   # the default tiling: the upload's
    print(f"launcher_{tag}", float(not isinstance(head, LmHeadInt4)))
    host = load_host_weights(nf)
    x = np.random.default_rng(0).standard_normal(nf.config.hidden_size).astype(np.float32)
    out = cuda.to_device(np.full(nf.config.vocab_size, np.nan, np.float32))
    head(cuda.to_device(x), w.norm, w.lm_head, out)
    ref = ref_lm_head(x, host["norm"], nf.config.rms_norm_eps, host["lm_head"])
    got = out.copy_to_host()
    print(f"err_{tag}", float(np.abs(got - ref).max() / np.abs(ref).max()))
"""


@pytest.mark.slow
def test_upload_and_head_of_an_int4_file_under_the_simulator(tmp_path):
    from ptx_util import run_under_simulator
    paths = []
    for tie in (False, True):
        # 1800 rows: more than the stage buffer's (gate_up's 768), so the head is re-tiled
        # in three slices, the last short
        cfg = tiny_config(num_layers=1, tie=tie, vocab_size=1800)
        snap = make_hf_snapshot(tmp_path / f"s{tie}", cfg, seed=1)
        paths.append((f"tied{int(tie)}", str(pack(snap, tmp_path / f"m{tie}.nanoqwen",
                                                    progress=False, lm_head="int4"))))
    errs, out = run_under_simulator(SIM.replace("PATHS", repr(paths)), timeout=900)
    for tag in ("tied0", "tied1"):
        assert errs[f"mismatches_{tag}"] == 0 and errs[f"not_int4_{tag}"] == 0, out
        assert errs[f"shared_{tag}"] == 0 and errs[f"launcher_{tag}"] == 0, out
        assert errs[f"err_{tag}"] < 5e-6, out    # exact group sums; test_lm_head_int4_cpu.py
    assert np.isfinite(list(errs.values())).all()
