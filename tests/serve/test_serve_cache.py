"""The prompt cache: a request that shares a prefix with what the engine holds prefills only
the rest (usage.prompt_tokens_details.cached_tokens, /metrics), with the same greedy answer as
a fresh prefill; saved slots (--cache-slots 2) keep two conversations taking turns; and the
PromptCache itself, in process."""
import json

import numpy as np

from nq.chat import common_prefix
from nq.cli import main
from nq.generate import generate
from nq.loader.format import NanoqwenFile
from nq.ref import NumpyBackend
from nq.sample import SamplingParams
from nq.serve.prompt_cache import PromptCache
from nq.text import Tokenizer

GREEDY = SamplingParams(temperature=0, repeat_penalty=1.0)
DOC = "def area(r):\n    return 3.14159 * r * r\n\n\ndef perimeter(r):\n    return 2 * 3.14159 * r\n"


def tokens(http, text):
    return http.post("/tokenize", json={"content": text}).json()["tokens"]


def complete(http, prompt, n, **kw):
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                           **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_shared_prefix_is_prefilled_once(http, metric, tiny_nanoqwen, capsys):
    first, second = DOC, DOC + "\n\ndef volume(r):\n"
    complete(http, first, 1)  # the cache now holds exactly first's ids
    cached_before = metric("nq_prompt_tokens_cached_total")
    r = complete(http, second, 8)
    a, b = tokens(http, first), tokens(http, second)
    want = min(common_prefix(a, b), len(b) - 1)
    assert want > 10
    assert r["usage"]["prompt_tokens"] == len(b)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == want
    assert metric("nq_prompt_tokens_cached_total") - cached_before == want
    assert main(["generate", "-m", str(tiny_nanoqwen), "--backend", "numpy", "--json",
                 "--temp", "0", "-p", second, "-n", "8"]) == 0
    assert r["choices"][0]["text"] == json.loads(capsys.readouterr().out)["text"]


def test_a_chat_turn_reuses_the_previous_turn(http):
    msgs = [{"role": "user", "content": "Name a prime number."}]
    r1 = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 6,
                                                  "temperature": 0}).json()
    msgs += [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
             {"role": "user", "content": "And another one?"}]
    r2 = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 6,
                                                  "temperature": 0}).json()
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= r1["usage"]["prompt_tokens"]


def test_two_conversations_taking_turns_keep_their_slots(http):
    a, b = "# module alpha\n" + DOC, "// module beta\nint main() { return 0; }\n"
    complete(http, a, 1)
    complete(http, b, 1)  # cuts alpha from the live cache: it is saved in the second slot
    ra = complete(http, a + "\n# more", 1)
    rb = complete(http, b + "\n// more", 1)
    for r, text in ((ra, a), (rb, b)):
        cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
        full = tokens(http, text + "\n# more" if text == a else text + "\n// more")
        assert cached == min(common_prefix(tokens(http, text), full), len(full) - 1)
        assert cached > 15


# ---- PromptCache in process ---------------------------------------------------------------------
def test_prompt_cache_restores_saved_sequences_exactly(tiny_nanoqwen):
    nf = NanoqwenFile(tiny_nanoqwen)
    tok = Tokenizer.from_nanoqwen(nf)
    cache = PromptCache(NumpyBackend.from_file(nf, max_len=512), slots=2)
    fresh = NumpyBackend.from_file(nf, max_len=512)

    def run(text, n=6):
        ids = tok.encode(text)
        kept = cache.prepare(ids)
        out, _ = generate(cache.backend, ids[kept:], n, GREEDY, keep_context=True)
        cache.hold(ids + out[:-1])
        assert cache.backend.length == len(cache.ids)
        want, _ = generate(fresh, ids, n, GREEDY)
        assert out == want
        return kept

    assert run("alpha beta gamma delta") == 0
    assert run("one two three four") == 0  # alpha saved
    assert run("alpha beta gamma delta epsilon") > 0  # restored from its slot
    assert run("one two three four five") > 0  # and back
    assert len(cache.saved) == 1
    run("completely different text")  # one slot to save in: the older (alpha) is evicted
    assert len(cache.saved) == 1
    assert tok.decode(cache.saved[0][0]).startswith("one two three four five")


def test_one_slot_only_truncates(tiny_nanoqwen):
    nf = NanoqwenFile(tiny_nanoqwen)
    backend = NumpyBackend.from_file(nf, max_len=128)
    cache = PromptCache(backend, slots=1)
    backend.prefill(np.arange(10))
    cache.hold(list(range(10)))
    assert cache.prepare(list(range(5)) + [77, 78]) == 5 and backend.length == 5
    assert cache.prepare(list(range(5))) == 4  # at least one token is prefilled
    assert cache.saved == [] and backend.length == 4


def test_the_repeat_penalty_sees_the_cached_prefix(tiny_nanoqwen):
    """generate(history=...): a reused cache penalises as a fresh prefill of the whole prompt."""
    nf = NanoqwenFile(tiny_nanoqwen)
    backend = NumpyBackend.from_file(nf, max_len=64)
    start = Tokenizer.from_nanoqwen(nf).encode("def")
    ids = start + generate(backend, start, 20, GREEDY)[0]  # its own loop: the penalty bites
    params = SamplingParams(temperature=0, repeat_penalty=3.0, repeat_last_n=-1)
    fresh, _ = generate(backend, ids, 8, params)
    backend.reset()
    backend.prefill(ids[:-2])
    kept, _ = generate(backend, ids[-2:], 8, params, keep_context=True, history=ids[:-2])
    assert kept == fresh
    backend.truncate(len(ids) - 2)
    forgot, _ = generate(backend, ids[-2:], 8, params, keep_context=True)
    assert forgot != fresh  # without it the penalty would miss the cached tokens
