"""OpenAI's API: /v1/models, /v1/chat/completions, /v1/completions.

Request fields and response shapes follow the OpenAI API reference, so the official SDKs,
Continue and aider work unchanged.  Differences, each refused with a 400 naming the field
rather than silently ignored: one choice (n = 1), no tools or function calling, no logprobs,
no JSON mode (response_format other than text), no echo or best_of, text-only message parts.

- Sampling fields: see nq/serve/params.py (unset ones take the model's defaults, as
  `nq generate` does); `ignore_eos` (llama.cpp's) is accepted as an extension.
- max_tokens / max_completion_tokens is capped by the context: a reply stops when the context
  is full, with finish_reason "length", rather than being refused up front (editors ask for
  a fixed budget whatever the prompt).  Unset: the rest of the context for chat, 16 for
  completions (OpenAI's defaults: unbounded and 16).
- `suffix` on /v1/completions makes a fill-in-the-middle prompt (the model's FIM tokens).
- usage carries prompt_tokens_details.cached_tokens: prompt tokens the prompt cache served.
- Streaming: `data: {chunk}` events ending in `data: [DONE]`; with
  stream_options.include_usage a last chunk carries usage and no choices.
"""
from __future__ import annotations

import time
import uuid

from starlette.responses import JSONResponse

from nq.serve import params as P
from nq.serve.http import read_json, result, stream, submit
from nq.serve.engine import Request

FINGERPRINT = "nq"
ROLES = ("system", "developer", "user", "assistant")


async def models(request):
    s = request.app.state.nq
    return JSONResponse({"object": "list", "data": [{
        "id": s.model_id, "object": "model", "created": s.created, "owned_by": "nq",
        "meta": {"n_ctx": s.ctx, "n_vocab": s.vocab, "backend": s.backend}}]})


def _unsupported(body: dict) -> None:
    P.one_choice(body)
    P.refuse(body, "logprobs", lambda v: not v, "log probabilities are not returned")
    P.refuse(body, "top_logprobs", lambda v: not v, "log probabilities are not returned")
    P.refuse(body, "logit_bias", lambda v: not v, "logit_bias is not supported")


def _request(body: dict, state, ids: list[int], param: str, default_max: int | None) -> Request:
    params, presence, frequency = P.sampling(body, state.defaults)
    P.prompt_fits(len(ids), state.ctx, param)
    room = state.ctx - len(ids)
    asked = P.number(body, "max_completion_tokens", default_max, lo=1, integer=True,
                     names=("max_tokens",))
    return Request(prompt_ids=ids, max_tokens=room if asked is None else min(asked, room),
                   params=params, stop=P.stop_strings(body),
                   stop_ids=() if P.flag(body, "ignore_eos") else tuple(state.tok.eos_ids),
                   presence=presence, frequency=frequency)


def _usage(res) -> dict:
    return {"prompt_tokens": res.prompt_tokens, "completion_tokens": len(res.ids),
            "total_tokens": res.prompt_tokens + len(res.ids),
            "prompt_tokens_details": {"cached_tokens": res.cached_tokens}}


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise P.bad("messages", "give a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise P.bad(where, "expected an object with role and content")
        role = m.get("role")
        if role == "tool" or m.get("tool_calls") or m.get("function_call"):
            raise P.bad(where, "tool calls are not supported", code="unsupported_parameter")
        if role not in ROLES:
            raise P.bad(f"{where}.role", f"{role!r}; give one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise P.bad(f"{where}.content[{j}]", "only text parts ({\"type\": \"text\", "
                                "\"text\": ...}) are supported", code="unsupported_parameter")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise P.bad(f"{where}.content", "give a string or a list of text parts")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _chat_ids(state, messages) -> list[int]:
    import jinja2

    from nq.text import TokenizerError
    try:
        text = state.tok.apply_chat_template(messages, add_generation_prompt=True)
    except (TokenizerError, jinja2.TemplateError) as e:
        raise P.bad("messages", f"the model's chat template refused them: {e}")
    return state.tok.encode(text)


async def chat_completions(request):
    state = request.app.state.nq
    body = await read_json(request)
    state.check_model(body)
    _unsupported(body)
    P.refuse(body, "tools", lambda v: not v, "tool calls are not supported; send no tools")
    P.refuse(body, "functions", lambda v: not v, "function calling is not supported")
    P.refuse(body, "response_format", lambda v: isinstance(v, dict) and v.get("type") == "text",
             "only {\"type\": \"text\"} is supported (no JSON mode or schemas)")
    ids = _chat_ids(state, _messages(body))
    req = _request(body, state, ids, "messages", None)
    streamed = P.flag(body, "stream")
    usage_chunk = streamed and bool((body.get("stream_options") or {}).get("include_usage"))
    job = submit(state, req)
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": state.model_id, "system_fingerprint": FINGERPRINT}
    if not streamed:
        res = await result(request, job)
        return JSONResponse({**base, "object": "chat.completion", "choices": [{
            "index": 0, "message": {"role": "assistant", "content": res.text},
            "logprobs": None, "finish_reason": res.finish}], "usage": _usage(res)})

    def chunk(delta, finish=None):
        return {**base, "object": "chat.completion.chunk", "choices": [{
            "index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    def done(res):
        yield chunk({}, res.finish)
        if usage_chunk:
            yield {**base, "object": "chat.completion.chunk", "choices": [],
                   "usage": _usage(res)}
    return stream(job, [chunk({"role": "assistant", "content": ""})],
                  lambda text: chunk({"content": text}), done, tail=b"data: [DONE]\n\n")


def _prompt_ids(state, body: dict) -> list[int]:
    prompt, suffix = body.get("prompt"), P.string(body, "suffix")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise P.bad("prompt", f"{len(prompt)} prompts; nq serves one at a time, send them "
                    "as separate requests")
    if isinstance(prompt, list):
        if suffix is not None:
            raise P.bad("suffix", "give the prompt as text to use a suffix")
        return P.token_ids(prompt, "prompt", state.vocab)
    if not isinstance(prompt, str):
        raise P.bad("prompt", "give a string, or a list of token ids")
    if suffix is None:
        return state.tok.encode(prompt)
    from nq.text import TokenizerError
    try:
        return state.tok.encode(state.tok.fim_prompt(prompt, suffix))
    except TokenizerError as e:
        raise P.bad("suffix", str(e))


async def completions(request):
    state = request.app.state.nq
    body = await read_json(request)
    state.check_model(body)
    _unsupported(body)
    P.refuse(body, "echo", lambda v: v is False, "echo is not supported")
    P.refuse(body, "best_of", lambda v: v == 1, "best_of must be 1 (one sequence at a time)")
    ids = _prompt_ids(state, body)
    req = _request(body, state, ids, "prompt", 16)
    streamed = P.flag(body, "stream")
    usage_chunk = streamed and bool((body.get("stream_options") or {}).get("include_usage"))
    job = submit(state, req)
    base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": state.model_id,
            "system_fingerprint": FINGERPRINT}

    def choice(text, finish=None):
        return {**base, "choices": [{"text": text, "index": 0, "logprobs": None,
                                     "finish_reason": finish}]}
    if not streamed:
        res = await result(request, job)
        return JSONResponse({**choice(res.text, res.finish), "usage": _usage(res)})

    def done(res):
        yield choice("", res.finish)
        if usage_chunk:
            yield {**base, "choices": [], "usage": _usage(res)}
    return stream(job, [], choice, done, tail=b"data: [DONE]\n\n")
