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


def test_set_parsing():
    from nq.chat import parse_set
    p = parse_set(GREEDY, "temp 0.7")
    assert p.temperature == 0.7 and p.top_k == GREEDY.top_k
    assert parse_set(p, "top-k 20").top_k == 20 and parse_set(p, "seed 9").seed == 9
    for bad, why in [("temp", "usage"), ("warmth 1", "usage"), ("top-k x", "not an integer"),
                     ("top-p 0", "top_p=0"), ("seed -2", "seed >= 0"), ("temp -1", "temperature")]:
        with pytest.raises(ValueError, match=why):
            parse_set(p, bad)


def test_repl_help_set_stats_and_unknown_commands(parts):
    backend, tok = parts
    chat = ChatSession(backend, tok, GREEDY, max_ctx=512)
    out, err = io.StringIO(), io.StringIO()
    lines = "/help\n/set temp 0.5\n/set top-k x\n/whatever\nHi\n/stats\n/bye\nnot read\n"
    assert repl(chat, 4, out=out, inp=io.StringIO(lines), err=err) == 0
    e = err.getvalue()
    assert "/set temp|top-k" in e and "nq: temp = 0.5" in e and "not an integer" in e
    assert "unknown command /whatever" in e
    assert chat.params.temperature == 0.5
    assert "temp 0.5" in e and "last reply:" in e
    assert len(chat.messages) == 2            # /bye ended it: "not read" was not sent


def test_context_shift_drops_the_oldest_turns(parts):
    backend, tok = parts
    chat = ChatSession(backend, tok, GREEDY, max_ctx=80, system="S", context_shift=True)
    for i in range(6):
        chat.turn(f"message number {i}", 6)
        assert backend.length == len(chat.fed) and len(chat.fed) + 1 <= 80
    users = [m["content"] for m in chat.messages if m["role"] == "user"]
    assert users[-1] == "message number 5" and "message number 0" not in users
    assert chat.messages[0] == {"role": "system", "content": "S"}
    strict = ChatSession(backend, tok, GREEDY, max_ctx=80, system="S")
    with pytest.raises(ValueError, match="--context-shift"):
        for i in range(6):
            strict.turn(f"message number {i}", 6)


class Interrupting:
    """A backend that raises KeyboardInterrupt (Ctrl-C) on its k-th decode."""

    def __init__(self, inner, k):
        self.inner, self.k, self.calls = inner, k, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode(self, token):
        self.calls += 1
        if self.calls == self.k:
            raise KeyboardInterrupt
        return self.inner.decode(token)


def test_ctrl_c_stops_the_reply_and_keeps_the_session(parts):
    backend, tok = parts
    wrapped = Interrupting(backend, 3)
    chat = ChatSession(wrapped, tok, GREEDY, max_ctx=512)
    reply, stats = chat.turn("Hello", 20)
    assert stats.stop_reason == "interrupted" and stats.generated_tokens == 3
    assert backend.length == len(chat.fed)    # the cache holds what the session thinks
    wrapped.k = -1
    # the next turn answers as a fresh prefill of the conversation would
    r2, _ = chat.turn("More", 6)
    assert r2 == fresh_reply(backend, tok, chat.messages[:-1], 6)


def test_nq_chat_under_a_terminal(tiny_nanoqwen):
    """Two turns, /set, Ctrl-C (SIGINT) during a reply, and an answer afterwards, on a pty."""
    import os
    import pty
    import select
    import signal
    import subprocess
    import sys
    import time
    pid, fd = pty.fork()
    if pid == 0:
        # a background job's children start with SIGINT ignored; nq must see it as a terminal would
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execvpe(sys.executable, [sys.executable, "-m", "nq", "chat", "--backend", "numpy",
                                    "-m", str(tiny_nanoqwen), "--temp", "0", "-n", "1200", "-c", "5000"],
                   dict(os.environ, PYTHONUNBUFFERED="1"))
    buf = b""

    def read_until(token, timeout=60):
        # only what arrived since the last write: a random model's reply may hold any token
        nonlocal buf
        start = sent
        end = time.time() + timeout
        while token not in buf[start:] and time.time() < end:
            r, _, _ = select.select([fd], [], [], 0.2)
            if r:
                try:
                    buf += os.read(fd, 4096)
                except OSError:
                    break
        assert token in buf[start:], (f"SIGINT here: {signal.getsignal(signal.SIGINT)}\n"
                                      + buf.decode(errors="replace")[-2000:])

    def write(line):
        nonlocal sent
        sent = len(buf)
        os.write(fd, line)

    sent = 0
    try:
        read_until(b"/help for commands")
        write(b"Hello\n")
        read_until(b"generated;")
        write(b"/set temp 0.3\n")
        read_until(b"temp = 0.3")
        write(b"Tell me a long story about code\n")
        read_until(b"code\r\n")                  # the echo; then the reply starts streaming
        mark = len(buf)
        while len(buf) < mark + 40:              # the reply is streaming (1200 tokens: ~1 s; 400
                                                  # took 0.2 s and could end before the signal)
            r, _, _ = select.select([fd], [], [], 0.05)
            if r:
                buf += os.read(fd, 64)
        os.kill(pid, signal.SIGINT)
        read_until(b"reply stopped")
        n_before = buf.count(b"generated;")
        write(b"Again\n")
        end = time.time() + 120                  # the program still answers: a new reply
        while buf.count(b"generated;") <= n_before and time.time() < end:
            r, _, _ = select.select([fd], [], [], 0.2)
            if r:
                buf += os.read(fd, 65536)
        assert buf.count(b"generated;") > n_before, buf.decode(errors="replace")[-2000:]
        write(b"/exit\n")
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        subprocess.run(["true"])


def test_a_sampled_turn_penalises_the_whole_conversation(parts):
    """With the repeat penalty over the whole history (generation_config's semantics), a turn
    that reuses the cache samples exactly as a fresh prefill of the rendered conversation: the
    cached tokens are in the penalty's window too."""
    backend, tok = parts
    params = SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.5,
                            repeat_last_n=-1, seed=11)
    chat = ChatSession(backend, tok, params, max_ctx=512)
    chat.turn("Hello there", 8)
    reply, _ = chat.turn("Again", 8)
    ids = tok.encode(tok.apply_chat_template(chat.messages[:-1], add_generation_prompt=True))
    out, _ = generate(backend, ids, 8, params, tok.eos_ids)
    assert reply == tok.decode([t for t in out if t not in tok.eos_ids])
