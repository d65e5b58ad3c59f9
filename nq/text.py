"""Text in and out: tokenizer, chat template, FIM prompts, stop ids, streaming detokenisation.

A thin layer over the `tokenizers` library (no transformers at run time) that reads the three
files a Qwen2.5 snapshot ships -- tokenizer.json, tokenizer_config.json (special tokens, chat
template), generation_config.json (stop ids, sampling defaults) -- from a folder, from bytes,
or from the meta blobs of a .nanoqwen file, which is self-contained.

The chat template is rendered the way transformers renders it (same Jinja environment, same
globals and variables), so a prompt built here tokenises to exactly the ids the model saw in
training-time formatting; tests/test_text.py compares against transformers.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"
# The named special tokens transformers passes to a chat template (its special_tokens_map).
TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                   "cls_token", "mask_token")
GENERATION_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "do_sample")


class TokenizerError(ValueError):
    """Tokenizer files that are missing or unusable; the message names the file and the fix."""


def _json(data: bytes | str | None, what: str) -> dict:
    if data is None:
        return {}
    try:
        out = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{what} is not valid JSON ({e}); re-download the model "
                             "or re-pack it with `nq pack`") from None
    if not isinstance(out, dict):
        raise TokenizerError(f"{what} holds a {type(out).__name__}, expected a JSON object")
    return out


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """tokenizers.Tokenizer plus what tokenizer_config.json and generation_config.json add."""

    def __init__(self, tokenizer: HFTokenizer, config: dict | None = None,
                 generation_config: dict | None = None, chat_template: str | None = None,
                 source: str = "tokenizer"):
        self.tok = tokenizer
        self.config = config or {}
        self.generation_config = generation_config or {}
        self.source = source
        self._chat_template = chat_template if chat_template is not None else \
            self._template_from_config(self.config)
        self._compiled = None

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_blobs(cls, tokenizer_json: bytes | str, tokenizer_config: bytes | str | None = None,
                   generation_config: bytes | str | None = None,
                   chat_template: bytes | str | None = None,
                   source: str = "tokenizer blobs") -> "Tokenizer":
        """From file contents (the .nanoqwen meta blobs); only tokenizer.json is required."""
        if isinstance(tokenizer_json, bytes):
            tokenizer_json = tokenizer_json.decode("utf-8")
        try:
            tok = HFTokenizer.from_str(tokenizer_json)
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            raise TokenizerError(f"{source}: tokenizer.json is unusable ({e}); re-download "
                                 "the model or re-pack it with `nq pack`") from None
        if isinstance(chat_template, bytes):
            chat_template = chat_template.decode("utf-8")
        return cls(tok, _json(tokenizer_config, f"{source}: tokenizer_config.json"),
                   _json(generation_config, f"{source}: generation_config.json"),
                   chat_template, source)

    @classmethod
    def from_dir(cls, path) -> "Tokenizer":
        """From a Hugging Face snapshot folder."""
        d = Path(path)
        if not (d / "tokenizer.json").is_file():
            raise TokenizerError(f"{d}: no tokenizer.json; give a Hugging Face snapshot folder "
                                 "of a Qwen2/Qwen2.5 model (fast-tokenizer format)")

        def read(name):
            f = d / name
            return f.read_bytes() if f.is_file() else None

        # newer snapshots keep the template in its own file, which then takes precedence
        return cls.from_blobs(read("tokenizer.json"), read("tokenizer_config.json"),
                              read("generation_config.json"), read("chat_template.jinja"),
                              source=str(d))

    @classmethod
    def from_nanoqwen(cls, nf) -> "Tokenizer":
        """From an open NanoqwenFile's meta/ blobs."""
        def meta(name):
            return nf.meta(name) if "meta/" + name in nf else None

        if "meta/tokenizer.json" not in nf:
            raise TokenizerError(f"{nf.path}: no meta/tokenizer.json; re-pack with `nq pack` "
                                 "from a snapshot that has tokenizer.json")
        return cls.from_blobs(meta("tokenizer.json"), meta("tokenizer_config.json"),
                              meta("generation_config.json"), meta("chat_template.jinja"),
                              source=str(nf.path))

    # ---- tokens ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Text -> ids; special-token strings in `text` (e.g. `<|im_start|>`) become their ids."""
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def stream(self, skip_special_tokens: bool = False) -> "TextStream":
        """A fresh incremental detokeniser for one generation."""
        return TextStream(self.tok, skip_special_tokens)

    def special_token(self, name: str) -> str | None:
        """`bos_token`, `eos_token`, ... as tokenizer_config.json names them (None if unset)."""
        return _token_text(self.config.get(name))

    # ---- stop ids and sampling defaults ------------------------------------------------------
    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every stop id: generation_config.json's eos_token_id (int or list), then the
        tokenizer's eos token.  Qwen2.5-Instruct stops on both <|im_end|> and <|endoftext|>."""
        ids: list[int] = []
        gen = self.generation_config.get("eos_token_id")
        for i in gen if isinstance(gen, list) else [gen]:
            if i is not None:
                ids.append(int(i))
        eos = self.special_token("eos_token")
        if eos is not None and self.tok.token_to_id(eos) is not None:
            ids.append(self.tok.token_to_id(eos))
        return tuple(dict.fromkeys(ids))

    @property
    def generation_defaults(self) -> dict:
        """The sampling settings generation_config.json recommends (only those it sets)."""
        return {k: self.generation_config[k] for k in GENERATION_KEYS if k in self.generation_config}

    # ---- prompts ---------------------------------------------------------------------------
    @staticmethod
    def _template_from_config(config: dict) -> str | None:
        t = config.get("chat_template")
        if isinstance(t, list):  # several named templates: use the default one
            named = {e.get("name"): e.get("template") for e in t if isinstance(e, dict)}
            t = named.get("default")
        return t

    @property
    def chat_template(self) -> str:
        if not self._chat_template:
            raise TokenizerError(f"{self.source}: no chat template (neither tokenizer_config.json "
                                 "nor chat_template.jinja has one); this looks like a base "
                                 "model: prompt it with plain text instead of --chat")
        return self._chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) as transformers would."""
        if self._compiled is None:
            self._compiled = compile_chat_template(self.chat_template)
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise TokenizerError(f"chat message {m!r}: expected a dict with 'role' and 'content'")
        tokens = {k: self.special_token(k) for k in TEMPLATE_TOKENS}
        variables = {k: v for k, v in tokens.items() if v is not None}
        variables.update(kwargs)  # caller's variables win, as in transformers
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        return self._compiled.render(messages=messages,
                                     add_generation_prompt=add_generation_prompt, **variables)

    def fim_prompt(self, prefix: str, suffix: str) -> str:
        """Qwen2.5-Coder fill-in-the-middle: the model writes what goes between the two."""
        for t in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE):
            if self.tok.token_to_id(t) is None:
                raise TokenizerError(f"{self.source}: the tokenizer has no {t} token, so this "
                                     "model was not trained for fill-in-the-middle")
        return f"{FIM_PREFIX}{prefix}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}"


class TextStream:
    """Incremental detokenisation: `step(id)` returns the new text, or None while a multi-byte
    UTF-8 character is still incomplete (Qwen's byte-level BPE splits most non-ASCII
    characters across tokens, so decoding ids one by one would print replacement marks)."""

    def __init__(self, tok: HFTokenizer, skip_special_tokens: bool = False):
        self._tok = tok
        self._ds = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str | None:
        return self._ds.step(self._tok, int(token_id))


def compile_chat_template(source: str):
    """A Jinja template compiled in transformers' environment (sandboxed, trim/lstrip blocks,
    loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        # transformers' `{% generation %}` marks assistant text for training masks; rendering
        # only needs the body
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TokenizerError(f"the chat template does not parse (line {e.lineno}: {e.message}); "
                             "fix chat_template in tokenizer_config.json") from None
