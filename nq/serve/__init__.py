"""`nq serve`: an OpenAI- and llama.cpp-compatible HTTP server over one engine.

Editors and tools reach a coder model through OpenAI's API (Continue, aider, the SDKs) and
llama.cpp's /infill (llama.vim, llama.vscode); this package speaks both, in front of the same
generation loop `nq generate` uses.  One model, one sequence at a time (batch 1): requests
wait in a bounded FIFO queue, and a prompt cache keeps the KV state of recent conversations.

    params.py       request fields -> checked values; the error shape
    engine.py       the engine thread, its queue and jobs
    prompt_cache.py which prefix the KV cache holds; saved slots (--cache-slots)
    metrics.py      /metrics in the Prometheus text format
    app.py          the Starlette app, SSE, auth, `serve(args)` (uvicorn)
    openai_api.py   /v1/models, /v1/chat/completions, /v1/completions
    llama_api.py    /infill, /tokenize, /detokenize

Starlette and uvicorn are an optional extra: nothing outside this package imports them.
docs/SERVE.md is the user's guide.
"""


def main(args) -> int:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"nq serve needs starlette and uvicorn ({e.name} is missing): "
                           'pip install "nq[serve]"') from None
    from nq.serve.app import serve
    return serve(args)
