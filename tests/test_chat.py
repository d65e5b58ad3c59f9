"""Multi-turn chat that keeps its KV cache (numpy backend, CPU): each turn's reply equals a
fresh generation over the whole rendered conversation, while prefilling only the new tokens."""
import io

import pytest

from nq.chat import ChatSession, common_prefix, repl
from nq.generate import generate
from nq.loader.format import NanoqwenFile
from nq.ref import NumpyBackend
from nq.sample import SamplingParams
from nq.text import Tokenizer

GREEDY = SamplingParams(temperature=0.0, repeat_penalty=1.0)


@pytest.fixture
def parts(tiny_nanoqwen):
    nf = NanoqwenFile(tiny_nanoqwen)
    return NumpyBackend.from_file(nf, max_len=512), Tokenizer.from_nanoqwen(nf)


def fresh_reply(backend, tok, messages, n):
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    out, _ = generate(backend, ids, n, GREEDY, tok.eos_ids)
    return tok.decode([t for t in out if t not in tok.eos_ids])


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([1, 2], [1, 2]) == 2


def test_turns_reuse_the_cache_and_match_a_fresh_prefill(parts, tiny_nanoqwen):
    backend, tok = parts
    chat = ChatSession(backend, tok, GREEDY, max_ctx=512, system="Be brief.")
    r1, s1 = chat.turn("Hello", 12)
    assert backend.length == len(chat.fed)
    r2, s2 = chat.turn("def fibonacci(n):", 12)
    assert backend.length == len(chat.fed)
    rendered = tok.encode(tok.apply_chat_template(chat.messages[:-1], add_generation_prompt=True))
    assert s2.prompt_tokens < len(rendered)  # only the new turn (and any re-tokenised tail)
    other = NumpyBackend.from_file(NanoqwenFile(tiny_nanoqwen), max_len=512)
    assert r2 == fresh_reply(other, tok, chat.messages[:-1], 12)
    assert chat.messages[-1] == {"role": "assistant", "content": r2}


def test_a_diverging_cache_is_truncated_not_reused(parts, tiny_nanoqwen):
    backend, tok = parts
    chat = ChatSession(backend, tok, GREEDY, max_ctx=512)
    chat.turn("Hello", 6)
    chat.fed[3] = (chat.fed[3] + 1) % 400  # as if the cache held something else from token 3
    r2, s2 = chat.turn("What is the capital of France?", 6)
    assert backend.length == len(chat.fed)
    other = NumpyBackend.from_file(NanoqwenFile(tiny_nanoqwen), max_len=512)
    assert r2 == fresh_reply(other, tok, chat.messages[:-1], 6)
    assert s2.prompt_tokens >= len(tok.encode(tok.apply_chat_template(chat.messages[:-1]))) - 3


def test_repl_commands_and_a_full_context(parts):
    backend, tok = parts
    chat = ChatSession(backend, tok, GREEDY, max_ctx=120)  # the default system prompt is ~60
    out, err = io.StringIO(), io.StringIO()
    inp = io.StringIO("Hello\n\n/reset\n" + "long " * 150 + "\nHi\n/exit\nnot read\n")
    assert repl(chat, 4, out=out, inp=inp, err=err) == 0
    log = err.getvalue()
    assert "context cleared" in log and "exceeds the context -c 120" in log
    assert log.count("generated") == 2  # "Hello" and "Hi"; the long line was refused
    assert len(chat.messages) == 2  # the session after /reset: Hi and its reply


def test_nq_chat_command_end_to_end(tiny_nanoqwen):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "nq", "chat", "--backend", "numpy", "-m",
                        str(tiny_nanoqwen), "--temp", "0", "-n", "5"],
                       input="Hello\nAnd again\n", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("generated") == 2 and r.stdout.count("\n") == 2
