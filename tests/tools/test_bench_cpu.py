"""CPU tier of `nq bench`: statistics, the table formatters, the breakdown arithmetic, argument
parsing, the no-GPU exit, and the measurement flow on a stand-in engine (which checks that every
timed step stays inside the pages reserved for it).  No figure is checked: benchmarks are not
tests; the GPU tier (tests/test_bench_gpu.py) runs the real thing.
"""
import json
import types

import numpy as np
import pytest

from nq.tools import bench
from nq.tools.peers import format_peers
from nq.cli import build_parser, main
from nq.config import PRESETS

REGIONS = ["embed", "qkv_gemv", "rope_kv_append", "paged_attention", "o_proj", "gate_up_swiglu",
           "down", "lm_head", "sample"]


# ---- statistics -----------------------------------------------------------------------------
def test_mean_sd_is_the_sample_standard_deviation():
    m, sd = bench.mean_sd([2, 4, 4, 4, 5, 5, 7, 9])
    assert m == 5.0
    assert sd == pytest.approx(np.std([2, 4, 4, 4, 5, 5, 7, 9], ddof=1))
    assert bench.mean_sd([3.5]) == (3.5, 0.0)
    with pytest.raises(ValueError):
        bench.mean_sd([])


@pytest.mark.parametrize("xs", [[1.0], [3, 1, 2], list(range(10)), [0.5, 9.0, 2.25, 2.25, 7.0]])
def test_percentiles_match_numpy_linear_interpolation(xs):
    for q in (50, 90):
        assert bench.percentile(xs, q) == pytest.approx(np.percentile(xs, q))


def test_breakdown_gap_is_itl_minus_the_regions():
    regions = {r: 0.1 * (i + 1) for i, r in enumerate(REGIONS)}
    b = bench.breakdown(5.0, regions)
    assert list(b["regions_ms"]) == REGIONS  # step order kept
    assert b["norms"] == "fused"
    assert b["kernel_gap_ms"] == pytest.approx(5.0 - 4.5)
    assert sum(b["regions_ms"].values()) + b["kernel_gap_ms"] == pytest.approx(b["itl_ms"])


def test_row_bytes_and_ceiling_fraction():
    cfg = PRESETS["7b"]
    row = bench.make_row("tg128", 576, 4_000_000_000, cfg, 4000.0, [250.0, 250.0],
                         itl_ms=[4.0, 4.0, 4.0, 5.0])
    kv = 28 * 2 * 576 * 4 * 128 * 2  # layers * (K, V) * ctx * kv heads * head_dim * fp16
    assert row["bytes_per_token"] == 4_000_000_000 + kv
    assert row["GBs"] == pytest.approx(row["bytes_per_token"] * 250 / 1e9)
    assert row["pct_ceiling"] == pytest.approx(100 * row["GBs"] / 4000)
    assert (row["tok_s_mean"], row["tok_s_sd"]) == (250.0, 0.0)
    assert row["itl_p50_ms"] == 4.0 and row["itl_p90_ms"] == pytest.approx(4.7)
    assert row["ttft_ms"] is None


def test_a_prompt_row_has_no_bandwidth_figures():
    # a prompt reads the weights once a chunk, not once a token: GB/s would read 15x the ceiling
    row = bench.make_row("pp512", 256, 4_000_000_000, PRESETS["7b"], 4000.0, [14000.0],
                         ttft_ms=[36.5])
    assert row["bytes_per_token"] is None and row["GBs"] is None and row["pct_ceiling"] is None
    cells = [c.strip() for c in bench.format_table("m", [row]).splitlines()[2].strip("|").split("|")]
    assert cells[-3:] == ["-", "-", "-"] and cells[3] == "36.5"


# ---- formatting -----------------------------------------------------------------------------
def _rows():
    cfg = PRESETS["0.5b"]
    return [bench.make_row("pp16", 8, 10**9, cfg, 4000.0, [100.0, 120.0], ttft_ms=[160.0, 133.3]),
            bench.make_row("tg8", 20, 10**9, cfg, 4000.0, [500.0, 510.0], itl_ms=[2.0, 1.9, 2.1])]


def test_table_is_llama_bench_markdown():
    lines = bench.format_table("m", _rows()).splitlines()
    assert len(lines) == 4
    assert [c.strip() for c in lines[0].strip("|").split("|")] == [
        "model", "test", "t/s", "TTFT ms", "ITL p50 ms", "ITL p90 ms", "bytes/token", "GB/s",
        "% of ceiling"]
    seps = [c.strip() for c in lines[1].strip("|").split("|")]
    assert seps[0].endswith("-") and seps[1].endswith("-")  # text columns left-aligned
    assert all(s.endswith(":") for s in seps[2:])          # figures right-aligned
    pp = [c.strip() for c in lines[2].strip("|").split("|")]
    assert pp[1] == "pp16" and pp[2] == "110.00 ± 14.14" and pp[3] == "146.7" and pp[4] == "-"
    tg = [c.strip() for c in lines[3].strip("|").split("|")]
    assert tg[1] == "tg8" and tg[2] == "505.00 ± 7.07" and tg[3] == "-" and tg[4] == "2.000"
    assert len({len(line) for line in lines}) == 1  # padded: every line equally long


def test_breakdown_table_lists_every_region_norms_and_gap():
    b = bench.breakdown(2.0, {r: 0.1 for r in REGIONS})
    b["ctx"] = 512
    text = bench.format_breakdown([b])
    names = [line.strip("|").split("|")[0].strip() for line in text.splitlines()[2:]]
    assert names == REGIONS + ["norms", "kernel_gap", "ITL"]
    assert "fused" in text and "1.1000" in text  # the gap: 2.0 - 9 * 0.1


def _host_weights(cfg, int8_head=False):
    """DeviceWeights' shapes and dtypes in NumPy (region_bytes reads only .nbytes)."""
    from nq.kernels.lm_head_int8 import Int8Rows
    from nq.runtime.weights import DeviceLayer, DeviceWeights
    h, i, n = cfg.hidden_size, cfg.intermediate_size, cfg.qkv_size
    z = np.zeros

    def layer():
        return DeviceLayer(input_norm=z(h, np.float16), post_norm=z(h, np.float16),
                           qkv_w=z((n, h // 8), np.uint32), qkv_s=z((n, h // 128), np.float16),
                           qkv_b=z(n, np.float16), o_w=z((h, cfg.q_size // 8), np.uint32),
                           o_s=z((h, cfg.q_size // 128), np.float16),
                           gu_w=z((2 * i, h // 8), np.uint32), gu_s=z((2 * i, h // 128), np.float16),
                           down_w=z((h, i // 8), np.uint32), down_s=z((h, i // 128), np.float16))
    head = (Int8Rows(z((cfg.vocab_size, h), np.int8), z(cfg.vocab_size, np.float32)) if int8_head
            else z((cfg.vocab_size, h), np.float16))
    return DeviceWeights(cfg, embed=z((8, h), np.float16), norm=z(h, np.float16), lm_head=head,
                         layers=[layer() for _ in range(cfg.num_layers)])


def test_region_bytes_of_the_7b_add_up_to_a_token():
    cfg = PRESETS["7b"].replace(num_layers=2)
    w = _host_weights(cfg)
    by = bench.region_bytes(w, 512)
    assert set(REGIONS) <= set(by)
    assert by["gate_up_swiglu"] == 2 * (2 * 18944 * 3584 // 2 + 2 * 18944 * 28 * 2 + 3584 * 2)
    assert by["paged_attention"] == bench.kv_bytes(cfg, 512) == 2 * 2 * 512 * 4 * 128 * 2
    assert by["lm_head"] == 152064 * 3584 * 2 + 3584 * 2
    # every weight byte of the step is in exactly one region (sample's logits and the KV aside)
    weights = sum(v for r, v in by.items() if r not in ("paged_attention", "sample"))
    assert weights == w.nbytes_per_token
    w8 = _host_weights(cfg, int8_head=True)
    assert bench.region_bytes(w8, 512)["lm_head"] == 152064 * 3584 + 152064 * 4 + 3584 * 2


def test_breakdown_table_with_floors():
    b = bench.breakdown(2.0, {r: 0.1 for r in REGIONS})
    b["ctx"] = 512
    by = {r: 0 for r in REGIONS} | {"gate_up_swiglu": 80e6, "lm_head": 100e6}
    b = bench.with_floors(b, by, 1000.0)                 # 1 TB/s: 80 MB take 0.08 ms
    text = bench.format_breakdown([b])
    lines = {line.strip("|").split("|")[0].strip(): [c.strip() for c in line.strip("|").split("|")]
             for line in text.splitlines()[2:]}
    assert "floor ms" in text.splitlines()[0] and "% of floor" in text.splitlines()[0]
    assert lines["gate_up_swiglu"][3:5] == ["0.0800", "80"]      # 0.08 of 0.1 ms
    assert lines["lm_head"][3:5] == ["0.1000", "100"]
    assert lines["o_proj"][3:5] == ["0.0000", "-"]
    assert lines["ITL"][3:5] == ["0.1800", "9"]                  # 0.18 ms of floor in 2.0


def test_peers_are_ratios_to_nq_and_failures_are_reported():
    rows = _rows()
    bd = bench.breakdown(2.0, {r: 0.1 for r in REGIONS})
    peers = {"torch": "2.x", "tinygemm_int4_chain": {"ms": 4.0, "GBs": 1000.0},
             "cublas_fp16_gemv_chain": {"error": "RuntimeError: no"},
             "cublas_fp16_gemm_chain": {"ms": 2.0, "M": 16, "tok_s": 8000.0}}
    text = format_peers(peers, rows, bd)
    nq_itl = 1e3 / rows[1]["tok_s_mean"]
    assert f"nq decode is {nq_itl / 4.0:.2f}x its time" in text
    assert "nq's GEMV regions alone 0.12x" in text  # 5 GEMV regions of 0.1 ms / 4 ms
    assert "cuBLAS fp16 GEMV chain: unavailable: RuntimeError: no" in text
    assert "nq prefill TTFT is" in text


# ---- command line ---------------------------------------------------------------------------
def test_prefill_flops():
    from nq.config import PRESETS
    from nq.tools.bench import prefill_flops
    cfg = PRESETS["7b"]
    # the 7B's projections hold ~6.5e9 weights: ~13 GFLOP a token, 6.7 TFLOP for 512 tokens
    assert 6.5e12 < prefill_flops(cfg, 512) < 7.2e12
    # causal attention grows with the square: 8K adds ~13 TFLOP over the projections' 107
    extra = prefill_flops(cfg, 8192) - 16 * (prefill_flops(cfg, 512) - 2 * cfg.vocab_size * cfg.hidden_size)
    assert 1.1e13 < extra < 1.5e13
    # a continued context costs its cached keys too
    assert prefill_flops(cfg, 100, start=1000) > prefill_flops(cfg, 100)


def test_bench_arguments():
    a = build_parser().parse_args(["bench", "--random", "7b", "-p", "512,8192", "-n", "128", "-r",
                                   "5", "--ctx", "512,2048,8192,32768", "--json", "x.json"])
    assert (a.random, a.model, a.p, a.n, a.r) == ("7b", None, [512, 8192], 128, 5)
    assert a.ctx == [512, 2048, 8192, 32768] and a.json == "x.json" and not a.no_peers
    a = build_parser().parse_args(["bench", "-m", "m.nanoqwen", "--no-peers"])
    assert (a.model, a.random, a.p, a.n, a.r, a.ctx) == ("m.nanoqwen", None, [512], 128, 5, [])
    assert a.no_peers


@pytest.mark.parametrize("argv, says", [
    (["bench", "--random", "9b"], "invalid choice: '9b'"),
    (["bench", "-p", "16"], "one of the arguments -m/--model --random is required"),
    (["bench", "--random", "7b", "-m", "x"], "not allowed with"),
    (["bench", "--random", "7b", "--ctx", "8k"], "--ctx wants comma-separated"),
    (["bench", "--random", "7b", "-n", "0"], "positive integer"),
])
def test_bench_argument_errors(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_bench_without_a_gpu_exits_2(monkeypatch, capsys):
    from numba import cuda
    monkeypatch.setattr(cuda, "is_available", lambda: False)
    assert main(["bench", "--random", "0.5b", "--no-peers"]) == 2
    err = capsys.readouterr().err
    assert "nq bench needs an NVIDIA GPU" in err


# ---- the measurement flow on a stand-in engine ----------------------------------------------
class StandIn:
    """Engine's benchmark surface, with host-side bookkeeping of positions and reserved pages:
    a timed step beyond the reservation would, on the GPU, write through page 0."""
    regions = REGIONS

    def __init__(self, cfg, max_len):
        self.cfg, self.max_len = cfg, max_len
        self.w = _host_weights(cfg)            # shapes and dtypes: the breakdown's floors
        self.w.load_s = 0.1
        self.pos = self.reserved = 0
        self.pdl = True

    def capture(self, pdl=True):
        self.pdl = pdl

    def reset(self):
        self.pos = self.reserved = 0

    def _reserve(self, n):
        assert n <= self.max_len, "the engine would raise KVCacheFull"
        self.reserved = max(self.reserved, n)

    def reserve_ahead(self, n):
        self._reserve(self.pos + n)

    def fake_context(self, n):
        self._reserve(n + 1)
        self.pos = n

    def prefill(self, ids):
        self._reserve(self.pos + len(ids))
        self.pos += len(ids)

    def time_steps(self, n, warmup=3):  # as Engine.time_steps: reserves what it will run
        self.reserve_ahead(warmup + n + 1)
        self.pos += n + warmup
        assert self.pos <= self.reserved, f"step at pos {self.pos} beyond {self.reserved} reserved"
        return [1.0 + 0.01 * (i % 7) for i in range(n)]


def test_run_on_a_stand_in_engine_writes_the_json(monkeypatch, tmp_path, capsys):
    from numba import cuda

    from nq.runtime.engine import Engine
    made = []

    def fake_random(cls, cfg, max_len=4096, seed=0, lm_head="fp16"):
        assert lm_head == "int4+fp16"    # `nq pack`'s default, unless --lm-head says
        made.append(StandIn(cfg, max_len))
        return made[-1]
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "get_current_device", lambda: types.SimpleNamespace(name=b"Fake GPU"))
    monkeypatch.setattr(Engine, "random", classmethod(fake_random))
    monkeypatch.setattr(bench, "copy_ceiling_gbs", lambda: 4000.0)
    monkeypatch.setattr(bench, "gpu_clocks", lambda: {"clocks.sm": "1980", "clocks.mem": "3201"})
    monkeypatch.setattr(bench, "region_ms", lambda eng, region, replays: 0.05)
    out = tmp_path / "b.json"
    assert main(["bench", "--random", "0.5b", "-p", "16", "-n", "8", "-r", "2", "--ctx",
                 "64,256", "--no-peers", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| pp16 " in text and "| tg8 " in text and "tg8 @ d256" in text and "kernel_gap" in text
    res = json.loads(out.read_text())
    assert {"model", "env", "tests", "breakdown", "peers", "copy_ceiling_GBs"} <= set(res)
    assert {"start", "end", "versions", "gpu"} <= set(res["env"])
    assert {"nq", "numba", "numba-cuda", "numpy", "python", "cuda_driver"} <= set(res["env"]["versions"])
    assert [r["test"] for r in res["tests"]] == ["pp16", "tg8", "tg8 @ d64", "tg8 @ d256"]
    assert [b["ctx"] for b in res["breakdown"]] == [16, 64, 256]
    for b in res["breakdown"]:
        assert list(b["regions_ms"]) == REGIONS
        assert sum(b["regions_ms"].values()) + b["kernel_gap_ms"] == pytest.approx(b["itl_ms"])
        # the floors: the KV bytes of the context at the run's copy ceiling
        assert set(b["floor_ms"]) == set(REGIONS)
        kv = bench.kv_bytes(made[0].cfg, b["ctx"])
        assert b["floor_ms"]["paged_attention"] == pytest.approx(kv / 4000e9 * 1e3)
    assert res["copy_ceiling_GBs"] == 4000.0 and res["peers"] == {}
    assert res["itl_no_pdl_ms"] > 0 and made[0].pdl  # measured without PDL, then restored


def test_step_variants_parses_variants():
    """scripts/step_variants.py: what a variant string means (the timing itself needs the GPU)."""
    from script_util import load_script

    from nq.kernels.int4.tiling import MmaTiling, Tiling
    sv = load_script("step_variants")
    down_mma, down_cc = MmaTiling(warps=16, threads=1024), Tiling(ks=16, threads=512)
    defaults = {"down": down_mma, "gate_up": Tiling(ks=4, threads=192)}
    engines = {"down": (down_cc, down_mma), "gate_up": (Tiling(ks=4, threads=192), None)}
    tilings, attn, rope = sv.parse_variant(
        "down.warps=8 down.min_blocks=1 attn.early=0 attn.min_pps=2 rope.fused=1", defaults)
    assert tilings == {"down": MmaTiling(warps=8, threads=1024, min_blocks=1)}
    assert attn == {"early": False, "min_pps": 2} and rope is True
    assert sv.parse_variant("gate_up.threads=256", defaults)[0]["gate_up"].threads == 256
    assert sv.parse_variant("attn.consumers=2", defaults)[1] == {"consumers": 2}
    # pdl.full: the edges into kernels so named stay full (run() takes it out of attn's keywords)
    assert sv.parse_variant("pdl.full=gate_up+qkv", defaults)[1] == {"pdl_full": "gate_up+qkv"}
    # mma=0 switches to the CUDA-core tiling first, then its fields apply
    tilings = sv.parse_variant("down.mma=0 down.prefetch=0", defaults, engines)[0]
    assert tilings == {"down": Tiling(ks=16, threads=512, prefetch=0)}
    for bad in ("down.prefetch", "qkvx.threads=1", "down=2", "down.ks=8", "gate_up.mma=1",
                "gate_up.block_major=1", "pdl.off=1"):
        with pytest.raises(SystemExit):
            sv.parse_variant(bad, defaults, engines)


def test_ncu_gemv_parses_tilings():
    """scripts/ncu_gemv.py --tiling: the default tiling of the shape with the given fields."""
    from script_util import load_script

    pytest.importorskip("torch")
    from nq.kernels.int4.tiling import MmaTiling, default_tiling
    ng = load_script("ncu_gemv")
    assert ng.parse_tiling("down", "8,512") == MmaTiling(warps=8, threads=512, early=1)  # the default, new fields
    assert ng.parse_tiling("gate_up", "2,256") == MmaTiling(warps=2, threads=256, l2ahead=1, i8=1)
    qkv = default_tiling("qkv", 4608, 3584)                       # a CUDA-core default
    t = ng.parse_tiling("qkv", "7,128,prefetch=0")
    assert (t.ks, t.threads, t.prefetch) == (7, 128, 0) and t.span == qkv.span
    assert ng.parse_tiling("qkv", "14") == qkv
    with pytest.raises(TypeError):
        ng.parse_tiling("down", "16,512,nonsense=1")


def test_step_timeline_critical_increments():
    """scripts/step_timeline.py's reading of a CUPTI trace: steps split at the feed kernel,
    each kernel's critical increment (how far it moves the latest end), sums by region."""
    from script_util import load_script
    tl = load_script("step_timeline")

    def k(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}
    trace = {"traceEvents": [
        k("argmax_prev", 0, 1),                       # before the first step: dropped
        {"ph": "X", "cat": "cpu_op", "name": "x", "ts": 5, "dur": 100},
        k("feed_kernel", 10, 1), k("embed_k", 11, 1),
        k("gemv_int4_qkv_n4608", 12, 8),              # ends at 20
        k("rope_kv_h28", 13, 2),                      # ends at 15, under qkv's shadow: 0
        k("attn_split_gqa7", 14, 10),                 # ends at 24: +4
        k("feed_kernel", 30, 2), k("gemv_int4_down_n3584", 31, 5)]}
    steps = tl.split_steps(tl.kernels_from_trace(trace))
    assert [len(s) for s in steps] == [5, 2]
    rows = tl.critical_increments(steps[0])
    assert [r["increment"] for r in rows] == [1, 1, 8, 0, 4]
    assert rows[-1]["end"] == 14 and sum(r["increment"] for r in rows) == 14
    s = tl.summarize(steps[:1])
    assert s["regions"]["qkv_gemv"] == {"kernels": 1, "busy_us": 8, "critical_us": 8}
    assert s["regions"]["rope_kv_append"]["critical_us"] == 0
    assert s["regions"]["paged_attention"]["critical_us"] == 4
    assert "| qkv_gemv | 1 |" in tl.format_summary(s)
    # the default step's kernels each land in the region `nq bench` times them in
    names = {"gemv_int4_qkv_rope_n4608": "qkv_gemv", "attn_split_gqa7": "paged_attention",
             "attn_o_proj_d128": "o_proj", "gemv_mma_gate_up_n18944": "gate_up_swiglu",
             "gemv_mma_down_n3584": "down", "lm_head_int8_v152064": "lm_head",
             "sampler_select_v152064": "sample", "argmax_v152064": "sample"}
    assert {n: tl.region_of(n) for n in names} == names


def test_gemm_table_sums_the_layers_and_compares_with_cublas(monkeypatch):
    from nq.tools import gemm_table
    cfg = PRESETS["7b"]
    eng = types.SimpleNamespace(cfg=cfg, max_len=4096)
    ms_of = {"qkv": 0.1, "o_proj": 0.08, "gate_up": 0.4, "down": 0.2}
    monkeypatch.setattr(gemm_table, "time_nq", lambda eng, kind, m, reps: ms_of[kind] * m / 512)
    monkeypatch.setattr(gemm_table, "time_cublas", lambda torch, n, k, m: 0.5 * n * k * m / 1e10)
    rows = gemm_table.measure(eng, (512, 8192), log=lambda *a: None)
    assert [(r["m"], r["kind"]) for r in rows[:5]] == [
        (512, "qkv"), (512, "o_proj"), (512, "gate_up"), (512, "down"), (512, "28 layers")]
    gu = rows[2]
    assert (gu["n"], gu["k"]) == (2 * cfg.intermediate_size, cfg.hidden_size)
    assert gu["nq_tflops"] == pytest.approx(2 * 512 * gu["n"] * gu["k"] / 0.4e-3 / 1e12)
    layers = rows[4]
    assert layers["nq_ms"] == pytest.approx(28 * sum(ms_of.values()))
    if layers["cublas_ms"] is not None:  # torch with CUDA present
        assert layers["cublas_ms"] == pytest.approx(28 * sum(r["cublas_ms"] for r in rows[:4]))
    text = gemm_table.format_gemms(rows)
    assert "| 8192 | 28 layers" in text.replace("  ", " ").replace("  ", " ")
    assert len(text.splitlines()) == 2 + 10


def _bench_boundary():
    from script_util import load_script
    bb = load_script("bench_boundary")
    return bb


def test_bench_boundary_reads_the_packed_projections(tiny_nanoqwen):
    """scripts/bench_boundary.py streams, per layer, what the step's six kernels read: its
    GEMV slices are the packed file's projection bytes (INT4 words + fp16 scales), layer by
    layer in the engine's order (qkv, the attention's two, o_proj, gate_up, down); its tile
    shapes are the same nibbles in 1 KB groups.  (The timing itself needs the GPU.)"""
    from nq.loader.format import NanoqwenFile
    bb = _bench_boundary()
    nf = NanoqwenFile(tiny_nanoqwen)
    cfg = nf.config

    def nb(layer, *projs):
        return sum(nf.array(f"layers.{layer}.{p}.{t}").nbytes for p in projs
                   for t in ("qweight", "scales"))
    got = bb.slices(cfg, cfg.num_layers)
    assert len(got) == 6 * cfg.num_layers
    for i in range(cfg.num_layers):
        q, a1, a2, o, gu, d = got[6 * i: 6 * i + 6]
        assert q == nb(i, "q_proj", "k_proj", "v_proj") and o == nb(i, "o_proj")
        assert gu == nb(i, "gate_proj", "up_proj") and d == nb(i, "down_proj")
        assert a1 == a2 == 4096
    words = sum(nf.array(f"layers.0.{p}.qweight").nbytes for p in
                ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    tiles = bb.tile_shapes(cfg)
    assert sum(t * g * 1024 for t, g, _ in tiles) == words + 2 * 4096



def test_rounding_model_measures_what_it_rounds(tiny_nanoqwen):
    """scripts/rounding_model.py: with no rounding point the model is nq.ref itself, one token
    a forward against the reference's one forward over all of them: only fp32 summation order
    differs (~4e-7 of the spread; a step misaligned by one token would be far off); with every
    point rounded to fp16 the error is that of fp16 activations (1e-5..1e-2 of the spread, many
    times the floor); an unknown point is refused."""
    from script_util import load_script

    from nq.loader.format import NanoqwenFile
    from nq.loader.weights import load_host_weights
    rm = load_script("rounding_model")
    nf = NanoqwenFile(tiny_nanoqwen)
    errs = rm.teacher_forced(nf.config, load_host_weights(nf), [[3, 1, 4, 1, 5]], 6,
                             {"none": set(), "all": rm.parse_points("all"),
                              "kv+a": rm.parse_points("kv+a")})
    assert errs["none"].size == 5 and errs["none"].max() < 5e-6
    assert 1e-5 < errs["all"].max() < 1e-2 and errs["all"].max() > 20 * errs["none"].max()
    assert errs["kv+a"].max() > 5 * errs["none"].max()
    assert rm.parse_points("h") == {"h_qkv", "h_mlp"}
    with pytest.raises(SystemExit):
        rm.parse_points("kv+q")


STREAM_SCRIPT = '''
import sys
import numpy as np
from numba import cuda
sys.path.insert(0, "scripts")
import nq.ptx
import bench_stream as B

seen = []
real = nq.ptx.ld_global_nc_v4_u32


def rec(arr, idx):
    seen.append(int(idx))
    return real(arr, idx)


nq.ptx.ld_global_nc_v4_u32 = rec
out = cuda.to_device(np.zeros(1, np.float32))
# 3 tiles of 5 groups, 2 warps a tile, 2 tiles a block: the second block's second tile clamped
for form in ("half", "coal", "gmaj"):
    for mats, depth in ((1, 2), (2, 2), (2, 3)):
        words = mats * 3 * 5 * B.GROUP_WORDS
        k, grid = B.build(2, mats, 5, 3, 128, 0, 2, form, depth)
        seen.clear()
        k[grid, 128](cuda.to_device(np.zeros(words + 64, np.uint32)), out)
        got = set(seen)
        print(f"{form}{mats}{depth}_missed", len(set(range(0, words, 4)) - got))
        print(f"{form}{mats}{depth}_outside", len(got - set(range(0, words, 4))))
'''


def test_bench_stream_reads_every_word_of_the_matrix_in_each_form():
    """scripts/bench_stream.py: in each layout form (the two 16-byte halves of a lane's 32
    bytes, 512-byte coalesced halves, group-major groups), with one or two matrices a warp and
    loads one or two groups ahead,
    the kernel's loads (recorded under the simulator) cover every 16 bytes of the matrix and
    nothing past it.  (The timing itself needs the GPU.)"""
    import ptx_util
    errs, stdout = ptx_util.run_under_simulator(STREAM_SCRIPT, timeout=600)
    assert len(errs) == 18, stdout
    assert all(v == 0 for v in errs.values()), stdout


def test_step_variants_pairs_each_variant_with_its_rounds_baseline():
    """scripts/step_variants.py --rounds: a variant's difference is taken from its own round's
    baseline, so drift between rounds cancels (here the machine slows by 0.05 ms in round 1
    and the variant still reads -0.01 in both)."""
    from script_util import load_script

    sv = load_script("step_variants")
    rows = [{"variant": "baseline", "round": 0, 512: 1.90, 8192: 2.00},
            {"variant": "a", "round": 0, 512: 1.89, 8192: 2.02},
            {"variant": "baseline", "round": 1, 512: 1.95, 8192: 2.05},
            {"variant": "a", "round": 1, 512: 1.94, 8192: 2.04},
            {"variant": "baseline", "round": 2, 512: 1.92, 8192: 2.01},
            {"variant": "a", "round": 2, 512: 1.91, 8192: 2.03}]
    out = {r["variant"]: r for r in sv.paired(rows, [512, 8192])}
    assert list(out) == ["baseline", "a"] and out["a"]["rounds"] == 3
    med, lo, hi = out["a"][512]
    assert med == pytest.approx(-0.01) and lo == pytest.approx(-0.01) and hi == pytest.approx(-0.01)
    med, lo, hi = out["a"][8192]
    assert (med, lo, hi) == pytest.approx((0.02, -0.01, 0.02))
    # the baseline's own row: its change against round 0, the drift the pairing removes
    assert out["baseline"][512] == pytest.approx((0.02, 0.0, 0.05))
    with pytest.raises(ValueError, match="no baseline"):
        sv.paired([r for r in rows if r["variant"] != "baseline"], [512])
