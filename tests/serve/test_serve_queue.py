"""One engine, many clients: concurrent requests each get their own answer, the queue bound
answers 503 (not a hang), and a client that leaves frees the engine."""
import concurrent.futures as cf
import time

import httpx
import pytest

from nq.generate import generate
from nq.loader.format import NanoqwenFile
from nq.ref import NumpyBackend
from nq.sample import SamplingParams
from nq.text import Tokenizer

LONG = {"prompt": "def long():", "max_tokens": 4000, "temperature": 0, "stream": True,
        "ignore_eos": True}  # ~seconds of work on the tiny model: holds the engine


def wait_for(cond, timeout=10.0):
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_eight_concurrent_clients_get_their_own_answers(server, tiny_nanoqwen):
    nf = NanoqwenFile(tiny_nanoqwen)
    tok = Tokenizer.from_nanoqwen(nf)
    backend = NumpyBackend.from_file(nf, max_len=512)
    questions = [f"Question {i}: what is {i} + {i}?" for i in range(8)]
    want = []
    for q in questions:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
        out, _ = generate(backend, ids, 10, SamplingParams(temperature=0, repeat_penalty=1.0),
                          tok.eos_ids)
        want.append(tok.decode([t for t in out if t not in tok.eos_ids]))

    def ask(i):
        body = {"messages": [{"role": "user", "content": questions[i]}], "max_tokens": 10,
                "temperature": 0, "stream": i % 2 == 1}
        with httpx.Client(base_url=server.url, timeout=60) as c:
            if not body["stream"]:
                return c.post("/v1/chat/completions", json=body).json()["choices"][0][
                    "message"]["content"]
            text = ""
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        import json
                        ch = json.loads(line[6:])["choices"]
                        text += ch[0]["delta"].get("content") or "" if ch else ""
            return text

    with cf.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(8)))
    assert got == want


def test_a_full_queue_answers_503_and_a_disconnect_frees_the_engine(server, http, metric):
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
    with http.stream("POST", "/v1/completions", json=LONG) as long:
        lines = long.iter_lines()  # kept: closing the iterator would close the connection
        next(line for line in lines if line.startswith("data: {"))  # running
        # a queued client that leaves gives its place back
        with http.stream("POST", "/v1/completions", json={**LONG, "max_tokens": 5}) as r:
            assert r.status_code == 200
            assert wait_for(lambda: metric("nq_queue_depth") == 1)
        assert wait_for(lambda: metric("nq_queue_depth") == 0)

        def post(_):
            with httpx.Client(base_url=server.url, timeout=60) as c:
                return c.post("/v1/completions", json=body)
        pool = cf.ThreadPoolExecutor(10)
        futures = [pool.submit(post, i) for i in range(10)]
        assert wait_for(lambda: sum(f.done() for f in futures) >= 2)
        time.sleep(0.3)  # nothing else finishes while the long request holds the engine
        done = [f.result() for f in futures if f.done()]
        assert len(done) == 2, [r.status_code for r in done]
        for r in done:
            assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["code"] == "queue_full"
        assert metric("nq_queue_depth") == 8 and metric("nq_requests_running") == 1
        generated = metric("nq_generated_tokens_total")
    # the long stream's client has gone: the engine stops it and serves the 8 waiting
    results = [f.result(timeout=30) for f in futures if f.result(timeout=30).status_code != 503]
    pool.shutdown()
    assert len(results) == 8 and all(r.status_code == 200 for r in results)
    assert all(r.json()["usage"]["completion_tokens"] == 2 for r in results)
    assert metric("nq_generated_tokens_total") - generated < LONG["max_tokens"]
    assert wait_for(lambda: metric("nq_requests_running") == 0)


def test_next_request_after_a_disconnect_is_served_normally(server, http):
    with http.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": 3000, "temperature": 0, "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(line for line in lines if line.startswith("data: {"))
    t = time.time()
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    assert time.time() - t < 5  # not behind 3000 tokens of an abandoned reply
    assert "Traceback" not in server.log()


def test_a_non_streamed_client_that_leaves_is_cancelled(server, http, metric):
    generated = metric("nq_generated_tokens_total")
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(server.url + "/v1/completions", timeout=0.5, json={
            "prompt": "x", "max_tokens": 4000, "temperature": 0, "ignore_eos": True})
    assert wait_for(lambda: metric("nq_requests_running") == 0)
    assert metric("nq_generated_tokens_total") - generated < 4000
