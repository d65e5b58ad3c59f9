"""`GET /metrics`: counters and histograms in the Prometheus text format (version 0.0.4).

Written by hand rather than with prometheus_client: a dozen series do not need a dependency.
Updated from two threads (the event loop counts requests, the engine thread counts tokens),
so every update takes the lock.  TTFT runs from the moment a request joins the queue to its
first token, queue wait included: what a client feels.  ITL is every gap between two tokens.
"""
from __future__ import annotations

import threading

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.002, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1.0)


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, v: float) -> None:
        i = next((i for i, b in enumerate(self.buckets) if v <= b), len(self.buckets))
        self.counts[i] += 1
        self.sum += v

    def lines(self, name: str) -> list[str]:
        out, cum = [], 0
        for b, c in zip(self.buckets + (float("inf"),), self.counts):
            cum += c
            le = "+Inf" if b == float("inf") else repr(b)
            out.append(f'{name}_bucket{{le="{le}"}} {cum}')
        return out + [f"{name}_sum {self.sum!r}", f"{name}_count {cum}"]


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = self.cached_tokens = self.generated_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)

    def request(self, path: str, status: int) -> None:
        with self.lock:
            self.requests[path, status] = self.requests.get((path, status), 0) + 1

    def job_done(self, res, itl_ms) -> None:
        with self.lock:
            self.prompt_tokens += res.prompt_tokens
            self.cached_tokens += res.cached_tokens
            self.generated_tokens += len(res.ids)
            if res.ids:
                self.ttft.observe(res.ttft_s)
            for ms in itl_ms:
                self.itl.observe(ms / 1e3)

    def render(self, queue_depth: int, busy: bool, saved_tokens: int) -> str:
        def head(name, kind, text):
            return [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]

        with self.lock:
            lines = head("nq_requests_total", "counter", "HTTP requests by path and status.")
            for (path, status), n in sorted(self.requests.items()):
                lines.append(f'nq_requests_total{{path="{path}",status="{status}"}} {n}')
            for name, value, text in (
                    ("nq_prompt_tokens_total", self.prompt_tokens, "Prompt tokens received."),
                    ("nq_prompt_tokens_cached_total", self.cached_tokens,
                     "Prompt tokens served from the prompt cache (not prefilled)."),
                    ("nq_generated_tokens_total", self.generated_tokens, "Tokens generated.")):
                lines += head(name, "counter", text) + [f"{name} {value}"]
            for name, value, text in (
                    ("nq_queue_depth", queue_depth, "Requests waiting for the engine."),
                    ("nq_requests_running", int(busy), "Requests the engine is running (0 or 1)."),
                    ("nq_cache_saved_tokens", saved_tokens,
                     "Tokens held in saved prompt-cache slots (--cache-slots > 1).")):
                lines += head(name, "gauge", text) + [f"{name} {value}"]
            lines += head("nq_ttft_seconds", "histogram",
                          "Queued to first token, queue wait included.")
            lines += self.ttft.lines("nq_ttft_seconds")
            lines += head("nq_itl_seconds", "histogram", "Time between generated tokens.")
            lines += self.itl.lines("nq_itl_seconds")
        return "\n".join(lines) + "\n"
