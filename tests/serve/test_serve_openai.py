"""The OpenAI routes through the official `openai` client: chat and completions, streamed and
not, greedy text identical to `nq generate --json --backend numpy --temp 0`."""
import json

import pytest

from nq.cli import main


def nq_generate(capsys, model, *argv) -> dict:
    assert main(["generate", "-m", str(model), "--backend", "numpy", "--json", "--temp", "0",
                 *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_models(oai):
    ids = [m.id for m in oai.models.list().data]
    assert ids == ["tiny"]


def test_chat_greedy_equals_nq_generate(oai, tiny_nanoqwen, capsys):
    want = nq_generate(capsys, tiny_nanoqwen, "--chat", "-p", "Write a haiku", "-n", "12")
    r = oai.chat.completions.create(model="tiny", temperature=0, max_tokens=12,
                                    messages=[{"role": "user", "content": "Write a haiku"}])
    assert r.object == "chat.completion"
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == want["text"]
    assert c.finish_reason == ("length" if want["stats"]["stop_reason"] == "length" else "stop")
    assert r.usage.prompt_tokens == len(want["prompt_ids"])
    assert r.usage.completion_tokens == len(want["ids"])
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_equals_the_whole_reply(oai):
    kw = dict(model="tiny", temperature=0, max_tokens=10,
              messages=[{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                     {"type": "text", "text": "there"}]}])
    whole = oai.chat.completions.create(**kw)
    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                              **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == whole.choices[0].finish_reason and not any(finish[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_completions_greedy_equals_nq_generate(oai, tiny_nanoqwen, capsys):
    want = nq_generate(capsys, tiny_nanoqwen, "-p", "def fibonacci(n):", "-n", "9")
    r = oai.completions.create(model="tiny", prompt="def fibonacci(n):", max_tokens=9,
                               temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == want["text"]
    assert r.usage.completion_tokens == len(want["ids"])
    chunks = list(oai.completions.create(model="tiny", prompt="def fibonacci(n):", max_tokens=9,
                                         temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want["text"]
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_completions_suffix_is_fill_in_the_middle(oai, tiny_nanoqwen, capsys):
    want = nq_generate(capsys, tiny_nanoqwen, "--fim-prefix", "def f(x):\n    return ",
                       "--fim-suffix", "\n\nprint(f(2))\n", "-n", "8")
    r = oai.completions.create(model="tiny", prompt="def f(x):\n    return ", max_tokens=8,
                               suffix="\n\nprint(f(2))\n", temperature=0)
    assert r.choices[0].text == want["text"]
    assert r.usage.prompt_tokens == len(want["prompt_ids"])


def test_completions_default_max_tokens_is_16_and_token_prompts(oai, http):
    ids = http.post("/tokenize", json={"content": "class Stack:"}).json()["tokens"]
    r = oai.completions.create(model="tiny", prompt=ids, temperature=0,
                               extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids)
    text = oai.completions.create(model="tiny", prompt="class Stack:", temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    assert r.choices[0].text == text


def test_stop_strings_cut_the_text(oai):
    base = oai.completions.create(model="tiny", prompt="import os\n", max_tokens=24,
                                  temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    assert len(text) > 4
    stop = text[2:4]  # surely in the text; may span tokens
    r = oai.completions.create(model="tiny", prompt="import os\n", max_tokens=24,
                               temperature=0, stop=[stop, "never appears"],
                               extra_body={"ignore_eos": True})
    assert r.choices[0].text == text[:text.find(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_sampling_is_seeded_and_penalties_apply(oai):
    kw = dict(model="tiny", prompt="x = [", max_tokens=12, temperature=1.0, top_p=0.95,
              extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01})
    a = oai.completions.create(seed=7, **kw).choices[0].text
    b = oai.completions.create(seed=7, **kw).choices[0].text
    assert a == b
    greedy = dict(model="tiny", prompt="x = [", max_tokens=24, temperature=0,
                  extra_body={"ignore_eos": True})
    plain = oai.completions.create(**greedy)
    pen = oai.completions.create(frequency_penalty=2.0, presence_penalty=2.0, **greedy)
    assert plain.usage.completion_tokens == pen.usage.completion_tokens == 24
    assert pen.choices[0].text != plain.choices[0].text  # greedy repeats; the penalties do not


def test_openai_client_sees_errors(oai):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="tiny", n=2,
                                    messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["param"] == "model" and "tiny" in e.value.body["message"]
