"""The HTTP side: the Starlette app, its guard (API key, request counts), and `serve(args)`,
which loads the model and runs uvicorn.  What every endpoint uses is in http.py.

Routes: OpenAI's /v1/models, /v1/chat/completions, /v1/completions (nq/serve/openai_api.py)
and llama.cpp's /infill, /tokenize, /detokenize (nq/serve/llama_api.py), plus /health and
/metrics.  The OpenAI routes also answer without the /v1 prefix, as llama.cpp's do.
"""
from __future__ import annotations

import hmac
import os
import socket
import sys

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from nq.serve.engine import Engine
from nq.serve.metrics import Metrics
from nq.serve.params import APIError
from nq.serve.http import OPEN_PATHS, State

# ---- the app ------------------------------------------------------------------------------------
class Guard:
    """ASGI middleware: the API key (401 without it), and a request count by path and status.
    The key is compared in constant time and never logged."""

    def __init__(self, app, state: State, paths):
        self.app, self.state, self.paths = app, state, frozenset(paths)
        self.key = f"Bearer {state.api_key}".encode() if state.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def counted(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)
        path = scope["path"]
        given = dict(scope["headers"]).get(b"authorization", b"")
        if self.key and path not in OPEN_PATHS and not hmac.compare_digest(given, self.key):
            err = APIError(401, "missing or wrong API key: send the header `Authorization: "
                           "Bearer KEY` with the key `nq serve --api-key` was given",
                           code="invalid_api_key")
            await JSONResponse(err.body(), 401)(scope, receive, counted)
        else:
            await self.app(scope, receive, counted)
        # unknown paths share one label, so a scanner cannot grow the metrics without bound
        self.state.metrics.request(path if path in self.paths else "other", status[0])


def build_app(state: State) -> Starlette:
    from nq.serve import llama_api, openai_api

    async def health(request):
        return JSONResponse({"status": "ok"})

    async def metrics(request):
        e = state.engine
        return PlainTextResponse(state.metrics.render(len(e.queue), e.busy, e.cache.saved_tokens),
                                 media_type="text/plain; version=0.0.4")

    async def api_error(request, exc: APIError):
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    async def http_error(request, exc: HTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code)
        msg = (f"no endpoint {request.method} {request.url.path}; see docs/SERVE.md"
               if exc.status_code in (404, 405) else str(exc.detail))
        return JSONResponse(APIError(exc.status_code, msg, kind=kind).body(), exc.status_code)

    routes = [Route("/health", health), Route("/metrics", metrics)]
    for prefix in ("/v1", ""):
        routes += [Route(prefix + "/models", openai_api.models),
                   Route(prefix + "/chat/completions", openai_api.chat_completions,
                         methods=["POST"]),
                   Route(prefix + "/completions", openai_api.completions, methods=["POST"])]
    routes += [Route("/infill", llama_api.infill, methods=["POST"]),
               Route("/tokenize", llama_api.tokenize, methods=["POST"]),
               Route("/detokenize", llama_api.detokenize, methods=["POST"])]
    app = Starlette(routes=routes, exception_handlers={APIError: api_error,
                                                       HTTPException: http_error})
    app.state.nq = state
    return Guard(app, state, [r.path for r in routes])


# ---- the process --------------------------------------------------------------------------------
def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port, "
                      "or stop the program using it") from None
    sock.listen(2048)  # from here a client waits in the backlog instead of being refused
    sock.set_inheritable(True)
    return sock


def model_names(model: str | None, path) -> tuple[str, frozenset]:
    """The id /v1/models reports (a repo id as given, else the file's stem) and every name a
    request may use for it."""
    from pathlib import Path

    from nq.loader.resolve import DEFAULT_REPO
    given = model or DEFAULT_REPO
    is_file = Path(given).expanduser().is_file()
    model_id = Path(path).stem if is_file else given.rstrip("/")
    return model_id, frozenset({model_id, given, Path(given).name, Path(path).name,
                                Path(path).stem})


def serve(args) -> int:
    import uvicorn

    from nq.backend import context_size, make_backend
    from nq.loader.format import NanoqwenFile
    from nq.loader.resolve import resolve_model
    from nq.text import Tokenizer

    if args.queue < 0 or args.cache_slots < 1 or not 0 <= args.port <= 65535:
        raise ValueError("--queue must be >= 0, --cache-slots >= 1, --port within 0..65535 "
                         "(0: any free port)")
    path = resolve_model(args.model, args.revision)
    nf = NanoqwenFile(path)
    tok = Tokenizer.from_nanoqwen(nf)
    ctx = context_size(args, nf.config)
    metrics = Metrics()
    engine = Engine(lambda: make_backend(args.backend, nf, ctx, valid_vocab=tok.vocab_size,
                                         sampler=True), tok, args.queue,
                    args.cache_slots, metrics)
    engine.start()
    if args.cache_slots > engine.cache.slots:
        print(f"nq: warning: --cache-slots {args.cache_slots} needs a backend with snapshot() "
              f"and restore(); the {args.backend} backend keeps one sequence", file=sys.stderr)
    model_id, names = model_names(args.model, path)
    if args.alias:
        model_id, names = args.alias, names | {args.alias}
    state = State(tok=tok, engine=engine, metrics=metrics, model_id=model_id, names=names,
                  ctx=ctx, vocab=nf.config.vocab_size, defaults=tok.generation_defaults,
                  api_key=args.api_key or os.environ.get("NQ_API_KEY") or None,
                  backend=args.backend)
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            engine.stopping = True  # the running generation ends at its next token
            super().handle_exit(sig, frame)
            # a requested stop is a clean exit, not a death by signal after the shutdown
            getattr(self, "_captured_signals", []).clear()

    server = Server(uvicorn.Config(build_app(state), log_level="warning", access_log=False,
                                   lifespan="off", timeout_graceful_shutdown=5))
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    print(f"nq: serving {model_id} at {url} (context {ctx}, {args.backend} backend, queue "
          f"{args.queue}, cache slots {engine.cache.slots}"
          + (f" pinning up to {engine.cache.pinned_bytes / 2**20:.0f} MiB of host memory"
             if engine.cache.pinned_bytes else "") + ", "
          f"{'API key required' if state.api_key else 'no API key'}); Ctrl-C stops",
          file=sys.stderr, flush=True)
    if not state.api_key and host not in ("127.0.0.1", "::1", "localhost"):
        print(f"nq: warning: listening on {host} without --api-key: anyone who can reach this "
              "port can use the model", file=sys.stderr)
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()
    print("nq: server stopped", file=sys.stderr)
    return 0
