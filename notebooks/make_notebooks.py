"""Writes the notebooks of this folder from the cell lists below (no jupyter needed to build).

    python3 notebooks/make_notebooks.py

Each notebook runs from the repository root (`jupyter lab` started there, or
tests/test_notebooks.py, which executes every code cell not tagged "gpu" in CI).
"""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def md(text):
    return {"cell_type": "markdown", "metadata": {}, "source": text.strip("\n")}


def code(text, *tags):
    return {"cell_type": "code", "metadata": {"tags": list(tags)}, "execution_count": None,
            "outputs": [], "source": text.strip("\n")}


INT4 = [
    md("""
# INT4 ValueShuffle: why the nibbles are stored out of order

A `.nanoqwen` weight word (uint32) holds eight signed 4-bit weights of one row in the order
`[w0, w2, w4, w6, w1, w3, w5, w7]`, lowest nibble first (layout id 1, `docs/FORMAT.md`).
This notebook shows why, with the same Python twins of the PTX instructions that the GEMV
kernel executes (`nq/ptx`), and then looks at the kernel's own PTX for sm_90 — all on a CPU.
"""),
    code("""
import os, sys
sys.path.insert(0, os.getcwd())  # run from the repository root
import numpy as np
from nq.loader.quant import quantize_int4, pack_value_shuffle, unpack_value_shuffle, dequantize_packed
from nq import ptx as P

rng = np.random.default_rng(5)
w = rng.standard_normal((2, 256)).astype(np.float32)   # 2 rows, 2 groups of 128
q, scales = quantize_int4(w)                             # int8 in [-7, 7], fp16 (2, 2)
packed = pack_value_shuffle(q)                           # uint32 (2, 32)
word = int(packed[0, 0])
print("w0..w7 =", q[0, :8].tolist())
print("word   = 0x%08X" % word)
print("nibbles from the lowest:", [((word >> (4 * i)) & 0xF) for i in range(8)])
"""),
    md("""
Masking `0x000F000F` keeps nibbles 0 and 4: **w0 and w1**, one in each 16-bit half, which is
the shape of an fp16x2 register. OR-ing the fp16 exponent of 1024 (0x6400) onto a nibble n
gives the fp16 value 1024 + n exactly. The nibbles are two's complement, so the kernel also
flips bit 3 (n XOR 8 = n + 8 for 4-bit n): one `lop3` computes `(q & 0x000F000F) ^ 0x64086408`
= fp16x2 (1032 + w0, 1032 + w1), and one `add.f16x2` of -1032 leaves (w0, w1) exactly.
"""),
    code("""
def f16x2(u):
    lo, hi = P.unpack_f16x2_to_f32.twin(np.uint32(u))
    return float(lo), float(hi)

lo = P.lop3_b32.twin(word, 0x000F000F, 0x64086408, P.LUT_AND_XOR)
print("lop3 ->", f16x2(lo))
pair = P.add_rn_f16x2.twin(lo, 0xE408E408)            # fp16x2 (-1032, -1032)
print("(w0, w1) =", f16x2(pair), " expected", tuple(q[0, :2].tolist()))
"""),
    md("""
The nibbles at bits 4-7 and 20-23 (w2, w3) are masked the same way with `0x00F000F0`, which
gives 1024 + 16(n + 8); one `fma.f16x2` by 1/16 and -72 brings them back to n. Shifting the
word right by 8 exposes w4..w7 in the same two positions. Eight weights: one shift, four
`lop3`, two adds and two fmas, then four `fma.f16x2` with the activations. Every nibble value
is checked below.
"""),
    code("""
def dequant_word(u):
    out = []
    for v in (u, u >> 8):
        lo = P.add_rn_f16x2.twin(P.lop3_b32.twin(v, 0x000F000F, 0x64086408, P.LUT_AND_XOR), 0xE408E408)
        hi = P.fma_rn_f16x2.twin(P.lop3_b32.twin(v, 0x00F000F0, 0x64806480, P.LUT_AND_XOR),
                                 0x2C002C00, 0xD480D480)   # x * 1/16 - 72
        out += [f16x2(lo), f16x2(hi)]
    (a, b), (c, d), (e, f), (g, h) = out
    return [a, b, c, d, e, f, g, h]                     # w0 .. w7 in order

every = np.array([[n0, n1, n0, n1, n1, n0, n1, n0] for n0 in range(-8, 8) for n1 in range(-8, 8)], np.int8)
words = pack_value_shuffle(every)[:, 0]
assert all(dequant_word(int(u)) == list(map(float, row)) for u, row in zip(words, every))
print("all", len(words), "nibble pairs dequantise exactly; w =", dequant_word(word))
assert np.array_equal(unpack_value_shuffle(packed), q)
assert np.array_equal(dequantize_packed(packed, scales), q.astype(np.float32) * np.repeat(scales.astype(np.float32), 128, axis=1))
"""),
    md("""
## The kernel that does this

`nq/kernels/gemv_int4.py` builds one kernel per (kind, N, K, tiling) at JIT time. Numba
compiles it to PTX for sm_90 with no GPU present; the wrappers' instructions appear verbatim.
"""),
    code("""
from tests.ptx_util import compile_ptx_sm90, count
from nq.kernels import gemv_int4 as G
from nq.config import PRESETS

cfg = PRESETS["7b"]
t = G.default_tiling("gate_up", cfg.intermediate_size, cfg.hidden_size)
pyfunc, sig = G.build_kernel("gate_up", cfg.intermediate_size, cfg.hidden_size, t, cfg.rms_norm_eps)
ptx = compile_ptx_sm90(pyfunc, sig)
print(t)
for ins in ("ld.global.nc.v4.u32", "lop3.b32", "fma.rn.f16x2", "add.rn.f16x2", "ld.local", "st.local"):
    print(f"{ins:22s}", count(ptx, ins))
"""),
    md("""
## On a GPU

The same kernel against its NumPy reference (this cell needs an NVIDIA sm_90 GPU and is
skipped by the CPU test of this notebook).
"""),
    code("""
from numba import cuda
from nq.loader.quant import quantize_pack
from nq.ref import rms_norm, swiglu

if cuda.is_available():
    gu = G.make_gate_up_gemv(cfg)
    wg = rng.standard_normal((cfg.intermediate_size, cfg.hidden_size)).astype(np.float32) / 60
    wu = rng.standard_normal((cfg.intermediate_size, cfg.hidden_size)).astype(np.float32) / 60
    (gq, gs), (uq, us) = quantize_pack(wg), quantize_pack(wu)
    qw, sc = gu.prepare([(gq, gs), (uq, us)])
    x = rng.standard_normal(cfg.hidden_size).astype(np.float32)
    nw = np.ones(cfg.hidden_size, np.float16)
    out = cuda.device_array(cfg.intermediate_size, np.float16)
    gu(cuda.to_device(x), cuda.to_device(nw), cuda.to_device(qw), cuda.to_device(sc), out)
    h = rms_norm(x, nw, cfg.rms_norm_eps)
    ref = swiglu(h @ dequantize_packed(gq, gs).T, h @ dequantize_packed(uq, us).T)
    got = out.copy_to_host().astype(np.float32)
    print("max |gpu - ref| / max |ref| =", np.abs(got - ref).max() / np.abs(ref).max())
""", "gpu"),
]


FLOOR = [
    md("""
# The 7B decode step against its byte floor

Batch-1 decode is a stream of weights: every token reads each weight once. This notebook
computes, from `ModelConfig` alone, the bytes each region of the step must move and the time
that takes at the copy ceiling, then reads the figures `nq bench` measured on an H200
(`docs/figures/bench_7b.json`, written by `nq bench --random 7b ... --json`) and sets them side
by side. Re-run it on your own JSON to see where your GPU spends the step.
"""),
    code("""
import json, os, sys
sys.path.insert(0, os.getcwd())  # run from the repository root
from nq.config import GROUP_SIZE, PRESETS

cfg = PRESETS["7b"]
run = json.load(open("docs/figures/bench_7b.json"))
ceiling = run["copy_ceiling_GBs"] * 1e9           # bytes/s, device-to-device copy, same run

def int4_bytes(n, k):                             # nibbles + one fp16 scale per 128 weights
    return n * k // 2 + n * (k // GROUP_SIZE) * 2

L, H, I = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
ctx = run["breakdown"][0]["ctx"]
bytes_per_region = {
    "qkv_gemv": L * int4_bytes(cfg.qkv_size, H),
    "o_proj": L * int4_bytes(H, cfg.q_size),
    "gate_up_swiglu": L * 2 * int4_bytes(I, H),
    "down": L * int4_bytes(H, I),
    "lm_head": cfg.vocab_size * H * 2,
    "paged_attention": L * 2 * ctx * cfg.num_kv_heads * cfg.head_dim * 2,
}
print(f"context {ctx}; ceiling {ceiling / 1e12:.2f} TB/s")
"""),
    code("""
measured = run["breakdown"][0]["regions_ms"]
print(f"{'region':18s} {'GB':>6s} {'floor ms':>9s} {'measured':>9s} {'of floor':>9s}")
total_floor = 0.0
for region, b in bytes_per_region.items():
    floor = b / ceiling * 1e3
    total_floor += floor
    print(f"{region:18s} {b / 1e9:6.3f} {floor:9.3f} {measured[region]:9.3f} {100 * floor / measured[region]:8.0f} %")
itl = run["breakdown"][0]["itl_ms"]
print(f"{'step':18s} {'':6s} {total_floor:9.3f} {itl:9.3f} {100 * total_floor / itl:8.0f} %")
print("kernel_gap (launch and host overhead inside the graph):", round(run["breakdown"][0]["kernel_gap_ms"], 3), "ms")
"""),
    md("""
The GEMVs that read most (gate_up, down) run closest to the floor; the small ones (qkv,
o_proj) and attention at short context are dominated by fixed per-launch costs, which is
where `docs/PERF.md` expects the next 0.25 ms to come from.
"""),
    code("""
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    plt = None
if plt is not None:
    regions = list(bytes_per_region)
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh(regions, [measured[r] for r in regions], label="measured")
    ax.barh(regions, [bytes_per_region[r] / ceiling * 1e3 for r in regions], label="byte floor")
    ax.set_xlabel("ms per token"); ax.legend(); fig.tight_layout()
"""),
]


def write(name, cells):
    nb = {"nbformat": 4, "nbformat_minor": 5,
          "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                       "language_info": {"name": "python"}},
          "cells": cells}
    for i, c in enumerate(nb["cells"]):
        c["id"] = f"{name.split('.')[0][:20]}-{i}"
    (HERE / name).write_text(json.dumps(nb, indent=1) + "\n")


if __name__ == "__main__":
    write("01_int4_valueshuffle.ipynb", INT4)
    write("02_decode_step_floor.ipynb", FLOOR)
