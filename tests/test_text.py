"""Tokenizer, chat template, FIM, stop ids and streaming detokenisation (nq.text).

The tokenizer is the synthetic Qwen2-style byte-level BPE of nq.loader.synth; the chat
template renderings are compared with transformers' own `apply_chat_template` on the same
files, since matching it is the point.
"""
import json

import pytest

from nq.loader.synth import (build_tokenizer_json, generation_config, special_token_ids,
                             tokenizer_config)
from nq.text import Tokenizer, TokenizerError

TEXT = "héllo wörld — 你好 🙂\ndef f(x):\n    return x + 1  # ünïcode"

# A Qwen2.5-style template with a tools branch: exercises tojson (non-ASCII kept),
# raise_exception, loop variables and the special-token variables transformers passes in.
TOOLS_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role not in ('system', 'user', 'assistant') %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- elif not (message.role == 'system' and loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- else %}
    {{- eos_token }}
{%- endif %}
"""


@pytest.fixture(scope="module")
def files():
    tj = build_tokenizer_json(512)
    ids = special_token_ids(tj)
    return {"tokenizer.json": tj,
            "tokenizer_config.json": json.dumps(tokenizer_config(tj)),
            "generation_config.json": json.dumps(
                generation_config(ids["<|im_end|>"], ids["<|endoftext|>"]))}


def write(dir, files):
    for name, text in files.items():
        (dir / name).write_text(text)
    return dir


@pytest.fixture(scope="module")
def tok(files, tmp_path_factory):
    return Tokenizer.from_dir(write(tmp_path_factory.mktemp("tok"), files))


def test_encode_decode_round_trip(tok):
    ids = tok.encode(TEXT)
    assert all(isinstance(i, int) for i in ids) and len(ids) > 10
    assert tok.decode(ids) == TEXT
    # special-token text becomes one special id, not a spelling of it
    im_start = tok.token_to_id("<|im_start|>")
    assert tok.encode("<|im_start|>user")[0] == im_start
    assert tok.decode([im_start], skip_special_tokens=True) == ""


def test_blobs_bytes_and_dir_agree(files, tok):
    blobs = Tokenizer.from_blobs(files["tokenizer.json"].encode(),
                                 files["tokenizer_config.json"].encode(),
                                 files["generation_config.json"].encode())
    assert blobs.encode(TEXT) == tok.encode(TEXT)
    assert blobs.eos_ids == tok.eos_ids


def test_stream_equals_full_decode_across_split_characters(tok):
    ids = tok.encode(TEXT)
    stream = tok.stream()
    pieces = [stream.step(i) for i in ids]
    # the byte-level BPE splits the multi-byte characters, so some steps must wait
    assert None in pieces
    assert "".join(p for p in pieces if p is not None) == TEXT
    assert all("\ufffd" not in p for p in pieces if p is not None)


def test_stream_can_skip_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\nhé<|im_end|>")
    stream = tok.stream(skip_special_tokens=True)
    assert "".join(filter(None, (stream.step(i) for i in ids))) == "assistant\nhé"


def test_chat_template_system_and_user_exact(tok):
    msgs = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Write quicksort in Python."}]
    assert tok.apply_chat_template(msgs) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWrite quicksort in Python.<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith(
        "quicksort in Python.<|im_end|>\n")


def _hf_tokenizer(dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(dir))


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],  # the template supplies Qwen's default system turn
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3? ünï"}],
]


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(files, tok, tmp_path, conv, gen):
    hf = _hf_tokenizer(write(tmp_path, files))
    msgs = CONVERSATIONS[conv]
    want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == want
    assert tok.encode(want) == hf(want, add_special_tokens=False)["input_ids"]


def test_tools_template_matches_transformers(files, tmp_path):
    cfg = json.loads(files["tokenizer_config.json"])
    cfg["chat_template"] = TOOLS_TEMPLATE
    d = write(tmp_path, {**files, "tokenizer_config.json": json.dumps(cfg)})
    ours, hf = Tokenizer.from_dir(d), _hf_tokenizer(d)
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {"city": "str"}}}]
    msgs = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Sunny"}]
    for kw in (dict(tools=tools, add_generation_prompt=True), dict(add_generation_prompt=False)):
        want = hf.apply_chat_template(msgs, tokenize=False, **kw)
        assert ours.apply_chat_template(msgs, **kw) == want
    assert '"météo"' in ours.apply_chat_template(msgs, tools=tools)
    assert ours.apply_chat_template(msgs, add_generation_prompt=False).endswith("Sunny<|im_end|>\n<|im_end|>")
    with pytest.raises(Exception, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_jinja_file_takes_precedence(files, tmp_path):
    d = write(tmp_path, {**files, "chat_template.jinja": "{{ messages[0]['content'] }}!"})
    assert Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}]) == "x!"


def test_fim_prompt(tok):
    p = tok.fim_prompt("def add(a, b):\n    ", "\n\nprint(add(1, 2))")
    assert p == "<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n\nprint(add(1, 2))<|fim_middle|>"
    ids = tok.encode(p)
    assert ids[0] == tok.token_to_id("<|fim_prefix|>") and ids[-1] == tok.token_to_id("<|fim_middle|>")


def test_eos_ids_and_generation_defaults(files, tok):
    ids = special_token_ids(files["tokenizer.json"])
    # generation_config's list first, then the tokenizer's eos (<|im_end|>, already there)
    assert tok.eos_ids == (ids["<|im_end|>"], ids["<|endoftext|>"])
    assert tok.generation_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                       "repetition_penalty": 1.05, "do_sample": True}
    # an int eos_token_id, and no generation config at all
    single = Tokenizer.from_blobs(files["tokenizer.json"], files["tokenizer_config.json"],
                                  json.dumps({"eos_token_id": ids["<|endoftext|>"]}))
    assert single.eos_ids == (ids["<|endoftext|>"], ids["<|im_end|>"])
    bare = Tokenizer.from_blobs(files["tokenizer.json"], files["tokenizer_config.json"])
    assert bare.eos_ids == (ids["<|im_end|>"],) and bare.generation_defaults == {}


def test_clear_errors(files, tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    no_template = Tokenizer.from_blobs(files["tokenizer.json"])
    with pytest.raises(TokenizerError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(TokenizerError, match="generation_config.json is not valid JSON"):
        Tokenizer.from_blobs(files["tokenizer.json"], None, b"{oops")
    with pytest.raises(TokenizerError, match="tokenizer.json is unusable"):
        Tokenizer.from_blobs(b'{"model": 3}')
    tj = json.loads(files["tokenizer.json"])
    tj["added_tokens"] = [t for t in tj["added_tokens"] if "fim" not in t["content"]]
    with pytest.raises(TokenizerError, match="fill-in-the-middle"):
        Tokenizer.from_blobs(json.dumps(tj)).fim_prompt("a", "b")


def test_from_nanoqwen_reads_the_packed_blobs(tmp_path):
    from nq.config import tiny_config
    from nq.loader.format import NanoqwenFile
    from nq.loader.hf import pack
    from nq.loader.synth import make_hf_snapshot

    snap = make_hf_snapshot(tmp_path / "snap", tiny_config(num_layers=1), seed=1)
    with NanoqwenFile(pack(str(snap), tmp_path / "m.nanoqwen", progress=False)) as nf:
        packed = Tokenizer.from_nanoqwen(nf)
    direct = Tokenizer.from_dir(snap)
    msgs = [{"role": "user", "content": TEXT}]
    assert packed.apply_chat_template(msgs) == direct.apply_chat_template(msgs)
    assert packed.encode(TEXT) == direct.encode(TEXT)
    assert packed.eos_ids == direct.eos_ids and len(packed.eos_ids) == 2
    assert packed.generation_defaults == direct.generation_defaults != {}
