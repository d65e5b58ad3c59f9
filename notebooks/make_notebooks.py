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

`nq/kernels/int4/gemv.py` builds one kernel per (kind, N, K, tiling) at JIT time, named after
every constant it bakes in. Numba compiles it to PTX for sm_90 with no GPU present; the
wrappers' instructions appear verbatim.
"""),
    code("""
from tests.ptx_util import compile_ptx_sm90, count
from nq.kernels import int4
from nq.kernels.int4 import gemv
from nq.config import PRESETS

cfg = PRESETS["7b"]
# the CUDA-core tiling: gate_up's default is now the tensor-core GEMV (gemv_mma.py)
t = int4.default_tiling("gate_up", cfg.intermediate_size, cfg.hidden_size, mma=False)
pyfunc, sig = gemv.build_kernel("gate_up", cfg.intermediate_size, cfg.hidden_size, t, cfg.rms_norm_eps)
ptx = compile_ptx_sm90(pyfunc, sig)
print(gemv.gemv_name("gate_up", cfg.intermediate_size, cfg.hidden_size, t, cfg.rms_norm_eps))
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
    gu = int4.make_gate_up_gemv(cfg)
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
gate_up and lm_head, which read the most, run closest to the floor; down (on the tensor cores,
notebook 03) is next; the small ones (qkv, o_proj) and attention at short context are held by
the fixed cost of a dependent kernel, not by their bytes (`docs/PERF.md` has the list of what
was tried and what is left).
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


MMA = [
    md("""
# The tensor-core GEMV: an INT4 word as the A fragment of an mma

`nq/kernels/int4/gemv_mma.py` runs o_proj and down (x += W . a) on the tensor cores.  Why: on the
CUDA cores the 7B's down GEMV was issue-bound, not memory-bound (ncu: 38 % of DRAM peak);
per 8 weights it spent 9 instructions on the dequant and 4 `fma.f16x2` on the dot.  Here the
same 9 instructions produce the A operand of one `mma.sync.m16n8k16` (fp16 in, fp32 out),
which replaces the 4 fmas, and one 8-byte B fragment of activations serves all 16 rows of a
tile.  Measured in the 7B step graph: -0.14 ms a token (2.03 -> 1.88 ms, `docs/PERF.md`).

The trick is the weight layout: the upload re-orders each 16-row tile so that the word a lane
loads *is* its A fragment after the ValueShuffle dequant.  This notebook checks that on a CPU
with the Python twins of the PTX instructions, then looks at the kernel's PTX.
"""),
    code("""
import os, sys
sys.path.insert(0, os.getcwd())  # run from the repository root
import numpy as np
from nq import ptx as P
from nq.ptx.mma import a_coords, mma_m16n8k16_f16_f32_warp
from nq.kernels.int4.layout import mma_layout
from nq.loader.quant import quantize_int4, pack_value_shuffle

rng = np.random.default_rng(7)
w = rng.standard_normal((16, 128)).astype(np.float32)   # one 16-row tile, one group of 128
q, scales = quantize_int4(w)                             # int8 in [-7, 7], fp16 (16, 1)
file_words = pack_value_shuffle(q)                       # (16, 16): the file's row-major words
frag = mma_layout(file_words).reshape(32, 8)           # [lane][8 words]: a warp's group
print("lane 5 loads the words", [hex(int(u)) for u in frag[5, :2]], "...")
"""),
    md("""
Word j of lane (g, t) = (lane // 4, lane % 4) covers columns 16j..16j+15 of the group.  The
dequant of notebook 01 (`lop3`, `add.f16x2`, `fma.f16x2`) turns it into four fp16x2 registers;
the PTX ISA says register a_r of lane (g, t) must hold A[g + 8(r % 2), 2t + 8(r // 2) + {0, 1}]
(`nq.ptx.mma.a_coords`).  Every lane, every word:
"""),
    code("""
def dequant_word(u):            # the 9 instructions of nq/kernels/int4/dequant.dequant_word
    regs = []
    for v in (u, u >> 8):
        regs.append(P.add_rn_f16x2.twin(P.lop3_b32.twin(v, 0x000F000F, 0x64086408, P.LUT_AND_XOR),
                                        0xE408E408))
        regs.append(P.fma_rn_f16x2.twin(P.lop3_b32.twin(v, 0x00F000F0, 0x64806480, P.LUT_AND_XOR),
                                        0x2C002C00, 0xD480D480))
    return [int(r) for r in regs]   # a0, a1, a2, a3

def halves(u):
    return np.array([u & 0xFFFF, u >> 16], np.uint16).view(np.float16).astype(np.float32)

for lane in range(32):
    for j in range(8):
        for r, reg in enumerate(dequant_word(int(frag[lane, j]))):
            for half, value in enumerate(halves(reg)):
                row, col = a_coords(lane, r, half)
                assert value == q[row, 16 * j + col]
print("all 32 lanes x 8 words are A fragments of the tile, exactly")
"""),
    md("""
B is 16x8 (K x N).  Its 8 columns are all the activation vector, so every column of D is the
dot product; lane (g, t) holds rows g (d0) and g + 8 (d2).  The kernel stages `a` in shared
memory so that a lane's b0, b1 are one 8-byte load.  Eight mmas (one per word) make a group;
the group's fp32 sum times the row's scale is added to the warp's accumulator.  The whole-warp
model of the mma (`mma_m16n8k16_f16_f32_warp`) against NumPy:
"""),
    code("""
a = (rng.standard_normal(128) * 2).astype(np.float16)
def pair(x0, x1):
    return int(np.array([x0, x1], np.float16).view(np.uint32)[0])

d = np.zeros((32, 4), np.float32)
for j in range(8):
    A = np.array([dequant_word(int(frag[lane, j])) for lane in range(32)], np.uint32)
    c = a[16 * j:16 * j + 16]
    B = np.array([[pair(c[2 * (l % 4)], c[2 * (l % 4) + 1]),
                   pair(c[2 * (l % 4) + 8], c[2 * (l % 4) + 9])] for l in range(32)], np.uint32)
    d = mma_m16n8k16_f16_f32_warp(A, B, d)
rows = np.concatenate([d[0::4, 0], d[0::4, 2]])           # lanes t = 0: rows 0..7, then 8..15
want = q.astype(np.float64) @ a.astype(np.float64)
print("max |mma - q.a| =", np.abs(rows - want).max())   # fp16 x small integers: exact in fp32
y = rows * scales[:, 0].astype(np.float32)               # then the row's scale
"""),
    md("""
## The kernel

`build_kernel` specialises one kernel per (kind, N, K, tiling).  The 7B's down: a block of 32
warps holds two tiles; the 16 warps of a tile split its 148 groups (`MmaTiling.warps`), each with
the next group's loads in flight; their partials meet in shared memory and one thread a row
adds them in a fixed order (deterministic).  The PTX for sm_90, no GPU needed:
"""),
    code("""
from tests.ptx_util import compile_ptx_sm90, count
from nq.config import PRESETS
from nq.kernels import int4
from nq.kernels.int4 import gemv_mma

cfg = PRESETS["7b"]
t = int4.default_tiling("down", cfg.hidden_size, cfg.intermediate_size)
pyfunc, sig = gemv_mma.build_kernel("down", cfg.hidden_size, cfg.intermediate_size, t)
ptx = compile_ptx_sm90(pyfunc, sig)
print(t.tag())
for ins in ("mma.sync.aligned.m16n8k16", "lop3.b32", "ld.global.nc.v4.u32", "ld.shared.v2.u32",
            "ld.local", "st.local"):
    print(f"{ins:28s}", count(ptx, ins))
"""),
    md("""
Per group a warp issues 8 mmas and 32 `lop3` (4 per word); the loop body handles two groups
(two register sets taking turns), hence 16 and 64, and nothing spills to local memory.  To
try another shape, change the tiling and time it inside the whole step graph on a GPU, e.g.

    python3 scripts/step_variants.py --ctx 512,8192 "down.warps=8" "down.threads=512" "o_proj.mma=0"

(`docs/KERNELS_GEMV.md` lists what was measured: more warps a tile, and three variants that
lost and were retired -- two groups in flight, split-K across blocks, gate_up on the tensor
cores; their code is at commit 13c221c).
"""),
    code("""
from numba import cuda

if cuda.is_available():
    from nq.loader.quant import dequantize_packed, quantize_pack
    n, k = cfg.hidden_size, cfg.intermediate_size
    g = int4.make_down_gemv(cfg)                  # the default: gemv_mma on the tensor cores
    qw, sc = quantize_pack(rng.standard_normal((n, k)).astype(np.float32) / 100)
    pq, ps = g.prepare([(qw, sc)])                # the file layout -> mma_layout
    act = (rng.standard_normal(k)).astype(np.float16)
    x = np.zeros(n, np.float32)
    xd = cuda.to_device(x)
    g(cuda.to_device(act), cuda.to_device(pq), cuda.to_device(ps), xd)
    ref = dequantize_packed(qw, sc).astype(np.float64) @ act.astype(np.float64)
    got = xd.copy_to_host()
    print("relative error against fp64:", np.linalg.norm(got - ref) / np.linalg.norm(ref))
""", "gpu"),
]


DIGITS = [
    md("""
# qkv's activations as digits: exact sums with dp4a

`nq/kernels/int4/gemv_digits.py` is how the CUDA-core qkv GEMV sums in fp32 or better.  Its
fp16 form (`gemv.py`) multiplied fp16 activations into fp16 partial sums: ~1e-3 of the output,
the largest error left in the decode step once gate_up and o_proj moved to the int8 tensor
cores.  Here each staged activation becomes three signed bytes ("digits"), each weight word's
eight nibbles become two words of signed bytes, and `dp4a` adds four products at a time
exactly in int32.  Measured: the same speed in the 7B step, and the step's teacher-forced
logits within 4.8e-4 of their spread from fp32 (`docs/PERF.md` 0.30).  This notebook checks
the arithmetic on a CPU with the Python twins of the PTX instructions the kernel executes.
"""),
    code("""
import os, sys
sys.path.insert(0, os.getcwd())  # run from the repository root
import numpy as np
from nq import ptx as P

rng = np.random.default_rng(3)
v = (rng.standard_normal(128) * 2).astype(np.float32)    # one group of x * norm_w
v[17] = 300.0                                            # a "massive activation"
e = int(np.frexp(np.abs(v).max())[1])                    # f: a power of two putting the absmax
f = np.float32(2.0 ** (8 - e))                           # in [128, 256), exactly
print("absmax", np.abs(v).max(), "-> f =", f, "-> scaled absmax", np.abs(v * f).max())
"""),
    md("""
The digits: x = rni(v f 2^14) fits 23 bits, written as hi 2^16 + mid 2^8 + lo with each a
signed byte (`dequant.digit_bits`: add 0x808080, then xor it back, makes each byte a digit +
128).  Rounding is the only loss: 2^-15 of a unit of v f, 2^-22 of the group's absmax.
"""),
    code("""
def digits(value):                # nq/kernels/int4/dequant.digit_bits, with its PTX's twin
    x = int(P.cvt_rni_s32_f32.twin(np.float32(value) * np.float32(16384.0)))
    u = ((x + 0x808080) & 0xFFFFFFFF) ^ 0x808080
    s8 = lambda b: b - 256 if b & 0x80 else b
    return s8((u >> 16) & 0xFF), s8((u >> 8) & 0xFF), s8(u & 0xFF)   # hi, mid, lo

d = np.array([digits(x) for x in v * f])                              # (128, 3)
x_back = d[:, 0] * 65536 + d[:, 1] * 256 + d[:, 2]
print("digit ranges", d.min(0), d.max(0))
print("worst rounding, in units of the absmax:",
      np.abs(x_back / 16384.0 - v * f).max() / np.abs(v * f).max())
"""),
    md("""
The weights: a word holds eight signed nibbles in the ValueShuffle order (notebook 01):
nibbles 0..7 are w0 w2 w4 w6 w1 w3 w5 w7.  Moving each byte's low nibble to its top,
`(q << 4) & 0xF0F0F0F0`, gives the signed bytes 16 w0, 16 w4, 16 w1, 16 w5; `q & 0xF0F0F0F0`
gives 16 w2, 16 w6, 16 w3, 16 w7.  So a staging lane packs each plane's digits of positions
(0, 4, 1, 5) or (2, 6, 3, 7) of the word into one register, and six `dp4a` a word sum the
products of each plane exactly:
"""),
    code("""
from nq.loader.quant import pack_value_shuffle

w = rng.integers(-8, 8, size=(1, 128)).astype(np.int8)     # one row of one group
words = pack_value_shuffle(w)[0]                            # 16 uint32
def pack(b):                                                # four signed bytes -> a word
    return int.from_bytes(bytes(int(x) & 0xFF for x in b), "little")

acc = [0, 0, 0]                                             # hi, mid, lo: int32 sums
for j, q in enumerate(int(u) for u in words):
    A, B = (q << 4) & 0xF0F0F0F0, q & 0xF0F0F0F0
    for plane in range(3):
        da = pack(d[8 * j + np.array([0, 4, 1, 5]), plane])
        db = pack(d[8 * j + np.array([2, 6, 3, 7]), plane])
        acc[plane] = int(P.dp4a_s32.twin(B, db, P.dp4a_s32.twin(A, da, acc[plane])))
dot = (acc[0] * 65536 + acc[1] * 256 + acc[2]) / 16 / 16384 / f   # 16 w, 2^14, f
exact = float(w[0].astype(np.float64) @ x_back.astype(np.float64)) / 16384 / f
print("dp4a sums == the integer dot product:", dot == exact)
ref = float(w[0] @ v.astype(np.float64))
print("relative error against the fp64 dot of v:", abs(dot - ref) / abs(ref))
"""),
    md("""
## The kernel

With `Tiling.i8` the CUDA-core GEMV keeps its grid and its weight loads; only the staging and
the dot change (`gemv_digits.digits_body`).  Its PTX for sm_90, no GPU needed:
"""),
    code("""
from tests.ptx_util import compile_ptx_sm90, count
from nq.config import PRESETS
from nq.kernels.int4 import gemv
from nq.kernels.int4.launch import gemv_tiling

cfg = PRESETS["7b"]
t = gemv_tiling("qkv_rope", cfg)            # the default: digits unless NQ_I8=0
heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
pyfunc, sig = gemv.build_kernel("qkv_rope", cfg.qkv_size, cfg.hidden_size, t, cfg.rms_norm_eps, heads)
ptx = compile_ptx_sm90(pyfunc, sig)
print(t.tag())
for ins in ("dp4a.s32.s32", "prmt.b32", "fma.rn.f16x2", "ld.shared.v4.u32", "ld.global.nc.v4.u32"):
    print(f"{ins:22s}", count(ptx, ins))
"""),
    md("""
A step of the loop is 16 weight words x 2 rows x 6 `dp4a`: 192, and no fp16 math.  To compare
the two forms inside the whole step on a GPU:

    python3 scripts/step_variants.py --ctx 512,8192,32768 "qkv_rope.i8=0"

(on an H100, 2026-12-07: -0.000 / +0.001 / +0.000 ms a step, a tie; at the 14B's width the
fp16 form is 0.04 ms slower).
"""),
    code("""
from numba import cuda

if cuda.is_available():
    from nq.kernels.int4 import make_qkv_gemv
    from nq.kernels.int4.reference import ref_qkv
    from nq.loader.quant import dequantize_packed, quantize_pack
    g = make_qkv_gemv(cfg)
    parts = [quantize_pack(rng.standard_normal((m, cfg.hidden_size)).astype(np.float32) / 20)
             for m in (cfg.q_size, cfg.kv_size, cfg.kv_size)]
    pq, ps = g.prepare(parts)
    x = rng.standard_normal(cfg.hidden_size).astype(np.float32); x[5] = 400.0
    nw = np.ones(cfg.hidden_size, np.float16); b = np.zeros(cfg.qkv_size, np.float16)
    out = cuda.to_device(np.zeros(cfg.qkv_size, np.float32))
    D = cuda.to_device
    g(D(x), D(nw), D(pq), D(ps), D(b), out)
    wd = np.concatenate([dequantize_packed(q, s) for q, s in parts]).astype(np.float64)
    ref = wd @ (x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + cfg.rms_norm_eps))
    got = out.copy_to_host()
    print("relative error against fp64:", np.linalg.norm(got - ref) / np.linalg.norm(ref))
""", "gpu"),
]


def write(name, cells, out_dir=HERE):
    nb = {"nbformat": 4, "nbformat_minor": 5,
          "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                       "language_info": {"name": "python"}},
          "cells": cells}
    for i, c in enumerate(nb["cells"]):
        c["id"] = f"{name.split('.')[0][:20]}-{i}"
    (Path(out_dir) / name).write_text(json.dumps(nb, indent=1) + "\n")


NOTEBOOKS = {"01_int4_valueshuffle.ipynb": INT4, "02_decode_step_floor.ipynb": FLOOR,
             "03_tensor_core_gemv.ipynb": MMA, "04_digits_dp4a.ipynb": DIGITS}


if __name__ == "__main__":
    import sys
    # `make_notebooks.py [DIR]`: write the notebooks into DIR (default: beside this file)
    for name, cells in NOTEBOOKS.items():
        write(name, cells, sys.argv[1] if len(sys.argv) > 1 else HERE)
