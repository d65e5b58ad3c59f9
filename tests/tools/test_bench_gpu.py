"""GPU tier of `nq bench`: the ITL breakdown is complete and adds up, and the command runs end
to end and writes its JSON.  Nothing is asserted about the figures themselves (benchmarks are
not tests)."""
import json

import pytest

from nq.config import tiny_config

pytestmark = pytest.mark.gpu


def test_breakdown_is_complete_and_adds_up_to_the_itl():
    from nq.tools.bench import measure_breakdown
    from nq.runtime.engine import Engine
    from nq.runtime.step import FUSE_ROPE

    eng = Engine.random(tiny_config(num_layers=2), max_len=256)
    b = measure_breakdown(eng, ctx=40, replays=20, steps=16)
    assert list(b["regions_ms"]) == eng.regions
    assert set(eng.regions) >= {"embed", "qkv_gemv", "paged_attention", "o_proj",
                                "gate_up_swiglu", "down", "lm_head", "sample"}
    # with RoPE/KV append fused into the qkv GEMV (the default) there is no kernel of its own
    assert ("rope_kv_append" in eng.regions) == (not FUSE_ROPE)
    assert b["norms"] == "fused" and "kernel_gap_ms" in b
    # float rounding only: the gap is defined as the rest
    assert sum(b["regions_ms"].values()) + b["kernel_gap_ms"] == pytest.approx(b["itl_ms"], rel=1e-9)
    eng.stream.synchronize()
    assert eng.length == 40  # the state is back at the context after 'sample' advanced it


def test_nq_bench_end_to_end_writes_json(tmp_path, capsys):
    from nq.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "--random", "0.5b", "-p", "16", "-n", "8", "-r", "2", "--no-peers",
                 "--json", str(out)]) == 0
    assert "| pp16 " in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert {"model", "source", "config", "args", "env", "build_s", "copy_ceiling_GBs", "tests",
            "breakdown", "peers", "plots", "weights_bytes_per_token"} <= set(res)
    assert {"start", "end", "gpu", "versions"} <= set(res["env"])
    assert {"nq", "numba", "numba-cuda", "numpy", "python", "cuda_driver"} <= set(res["env"]["versions"])
    assert [t["test"] for t in res["tests"]] == ["pp16", "tg8"]
    for t in res["tests"]:
        assert {"tok_s_mean", "tok_s_sd", "bytes_per_token", "GBs", "pct_ceiling", "ttft_ms",
                "itl_p50_ms", "itl_p90_ms"} <= set(t)
    pp, tg = res["tests"]
    # a prompt of 16 and a step of the 0.5B take between a microsecond and a few seconds
    assert 1e-3 < pp["ttft_ms"] < 5e3 and 1e-3 < tg["itl_p50_ms"] <= tg["itl_p90_ms"] < 5e3
    # tok/s is what the ITL says it is (the mean over runs, against the median step)
    assert 0.5 < tg["tok_s_mean"] * tg["itl_p50_ms"] / 1e3 < 2.0
    assert 0 < tg["pct_ceiling"] < 100 and tg["bytes_per_token"] > 0
    (b,) = res["breakdown"]
    assert b["ctx"] == 16 and "kernel_gap_ms" in b
