"""llama.cpp's routes in llama.cpp's shapes (/infill as llama.vim calls it, /tokenize,
/detokenize), /health, /v1/models and the Prometheus text of /metrics."""
import json
import re

from nq.loader.format import NanoqwenFile
from nq.serve.llama_api import IndentStop, infill_ids
from nq.text import Tokenizer

VIM_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
              "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
              "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated",
              "tokens_cached"]
EXTRA = [{"filename": "util.py", "text": "def helper(x):\n    return x * 2\n"},
         {"filename": "main.py", "text": "import util\n"}]


def infill(http, **body):
    r = http.post("/infill", json={"input_prefix": "def f(x):\n    ", "input_suffix": "\n",
                                   "n_predict": 8, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_infill_prompt_and_response_shape(http):
    r = infill(http, input_extra=EXTRA, prompt="ret", return_tokens=True)
    assert r["prompt"] == ("<|repo_name|>myproject\n<|file_sep|>util.py\ndef helper(x):\n    "
                           "return x * 2\n<|file_sep|>main.py\nimport util\n<|file_sep|>filename"
                           "\n<|fim_prefix|>def f(x):\n    ret<|fim_suffix|>\n<|fim_middle|>")
    assert r["stop"] is True and r["truncated"] is False and r["model"] == "tiny"
    assert r["tokens_predicted"] == len(r["tokens"]) <= 8
    assert r["stop_type"] in ("eos", "limit", "word")
    assert r["tokens_evaluated"] == len(http.post("/tokenize", json={
        "content": r["prompt"]}).json()["tokens"])
    t = r["timings"]
    assert t["prompt_n"] + t["cache_n"] == r["tokens_evaluated"]
    assert t["predicted_n"] == r["tokens_predicted"] and t["prompt_ms"] > 0
    assert r["generation_settings"]["n_predict"] == 8
    assert r["tokens_cached"] == r["tokens_evaluated"] + r["tokens_predicted"] - 1


def test_infill_as_llama_vim_calls_it(http):
    warm = http.post("/infill", json={"input_prefix": "", "input_suffix": "", "prompt": "",
                                      "input_extra": EXTRA, "n_predict": 0, "temperature": 0.0,
                                      "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 1,
                                      "t_max_predict_ms": 1, "response_fields": [""]})
    assert warm.status_code == 200 and warm.json() == {}
    r = infill(http, input_extra=EXTRA, prompt="", n_indent=4, top_k=40, top_p=0.9,
               samplers=["top_k", "top_p", "infill"], cache_prompt=True, t_max_prompt_ms=500,
               t_max_predict_ms=250, stop=[], response_fields=VIM_FIELDS)
    assert sorted(r) == sorted(VIM_FIELDS)
    extra_len = len(http.post("/tokenize", json={"content": (
        "<|repo_name|>myproject\n<|file_sep|>util.py\ndef helper(x):\n    return x * 2\n"
        "<|file_sep|>main.py\nimport util\n<|file_sep|>filename\n")}).json()["tokens"])
    assert r["tokens_cached"] - r["timings/predicted_n"] + 1 > extra_len
    # the warm-up kept the extra context: only the local part was prefilled
    assert r["timings/prompt_n"] <= r["tokens_cached"] - extra_len


def test_infill_stream_equals_the_whole(http):
    whole = infill(http, input_extra=EXTRA)
    events = []
    with http.stream("POST", "/infill", json={"input_prefix": "def f(x):\n    ",
                                              "input_suffix": "\n", "n_predict": 8,
                                              "temperature": 0, "input_extra": EXTRA,
                                              "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["tokens_predicted"] == whole["tokens_predicted"]


def test_infill_truncates_what_does_not_fit(http):
    big = [{"filename": f"f{i}.py", "text": "x = 1\n" * 400} for i in range(4)]
    r = infill(http, input_extra=big, n_predict=4)
    assert r["truncated"] is True and r["tokens_evaluated"] <= 4096 - 4


def test_infill_ids_budget(tiny_nanoqwen):
    tok = Tokenizer.from_nanoqwen(NanoqwenFile(tiny_nanoqwen))
    ids, cut = infill_ids(tok, "a = 1\n" * 200, "b = 2\n" * 200, [], 100)
    assert cut and len(ids) <= 100
    text = tok.decode(ids)
    assert text.startswith("<|fim_prefix|>") and text.endswith("<|fim_middle|>")
    pre, suf = text[14:].split("<|fim_suffix|>")
    assert len(tok.encode(pre)) > 2 * len(tok.encode(suf[:-len("<|fim_middle|>")]))
    ids, cut = infill_ids(tok, "a", "b", [{"filename": "x", "text": "y"}], 100)
    assert not cut and tok.decode(ids).startswith("<|repo_name|>")


def test_indent_stop():
    s = IndentStop(4)
    out, stop = s.feed("x = 1\n    y = 2\n")
    assert out == "x = 1\n    y = 2" and not stop  # the last newline waits for its line
    out, stop = s.feed("  ")
    assert out == "" and not stop
    out, stop = s.feed("z")
    assert out == "\n  " and stop  # a line indented less than 4: cut before its text
    s = IndentStop(2)
    assert s.feed("a\n") == ("a", False) and s.flush() == "\n"


def test_tokenize_detokenize(http):
    r = http.post("/tokenize", json={"content": "héllo <|im_end|>", "with_pieces": True}).json()
    pieces = r["tokens"]
    assert all(set(p) == {"id", "piece"} for p in pieces)
    assert pieces[-1]["piece"] == "<|im_end|>"
    assert any(isinstance(p["piece"], list) for p in pieces)  # é split into its two bytes
    ids = http.post("/tokenize", json={"content": "héllo <|im_end|>"}).json()["tokens"]
    assert ids == [p["id"] for p in pieces]
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"content": "héllo <|im_end|>"}


def test_health_models(http):
    assert http.get("/health").json() == {"status": "ok"}
    m = http.get("/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == "tiny"
    assert m["data"][0]["object"] == "model" and m["data"][0]["meta"]["n_ctx"] == 4096
    assert http.get("/models").json() == m


def test_metrics_text(http):
    http.post("/v1/completions", json={"prompt": "a", "max_tokens": 3, "temperature": 0,
                                       "ignore_eos": True})
    text = http.get("/metrics").text
    for name, kind in (("nq_requests_total", "counter"), ("nq_prompt_tokens_total", "counter"),
                       ("nq_prompt_tokens_cached_total", "counter"),
                       ("nq_generated_tokens_total", "counter"), ("nq_queue_depth", "gauge"),
                       ("nq_requests_running", "gauge"), ("nq_ttft_seconds", "histogram"),
                       ("nq_itl_seconds", "histogram")):
        assert f"# TYPE {name} {kind}\n" in text and f"# HELP {name} " in text
    assert re.search(r'^nq_requests_total\{path="/v1/completions",status="200"\} \d+$', text,
                     re.M)
    for h in ("nq_ttft_seconds", "nq_itl_seconds"):
        counts = [int(v) for v in re.findall(rf'^{h}_bucket{{le="[^"]+"}} (\d+)$', text, re.M)]
        assert counts == sorted(counts) and counts[-1] > 0
        assert re.search(rf'^{h}_bucket{{le="\+Inf"}} {counts[-1]}$', text, re.M)
        assert re.search(rf"^{h}_count {counts[-1]}$", text, re.M)
    http.get("/no/such/path")
    assert 'path="other",status="404"' in http.get("/metrics").text
