"""Bad input gets its status and an OpenAI-style error naming the field; the API key is
enforced and never logged; the process stops cleanly on SIGINT."""
import signal
import sys

import httpx
import pytest

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]

BAD = [  # (path, body, the field the error names)
    (CHAT, {"messages": HI, "temperature": 3}, "temperature"),
    (CHAT, {"messages": HI, "temperature": "hot"}, "temperature"),
    (CHAT, {"messages": HI, "top_p": 0}, "top_p"),
    (CHAT, {"messages": HI, "top_k": 1.5}, "top_k"),
    (CHAT, {"messages": HI, "min_p": -0.1}, "min_p"),
    (CHAT, {"messages": HI, "presence_penalty": 2.5}, "presence_penalty"),
    (CHAT, {"messages": HI, "frequency_penalty": -3}, "frequency_penalty"),
    (CHAT, {"messages": HI, "repetition_penalty": 0}, "repetition_penalty"),
    (CHAT, {"messages": HI, "seed": "x"}, "seed"),
    (CHAT, {"messages": HI, "max_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": HI, "max_completion_tokens": -5}, "max_completion_tokens"),
    (CHAT, {"messages": HI, "n": 3}, "n"),
    (CHAT, {"messages": HI, "stop": 5}, "stop"),
    (CHAT, {"messages": HI, "stream": "yes"}, "stream"),
    (CHAT, {"messages": HI, "model": "gpt-4o"}, "model"),
    (CHAT, {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),
    (CHAT, {"messages": HI, "logprobs": True}, "logprobs"),
    (CHAT, {"messages": HI, "response_format": {"type": "json_object"}}, "response_format"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {}, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages[0].content[0]"),
    (CHAT, {"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": [1, 2], "suffix": "x"}, "suffix"),
    ("/infill", {"input_prefix": 3}, "input_prefix"),
    ("/infill", {"input_prefix": "a", "n_predict": -2}, "n_predict"),
    ("/infill", {"input_prefix": "a", "input_extra": [{"text": 1}]}, "input_extra[0]"),
    ("/infill", {"input_prefix": "a", "n_indent": -1}, "n_indent"),
    ("/tokenize", {"text": "a"}, "content"),
    ("/detokenize", {"tokens": [1, "a"]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{p}:{f}" for p, _, f in BAD])
def test_bad_fields_are_named(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert param in err["message"]


def test_bad_bodies(http):
    r = http.post(CHAT, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = http.post(CHAT, json=[1, 2])
    assert r.status_code == 400 and "object" in r.json()["error"]["message"]
    r = http.post(CHAT, content=b"{\"messages\": \"" + b"x" * (9 << 20) + b"\"}")
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "/v1/nothing" in r.json()["error"]["message"]
    assert http.get(CHAT).status_code == 405


def test_a_prompt_over_the_context(http):
    r = http.post("/v1/completions", json={"prompt": "word " * 5000})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert "4096" in err["message"]
    # max_tokens past the context is capped, not refused: the reply stops at the full context
    ids = http.post("/tokenize", json={"content": "word " * 4090}).json()["tokens"]
    r = http.post("/v1/completions", json={"prompt": ids[:4090], "max_tokens": 100,
                                           "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    assert r.json()["choices"][0]["finish_reason"] == "length"


KEY = "s3cret-test-key-0123"


@pytest.fixture(scope="module")
def keyed(start, tiny_nanoqwen, tmp_path_factory):
    s = start(tiny_nanoqwen, tmp_path_factory.mktemp("keyed") / "server.log",
                     "-c", "256", "--queue", "0", "--api-key", KEY)
    yield s
    if s.proc.poll() is None:
        s.stop()


def test_the_api_key_is_enforced_and_never_logged(keyed):
    openai = pytest.importorskip("openai")
    with httpx.Client(base_url=keyed.url, timeout=30) as c:
        assert c.get("/health").status_code == 200  # liveness probes need no key
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = c.post(CHAT, json={"messages": HI, "max_tokens": 2}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert KEY not in r.text
        for path in ("/v1/models", "/metrics"):
            assert c.get(path).status_code == 401
        ok = c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model="tiny", prompt="a", max_tokens=2).usage
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0) \
            .models.list()
    assert KEY not in keyed.log()


def test_sigint_stops_the_server_cleanly(keyed):
    assert keyed.stop(signal.SIGINT) == 0
    assert "server stopped" in keyed.log() and "Traceback" not in keyed.log()


def test_without_starlette_the_error_says_what_to_install(monkeypatch):
    import nq.serve
    monkeypatch.setitem(sys.modules, "starlette", None)
    with pytest.raises(RuntimeError, match=r'pip install "nq\[serve\]"'):
        nq.serve.main(None)
