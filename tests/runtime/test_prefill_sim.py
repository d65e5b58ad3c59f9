"""The batched prefill (nq/runtime/prefill.py) under the CUDA simulator, on the tiny model:
the real orchestrator and the real kernels (embed_rows, rmsnorm_rows, the INT4 GEMMs reading
the uploaded decode layouts, rope_kv_rows, prefill attention), in chunks that continue a
context, against nq.ref's forward pass.  The GPU twin of this test is
tests/runtime/test_engine_gpu.py's prefill tests."""
import pytest

from ptx_util import run_under_simulator

SCRIPT = r"""
import sys, types
import numpy as np
from numba import cuda
sys.path.insert(0, "tests")
import sim_warp
sim_warp.install()              # the vectorised whole-warp mma model (bit for bit the twin's)
sim_warp.patch_simulator()      # warp shuffles as a rendezvous of the warp
from nq.loader.format import NanoqwenFile
from nq.loader.weights import load_host_weights
from nq.paged import gather_kv, pool_shape, pages_for
from nq.ref import KVCache, RefModel
from nq.kernels.rope_kv import rope_inv_freq
from nq.runtime.prefill import Prefill
from nq.runtime.weights import upload

nf = NanoqwenFile(PATH)
cfg = nf.config
ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 13).astype(np.int32)
max_len = 32
n_pages = pages_for(max_len)
table = np.arange(n_pages, dtype=np.int32)[::-1].copy()   # pages out of order on purpose
eng = types.SimpleNamespace(cfg=cfg, w=upload(nf), max_len=max_len, prompt=cuda.to_device(ids),
                            inv_freq=cuda.to_device(rope_inv_freq(cfg.head_dim, cfg.rope_theta)),
                            d_table=cuda.to_device(table),
                            kv=cuda.to_device(np.zeros(pool_shape(cfg, n_pages), np.float16)))
pre = Prefill(eng, chunk=8)               # 13 tokens: a chunk of 8, then 5 continuing it
pre.run(0, 0, 8, 0)
pre.run(8, 8, 5, 0)
x = pre.x.copy_to_host()[:5]              # the residual stream of the second chunk

model = RefModel(cfg, load_host_weights(nf))
cache = KVCache(cfg, max_len=max_len)
pos = np.arange(13)
h = model.w["embed_tokens"][ids]
for i in range(cfg.num_layers):
    h = model.layer(i, h, pos, cache)
ref = h[8:]
print("x_rel", float(np.linalg.norm(x - ref) / np.linalg.norm(ref)))
kv = eng.kv.copy_to_host()
worst = 0.0
for i in range(cfg.num_layers):
    k, v = gather_kv(kv[i], table, 13)
    rk, rv = cache.keys(i, 13), cache.values(i, 13)
    worst = max(worst, float(np.abs(k - rk).max() / np.abs(rk).max()),
                float(np.abs(v - rv).max() / np.abs(rv).max()))
print("kv_rel", worst)
"""


@pytest.mark.long   # 13 minutes of simulated threads on 2 cores: `python3 -m pytest -m long`
def test_batched_prefill_under_the_simulator_matches_the_reference(tiny_nanoqwen):
    vals, out = run_under_simulator(SCRIPT.replace("PATH", repr(str(tiny_nanoqwen))), timeout=900)
    # fp16 activations into the GEMMs (2^-11 relative a value), fp16 K/V pages and P in the
    # attention, fp32 accumulation everywhere, over 2 layers: ~1e-3 of the stream's norm; the
    # K/V pages are fp16 roundings of fp32 values computed from fp16 inputs
    assert vals["x_rel"] < 5e-3, out
    assert vals["kv_rel"] < 5e-3, out
