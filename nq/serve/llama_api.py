"""llama.cpp's server API: /infill, /tokenize, /detokenize, in its request and response
shapes, so llama.vim and llama.vscode work against `nq serve` unchanged.

/infill builds the prompt as llama.cpp's format_infill does for a model with repo-level FIM
tokens (Qwen2.5-Coder):

    <|repo_name|>myproject\\n  (<|file_sep|>{filename}\\n{text})*  <|file_sep|>filename\\n
    <|fim_prefix|>{input_prefix}{prompt}<|fim_suffix|>{input_suffix}<|fim_middle|>

`input_extra` chunks come first so that the prompt cache keeps them from one keystroke to
the next.  (Without those tokens a chunk is introduced by "\\n\\n--- snippet ---\\n\\n".)
When the prompt does not fit the context with n_predict, the oldest extra chunks go first,
then the prefix is cut from the start and the suffix from the end (3:1), and `truncated` is
true.  `n_predict: 0` only prefills (llama.vim warms the cache this way); `n_indent` and
`t_max_predict_ms` end a completion as llama.cpp does; `response_fields` selects and
flattens fields ("timings/prompt_n"); `t_max_prompt_ms`, `samplers` and `cache_prompt` are
accepted and ignored (the prompt is always cached).
"""
from __future__ import annotations

from starlette.responses import JSONResponse

from nq.serve import params as P
from nq.serve.http import read_json, result, stream, submit
from nq.serve.engine import Request
from nq.text import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX

REPO, FILE_SEP = "<|repo_name|>", "<|file_sep|>"
SNIPPET = "\n\n--- snippet ---\n\n"


class IndentStop:
    """llama.cpp's n_indent: once a line after the first starts with less indentation than
    n_indent (spaces and tabs), the completion ends there, keeping the newline and the short
    indentation.  A line's indentation is held back until it is known."""

    def __init__(self, n_indent: int):
        self.n = n_indent
        self.held: str | None = None  # "\n" plus the indentation seen so far

    def feed(self, text: str) -> tuple[str, bool]:
        out = []
        for ch in text:
            if self.held is not None:
                if ch in " \t":
                    self.held += ch
                    continue
                out.append(self.held)
                short = len(self.held) - 1 < self.n
                self.held = None
                if short:
                    return "".join(out), True
            if ch == "\n":
                self.held = "\n"
            else:
                out.append(ch)
        return "".join(out), False

    def flush(self) -> str:
        out, self.held = self.held or "", None
        return out


def infill_ids(tok, prefix: str, suffix: str, extra: list[dict], budget: int):
    """(prompt ids, truncated) for llama.cpp's infill fields, at most `budget` tokens."""
    for t in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE):
        if tok.token_to_id(t) is None:
            raise P.bad("input_prefix", f"this model has no {t} token: it was not trained for "
                        "fill-in-the-middle; use a Qwen2.5-Coder model")
    repo = tok.token_to_id(REPO) is not None and tok.token_to_id(FILE_SEP) is not None
    head = tok.encode(f"{REPO}myproject\n") if repo else []
    chunks = [tok.encode(f"{FILE_SEP}{c['filename']}\n{c['text']}" if repo
                         else SNIPPET + c["text"]) for c in extra]
    tail = tok.encode(f"{FILE_SEP}filename\n") if repo else []
    pre = tok.encode(prefix)
    suf = tok.encode(suffix)
    truncated = False
    room = budget - 3  # the three FIM tokens
    if len(pre) + len(suf) > room:
        truncated = True
        n_suf = min(len(suf), max(room // 4, room - len(pre)))
        n_pre = room - n_suf
        pre, suf = pre[max(len(pre) - n_pre, 0):], suf[:n_suf]
    local = ([tok.token_to_id(FIM_PREFIX)] + pre + [tok.token_to_id(FIM_SUFFIX)] + suf
             + [tok.token_to_id(FIM_MIDDLE)])
    while chunks and len(head) + sum(map(len, chunks)) + len(tail) + len(local) > budget:
        chunks.pop(0)
        truncated = True
    if not chunks and len(head) + len(tail) + len(local) > budget:
        head, tail = [], []
    return head + [t for c in chunks for t in c] + tail + local, truncated


def _extra(body: dict) -> list[dict]:
    v = body.get("input_extra") or []
    if not isinstance(v, list):
        raise P.bad("input_extra", "give a list of {filename, text} objects")
    out = []
    for i, c in enumerate(v):
        if not isinstance(c, dict) or not isinstance(c.get("text", ""), str) \
                or not isinstance(c.get("filename", ""), str):
            raise P.bad(f"input_extra[{i}]", "expected {\"filename\": string, \"text\": string}")
        out.append({"filename": c.get("filename") or "tmp", "text": c.get("text") or ""})
    return out


def _pick(obj: dict, fields) -> dict:
    """llama.cpp's response_fields: only these, nested ones flattened as "a/b"."""
    out = {}
    for path in fields:
        v, found = obj, True
        for key in str(path).split("/"):
            if isinstance(v, dict) and key in v:
                v = v[key]
            else:
                found = False
                break
        if found:
            out[path] = v
    return out


async def infill(request):
    state = request.app.state.nq
    body = await read_json(request)
    prefix = P.string(body, "input_prefix", "") + P.string(body, "prompt", "")
    suffix = P.string(body, "input_suffix", "")
    n_predict = P.number(body, "n_predict", -1, lo=-1, integer=True)
    params, presence, frequency = P.sampling(body, state.defaults)
    n_indent = P.number(body, "n_indent", 0, lo=0, integer=True)
    fields = body.get("response_fields")
    if fields is not None and not isinstance(fields, list):
        raise P.bad("response_fields", "give a list of field names")
    budget = state.ctx - max(n_predict, 1)
    if budget < 4:
        raise P.bad("n_predict", f"{n_predict} leaves no room for a prompt in the context of "
                    f"{state.ctx} tokens")
    ids, truncated = infill_ids(state.tok, prefix, suffix, _extra(body), budget)
    room = state.ctx - len(ids)
    req = Request(prompt_ids=ids, max_tokens=room if n_predict < 0 else min(n_predict, room),
                  params=params, stop=P.stop_strings(body),
                  stop_ids=() if P.flag(body, "ignore_eos") else tuple(state.tok.eos_ids),
                  presence=presence, frequency=frequency,
                  t_max_predict_ms=P.number(body, "t_max_predict_ms", 0, lo=0),
                  text_filter=IndentStop(n_indent) if n_indent > 0 else None)
    settings = {"n_predict": n_predict, "temperature": params.temperature, "top_k": params.top_k,
                "top_p": params.top_p, "min_p": params.min_p,
                "repeat_penalty": params.repeat_penalty, "repeat_last_n": params.repeat_last_n,
                "presence_penalty": presence, "frequency_penalty": frequency,
                "seed": -1 if params.seed is None else params.seed, "stop": req.stop,
                "n_indent": n_indent, "t_max_predict_ms": req.t_max_predict_ms}
    want_ids = P.flag(body, "return_tokens")
    job = submit(state, req)

    def final(res, content):
        n_new, n_out = res.prompt_tokens - res.cached_tokens, len(res.ids)
        prompt_ms, predicted_ms = res.prefill_s * 1e3, res.decode_s * 1e3
        obj = {"index": 0, "content": content, "tokens": res.ids if want_ids else [],
               "id_slot": 0, "stop": True, "model": state.model_id,
               "tokens_predicted": n_out, "tokens_evaluated": res.prompt_tokens,
               "generation_settings": settings, "prompt": state.tok.decode(ids),
               "has_new_line": "\n" in res.text, "truncated": truncated,
               "stop_type": res.stop_type, "stopping_word": res.stopping_word,
               "tokens_cached": res.tokens_cached,
               "timings": {"cache_n": res.cached_tokens, "prompt_n": n_new,
                           "prompt_ms": prompt_ms,
                           "prompt_per_token_ms": prompt_ms / n_new if n_new else 0.0,
                           "prompt_per_second": n_new / res.prefill_s if res.prefill_s else 0.0,
                           "predicted_n": n_out, "predicted_ms": predicted_ms,
                           "predicted_per_token_ms": predicted_ms / max(n_out - 1, 1),
                           "predicted_per_second":
                               (n_out - 1) / res.decode_s if res.decode_s > 0 else 0.0}}
        return obj if fields is None else _pick(obj, fields)

    if not P.flag(body, "stream"):
        res = await result(request, job)
        return JSONResponse(final(res, res.text))
    return stream(job, [], lambda text: {"index": 0, "content": text, "tokens": [],
                                         "stop": False, "id_slot": 0},
                  lambda res: [final(res, "")])


async def tokenize(request):
    state = request.app.state.nq
    body = await read_json(request)
    content = body.get("content")
    if not isinstance(content, str):
        raise P.bad("content", "give the text to tokenize as a string")
    ids = state.tok.encode(content, add_special_tokens=P.flag(body, "add_special"))
    if not P.flag(body, "with_pieces"):
        return JSONResponse({"tokens": ids})
    return JSONResponse({"tokens": [{"id": i, "piece": piece(state.tok, i)} for i in ids]})


async def detokenize(request):
    state = request.app.state.nq
    body = await read_json(request)
    ids = P.token_ids(body.get("tokens"), "tokens", state.vocab)
    return JSONResponse({"content": state.tok.decode(ids)})


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character that stands for each
    byte in a byte-level BPE vocabulary (Qwen's) -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


BYTE_DECODER = _byte_decoder()


def piece(tok, i: int):
    """One token's text as llama.cpp's with_pieces gives it: a string when its bytes are valid
    UTF-8, else the list of byte values (byte-level BPE splits most non-ASCII characters)."""
    text = tok.tok.id_to_token(i)
    if text is None:
        return ""
    if i in tok.tok.get_added_tokens_decoder():
        return text
    try:
        raw = bytes(BYTE_DECODER[c] for c in text)
    except KeyError:  # not a byte-level vocabulary
        return text
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)
