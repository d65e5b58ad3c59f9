"""What every endpoint uses: the server's state, reading a bounded JSON body, submitting a job
to the engine, and waiting for it or streaming it as server-sent events.  The route modules
(openai_api.py, llama_api.py) and app.py import it; it imports neither."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time

from starlette.responses import StreamingResponse

from nq.serve.engine import Engine, Job, QueueFull, Request
from nq.serve.metrics import Metrics
from nq.serve.params import APIError

MAX_BODY = 8 << 20   # bytes; a 32K-token prompt is ~130 KB of text, input_extra a few times that
OPEN_PATHS = ("/health",)  # answered without the API key: liveness probes carry no secrets


@dataclasses.dataclass
class State:
    """Everything a handler needs, built once at start."""
    tok: object
    engine: Engine
    metrics: Metrics
    model_id: str
    names: frozenset          # model names a request may give (the id, -m as given, ...)
    ctx: int
    vocab: int
    defaults: dict            # generation_config.json's sampling defaults
    api_key: str | None
    backend: str
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def check_model(self, body: dict) -> None:
        name = body.get("model")
        if name not in (None, "") and name not in self.names:
            raise APIError(400, f"model: {name!r} is not served here; this server serves "
                           f"{self.model_id!r} (GET /v1/models lists it)", param="model",
                           code="model_not_found")


# ---- helpers for endpoints ----------------------------------------------------------------------
async def read_json(request) -> dict:
    """The body as a JSON object, refused past MAX_BODY bytes before it is all read."""
    size = request.headers.get("content-length", "")
    too_big = APIError(413, f"the request body is over {MAX_BODY >> 20} MiB; send less context",
                       code="body_too_large")
    if size.isdigit() and int(size) > MAX_BODY:
        raise too_big
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > MAX_BODY:
            raise too_big
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})", code="invalid_json")
    if not isinstance(body, dict):
        raise APIError(400, f"the request body is a JSON {type(body).__name__}; send an object")
    return body


def submit(state: State, req: Request) -> Job:
    """Queue a job, or answer 503 now: a client that would wait past the bound retries later."""
    try:
        return state.engine.submit(req, asyncio.get_running_loop(), asyncio.Queue())
    except QueueFull:
        wait = state.engine.retry_after_s()
        raise APIError(503, f"the server is busy: one request runs and "
                       f"{len(state.engine.queue)} wait, as many as --queue "
                       f"{state.engine.queue.maxsize} allows; retry in about {wait} s",
                       code="queue_full", headers={"Retry-After": str(wait)})


async def _watch(request, job: Job) -> None:
    """Cancel the job when the client hangs up (the body was read: receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()


async def result(request, job: Job):
    """Wait for a non-streamed job's Result; a client that leaves cancels it."""
    watcher = asyncio.ensure_future(_watch(request, job))
    try:
        while True:
            kind, value = await job.events.get()
            if kind == "done":
                return value
            if kind == "error":
                raise APIError(500, f"generation failed: {value}", code="engine_error")
    finally:
        watcher.cancel()
        job.cancel()


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def stream(job: Job, head, on_text, on_done, tail=b"") -> StreamingResponse:
    """Server-sent events: `head` objects, one `on_text(piece)` per piece, `on_done(result)`'s
    objects, then `tail` (OpenAI's `data: [DONE]`).  A client that leaves cancels the job at
    once if it is queued, at the next token if it runs (Starlette cancels this generator)."""
    async def events():
        try:
            for obj in head:
                yield sse(obj)
            while True:
                kind, value = await job.events.get()
                if kind == "text":
                    yield sse(on_text(value))
                elif kind == "done":
                    for obj in on_done(value):
                        yield sse(obj)
                    break
                else:
                    yield sse(APIError(500, f"generation failed: {value}").body())
                    return
            if tail:
                yield tail
        finally:
            job.cancel()
    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
