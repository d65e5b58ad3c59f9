"""The engine thread: one sequence at a time, fed from a bounded FIFO queue.

The backend (NumPy reference or GPU engine) is built and driven by one thread only -- CUDA
state is per thread, and batch 1 means one generation at a time anyway.  HTTP handlers run on
the asyncio event loop and never wait on it: `submit` puts a Job in the queue or raises
QueueFull at once (the handler answers 503 with Retry-After), and the engine posts a Job's
events (text pieces, then its result or an error) to the loop with `call_soon_threadsafe`.

A handler that loses its client calls `job.cancel()`: a queued job leaves the queue, a
running one stops at its next token (the loop's on_token hook), so the next request starts
without waiting for the abandoned one to finish.
"""
from __future__ import annotations

import collections
import dataclasses
import sys
import threading
import time

from nq.generate import StopStrings, generate
from nq.serve.prompt_cache import PromptCache


class QueueFull(Exception):
    pass


@dataclasses.dataclass
class Request:
    """What to generate; built by the endpoint from its request body."""
    prompt_ids: list[int]
    max_tokens: int             # >= 0 (0: prefill only, to warm the cache)
    params: object              # nq.sample.SamplingParams
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_ids: tuple[int, ...] = ()
    presence: float = 0.0       # as in params (which applies them): for the response's echo
    frequency: float = 0.0
    t_max_predict_ms: float = 0.0  # llama.cpp: stop after this long, once a newline was written
    text_filter: object = None     # a stage after the stop strings (infill's IndentStop):
    #                                feed(text) -> (text, stop), flush() -> text


@dataclasses.dataclass
class Result:
    ids: list[int]
    text: str
    finish: str                 # "stop" or "length" (OpenAI's finish_reason)
    stop_type: str              # llama.cpp's: "eos", "word", "limit", "none"
    stopping_word: str
    prompt_tokens: int
    cached_tokens: int
    tokens_cached: int          # the KV cache's length afterwards
    ttft_s: float               # submit -> first token, queue wait included
    prefill_s: float            # start -> first token
    decode_s: float


class Job:
    def __init__(self, req: Request, loop, events):
        self.req, self.loop, self.events = req, loop, events
        self.cancelled = threading.Event()
        self.t_submit = time.perf_counter()
        self.engine = None

    def post(self, kind: str, value=None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop has closed: nobody is listening
            pass

    def cancel(self) -> None:
        self.cancelled.set()
        if self.engine is not None:
            self.engine.queue.remove(self)


class JobQueue:
    """FIFO of at most `maxsize` jobs waiting behind the running one; `put` never blocks.
    The running job is tracked under the same lock, so admission is exact."""

    def __init__(self, maxsize: int):
        self.maxsize, self.items, self.cond = maxsize, collections.deque(), threading.Condition()
        self.running: Job | None = None

    def put(self, job: Job) -> None:
        with self.cond:
            if len(self.items) + (self.running is not None) > self.maxsize:
                raise QueueFull
            self.items.append(job)
            self.cond.notify()

    def get(self, timeout: float) -> Job | None:
        """The next job, which becomes the running one (None after `timeout` s without one)."""
        with self.cond:
            if not self.items:
                self.cond.wait(timeout)
            self.running = self.items.popleft() if self.items else None
            return self.running

    def finish(self) -> None:
        with self.cond:
            self.running = None

    def remove(self, job: Job) -> None:
        with self.cond:
            if job in self.items:
                self.items.remove(job)

    def drain(self) -> list[Job]:
        with self.cond:
            out, self.items = list(self.items), collections.deque()
            return out

    def __len__(self) -> int:
        return len(self.items)


class Engine:
    """Owns the backend, its prompt cache and the queue; `start()` builds the backend on the
    engine thread and returns once it is loaded (or raises what loading raised)."""

    def __init__(self, make_backend, tok, queue: int, slots: int, metrics=None):
        self.make_backend, self.tok, self.metrics = make_backend, tok, metrics
        self.queue = JobQueue(queue)
        self.slots_wanted = slots
        self.cache: PromptCache | None = None
        self.stopping = False        # set from a signal handler: a plain attribute, no locks
        self.job_s = 1.0             # running mean of a job's time, for Retry-After
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="nq-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def submit(self, req: Request, loop, events) -> Job:
        job = Job(req, loop, events)
        if self.stopping:
            raise QueueFull
        self.queue.put(job)
        job.engine = self
        return job

    @property
    def busy(self) -> bool:
        return self.queue.running is not None

    def retry_after_s(self) -> int:
        return max(1, round(self.job_s * (len(self.queue) + 1)))

    def close(self, timeout: float = 5.0) -> None:
        self.stopping = True
        self._thread.join(timeout)

    # ---- the engine thread --------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.cache = PromptCache(self.make_backend(), self.slots_wanted)
        except BaseException as e:  # noqa: BLE001 -- handed to start() in the main thread
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        while not self.stopping:
            job = self.queue.get(timeout=0.2)
            if job is None:
                continue
            t0 = time.perf_counter()
            try:
                if not job.cancelled.is_set():
                    res = self._run(job)
                    if self.stopping and res.stop_type == "none":  # cut short by a shutdown
                        job.post("error", "the server is shutting down; the reply was cut")
                    else:
                        job.post("done", res)
            except Exception as e:  # noqa: BLE001 -- one request fails, the server goes on
                self.cache.forget()
                print(f"nq: request failed: {type(e).__name__}: {e}", file=sys.stderr)
                job.post("error", f"{type(e).__name__}: {e}")
            finally:
                self.queue.finish()
                self.job_s = 0.8 * self.job_s + 0.2 * (time.perf_counter() - t0)
        for job in self.queue.drain():
            job.post("error", "the server is shutting down")

    def _run(self, job: Job) -> Result:
        req, tok = job.req, self.tok
        ids = req.prompt_ids
        t_start = time.perf_counter()
        cached = self.cache.prepare(ids)
        backend = self.cache.backend
        if req.max_tokens == 0:  # llama.vim's cache warm-up: prefill, generate nothing
            if cached < len(ids):
                backend.prefill(ids[cached:])
            self.cache.hold(ids)
            return self._result(job, ids, [], "", "length", "limit", "", cached, t_start, None,
                                None)
        stream, stopper = tok.stream(), StopStrings(req.stop)
        shown: list[str] = []
        why = {"type": None, "t_first": None, "newline": False}

        def on_token(t: int) -> bool:
            now = time.perf_counter()
            if why["t_first"] is None:
                why["t_first"] = now
            if job.cancelled.is_set() or self.stopping:
                why["type"] = "none"
                return True
            piece = stream.step(t) or ""
            if t in req.stop_ids:
                return False
            text, stopped = stopper.feed(piece)
            if stopped:
                why["type"] = "word"
            if req.text_filter is not None:
                text, cut = req.text_filter.feed(text)
                if cut and not stopped:
                    why["type"], stopped = "limit", True
            if text:
                shown.append(text)
                job.post("text", text)
            why["newline"] = why["newline"] or "\n" in piece
            if (not stopped and req.t_max_predict_ms > 0 and why["newline"]
                    and (now - why["t_first"]) * 1e3 > req.t_max_predict_ms):
                why["type"], stopped = "limit", True
            return stopped

        out, stats = generate(backend, ids[cached:], req.max_tokens, req.params, req.stop_ids,
                              on_token, keep_context=True, history=ids[:cached])
        self.cache.hold(ids + out[:-1])  # the last generated id is not fed yet
        if why["type"] is None:  # an end id or the length: show what the stages held back
            rest = stopper.flush()
            if req.text_filter is not None:
                rest, cut = req.text_filter.feed(rest)
                rest += "" if cut else req.text_filter.flush()
            # the stream holds back an incomplete UTF-8 sequence; decoding the ids whole shows
            # it (as U+FFFD), as `nq generate --json` does
            done = "".join(shown) + rest
            whole = tok.decode([t for t in out if t not in req.stop_ids])
            if whole.startswith(done):
                rest += whole[len(done):]
            if rest:
                shown.append(rest)
                job.post("text", rest)
        stop_type = why["type"] or ("eos" if stats.stop_reason == "eos" else "limit")
        finish = "stop" if stop_type in ("eos", "word") else "length"
        word = ""
        if stop_type == "word":  # the stop string that occurs first is the one that cut
            raw = tok.decode(out)
            word = min(((raw.find(s), s) for s in req.stop if s in raw), default=(0, ""))[1]
        return self._result(job, ids, out, "".join(shown), finish, stop_type, word, cached,
                            t_start, why["t_first"], stats)

    def _result(self, job, ids, out, text, finish, stop_type, word, cached, t_start, t_first,
                stats):
        first = t_first or time.perf_counter()  # prefill only: its end
        res = Result(ids=out, text=text, finish=finish, stop_type=stop_type, stopping_word=word,
                     prompt_tokens=len(ids), cached_tokens=cached,
                     tokens_cached=self.cache.backend.length, ttft_s=first - job.t_submit,
                     prefill_s=first - t_start, decode_s=stats.decode_s if stats else 0.0)
        if self.cache.backend.length != len(self.cache.ids):  # never expected; never trusted
            self.cache.forget()
        if self.metrics is not None:
            self.metrics.job_done(res, stats.itl_ms if stats is not None else [])
        print(f"nq: {len(ids)} prompt tokens ({cached} cached), {len(out)} generated "
              f"({stop_type}); TTFT {res.ttft_s * 1e3:.1f} ms"
              + (f", {stats.decode_tok_s:.1f} tok/s" if stats and stats.decode_tok_s else ""),
              file=sys.stderr)
        return res
