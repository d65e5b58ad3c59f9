"""Request fields in, checked values out: the rules every endpoint shares, and its errors.

A client that sends a bad field gets a 400 whose error object names the field, in OpenAI's
shape (`{"error": {"message", "type", "param", "code"}}`), on every endpoint, llama.cpp's
included (llama.vim and llama.vscode only read the status).  Ranges follow the OpenAI API
reference where it defines the field, llama.cpp's server README where only it does.

Sampling fields map onto nq's sampler (nq/sample.py, llama.cpp's chain) like this:

  temperature [0, 2]      as is; 0 is greedy
  top_p (0, 1], top_k >= -1 (<= 0: off), min_p [0, 1]      as is
  repetition_penalty / repeat_penalty (> 0)   llama.cpp's multiplicative penalty over the
                          last `repeat_last_n` (default 64; -1: the whole context) tokens
  presence_penalty, frequency_penalty [-2, 2]   additive penalties, llama.cpp's server's
                          meaning: over the same `repeat_last_n` window (prompt included) as
                          the repetition penalty, applied after it (OpenAI counts generated
                          tokens only; one window keeps them on the device sampler)
  seed                    fixes the draw; absent or negative: fresh entropy

A field the request leaves out takes the model's generation_config.json default exactly as
`nq generate` does without the flag (nq.backend.sampling_params), so `temperature: 0` through the
server gives `nq generate --temp 0`'s tokens.
"""
from __future__ import annotations

import dataclasses
import json
import math
import types

NO_DEFAULT = object()


class APIError(Exception):
    """An error response: HTTP status, a message that says what to change, the field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {400: "invalid_request_error", 401: "invalid_request_error",
                             404: "not_found_error", 413: "invalid_request_error",
                             503: "server_error"}.get(status, "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def bad(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def number(body: dict, name: str, default=None, lo=None, hi=None, lo_open=False,
           integer=False, names=()):
    """body[name] (or the first of `names` present) as a number in range; None/absent: default."""
    for key in (name, *names):
        if body.get(key) is not None:
            name, v = key, body[key]
            break
    else:
        return default
    if not (_is_int(v) if integer else _is_num(v)):
        raise bad(name, f"{v!r} is not {'an integer' if integer else 'a number'}")
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        span = f"{'(' if lo_open else '['}{'-inf' if lo is None else lo}, " \
               f"{'inf' if hi is None else hi}]"
        raise bad(name, f"{v} is outside {span}")
    return v


def _typed(body: dict, name: str, kind: type, default, what: str):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, kind):
        raise bad(name, f"expected {what}, got {json.dumps(v)[:40]}")
    return v


def flag(body: dict, name: str, default: bool = False) -> bool:
    return _typed(body, name, bool, default, "true or false")


def string(body: dict, name: str, default: str | None = None) -> str | None:
    return _typed(body, name, str, default, "a string")


def stop_strings(body: dict, name: str = "stop") -> list[str]:
    """`stop`: null, a string or a list of strings (empty ones ignored)."""
    v = body.get(name)
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad(name, "give a string or a list of strings")
    if len(v) > 64:  # editors send a dozen or more (Continue: every FIM token, fences, ...)
        raise bad(name, f"{len(v)} stop strings; give at most 64")
    return [s for s in v if s]


def refuse(body: dict, name: str, ok, why: str) -> None:
    """A field nq does not implement: refused unless it holds a harmless value."""
    if name in body and body[name] is not None and not ok(body[name]):
        raise bad(name, why, code="unsupported_parameter")


def one_choice(body: dict) -> None:
    n = number(body, "n", 1, lo=1, integer=True)
    if n != 1:
        raise bad("n", f"{n} choices; nq generates one sequence at a time, give n = 1")


def sampling(body: dict, defaults: dict):
    """(SamplingParams, presence_penalty, frequency_penalty) from a request body."""
    from nq.backend import sampling_params

    temp = number(body, "temperature", lo=0, hi=2)
    penalty = number(body, "repetition_penalty", lo=0, lo_open=True, names=("repeat_penalty",))
    seed = number(body, "seed", -1, integer=True, lo=-2**63, hi=2**63 - 1)
    flags = types.SimpleNamespace(
        temp=temp, repeat_penalty=penalty, seed=-1 if seed < 0 else seed,
        top_k=number(body, "top_k", lo=-1, integer=True),
        top_p=number(body, "top_p", lo=0, hi=1, lo_open=True),
        min_p=number(body, "min_p", lo=0, hi=1))
    params = sampling_params(flags, defaults)
    last_n = number(body, "repeat_last_n", lo=-1, integer=True)
    if last_n is not None:
        params = dataclasses.replace(params, repeat_last_n=last_n)
    presence = float(number(body, "presence_penalty", 0.0, lo=-2, hi=2))
    frequency = float(number(body, "frequency_penalty", 0.0, lo=-2, hi=2))
    params = dataclasses.replace(params, presence_penalty=presence, frequency_penalty=frequency)
    return params, presence, frequency


def prompt_fits(n_prompt: int, ctx: int, param: str) -> None:
    """A prompt must leave room for at least one generated token."""
    if n_prompt == 0:
        raise bad(param, "the prompt is empty; give at least one token")
    if n_prompt >= ctx:
        raise APIError(400, f"{param}: this server's context is {ctx} tokens, and the prompt "
                       f"alone is {n_prompt}; shorten it, or restart `nq serve` with a larger -c",
                       param=param, code="context_length_exceeded")


def token_ids(v, param: str, vocab: int) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise bad(param, "give a list of token ids (integers)")
    for t in v:
        if not 0 <= t < vocab:
            raise bad(param, f"token id {t} is outside [0, {vocab})")
    return v
