"""Generations off the event loop, streamed back to each request's asyncio queue.

A lane per backend: the default backend's, and the served backend's for what it runs
(``Backend.runs``). A lane decodes one question at a time (one thread: a model and its caches are
not shared between threads), except a backend whose engine batches questions itself
(``Capabilities.concurrent_questions``): its lane has ``Limits.max_concurrent`` threads that
all feed the engine, which batches their rows step by step (continuous batching). Retrieval and prompt building take one lock (the
retrievers and tokenizers are not made for concurrent calls); decoding does not.

Events, in order: ("start", Started) once the candidates and the Generation exist, then
("token", Step) per chosen token, then ("done", Finished); or ("error", exception) /
("cancelled", None) instead. A request that goes away sets ``Run.cancelled``: a queued job is
skipped, a running one stops at its next token, so the slot frees at once. A run the server
stops (``Worker.cut``: its drain ran out of time) ends the same way with an error event.

As the server stops (``server.lifecycle``) the worker refuses new requests with a 503 that says
why (``Worker.refusal``): ``draining`` after SIGTERM, ``engine_dead`` once the answering
backend's engine has died (``Backend.failure``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from ..text.answers import Answer
from ..decoding.loop import Deadline, TimeLimitError
from ..documents import Candidate
from ..errors import DataError, EngineDeadError, UserError
from ..pipeline import ask, ask_candidates
from ..backend import DEFAULT_BACKEND, get_backend
from ..options import GivenDocuments
from .metrics import ServerMetrics
from .schemas import Job, Limits, RequestError

log = logging.getLogger("pced.server")


@dataclass
class Started:
    candidates: list[Candidate]
    retrieval_s: float
    queue_s: float


@dataclass
class Finished:
    answer: Answer
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_tokens: int


@dataclass(eq=False)  # hashed by identity: the worker keeps a set of live runs
class Run:
    """The link between one request (on the event loop) and its job (on the worker thread)."""

    loop: asyncio.AbstractEventLoop
    lane: str = DEFAULT_BACKEND
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    tokens: int = 0  # generated so far (read by tests and /health)
    stopped_by: RequestError | None = None  # the server ended it (``Worker.cut``): its error event

    def emit(self, kind: str, payload: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is gone (server shutting down): nobody is listening
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()

    def stop(self, reason: RequestError) -> None:
        """End it at its next token (or before it starts) with ``reason`` as its error."""
        self.stopped_by = reason
        self.cancelled.set()


class Worker:
    """Owns the store and the generation lanes; counts what happened for /health.

    Documents sent with a request are encoded into the request cache (``requests``: its own
    directory under a byte budget, ``GivenDocuments``), never into the store. Before each request
    the worker checks whether ``pced index`` published a new generation of the store and, if so,
    opens it (same model and caches); requests already running finish on the generation they began with.
    """

    def __init__(self, store, limits: Limits = Limits(), backend: str = DEFAULT_BACKEND, settings=None,
                 request_cache_dir: str | None = GivenDocuments.cache_dir):
        self.store, self.limits = store, limits
        self.backend = get_backend(backend)  # answers what it runs (Backend.runs); the default backend the rest
        self.settings = self.backend.settings(settings)
        self.default = get_backend(DEFAULT_BACKEND)
        self.request_cache_dir = request_cache_dir
        self._requests: dict[tuple, object] = {}  # (backend name, settings) -> the request documents' Generator
        self.reloads = 0
        self.reload_error: str | None = None
        # a lane per backend: one question at a time owns a model's rows, except in an engine that batches
        # questions itself (Capabilities.concurrent_questions: Limits.max_concurrent threads feed it)
        self._lanes = {}
        for lane in dict.fromkeys([self.default, self.backend]):
            width = limits.max_concurrent if lane.capabilities.concurrent_questions else 1
            self._lanes[lane.name] = (ThreadPoolExecutor(max_workers=width, thread_name_prefix=f"pced-{lane.name}"), width)
        self._lock = threading.Lock()
        self._prepare = threading.Lock()  # retrieval and prompt building, one request at a time
        self.pending = 0  # queued or running
        self._runs: list[Run] = []  # queued or running, in submission order
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0, "timed_out": 0}
        self.last_tokens = 0  # tokens generated by the most recent job, finished or not
        self.stopping: RequestError | None = None  # set as the server stops: every new request gets it
        self.metrics = ServerMetrics(self)
        self._watching = threading.Event()  # set: the store watch ends

    def warm_up(self) -> dict:
        """Load the model, the KV prefix and the retrievers now rather than on the first request, after
        what the backend does before serving (``Backend.warm_up``: an engine starts first, before the
        retrieval libraries load)."""
        report = self.backend.warm_up(self.store, self.settings)
        self.generator.caches.prefix()
        self.store.retrieve("warm up", top_k=1, top_n=1, rerank=False)
        return report

    def requests_for(self, options):
        """The Generator for documents sent with a request on ``options.backend``: the store's model
        and template, and the request cache (``request_cache_dir``, the backend's folder in it, or the
        user cache), within ``Limits.request_cache_gb``; never the store."""
        backend, settings = get_backend(options.backend), options.backend_settings
        key = (backend.name, settings)
        if key not in self._requests:
            from ..generator import Generator
            from ..kv.budget import gb_to_bytes

            from ..text.prompts import TEMPLATES

            llm = self.store.model_for(backend, settings)  # the store's model, never its caches
            template, dtype = TEMPLATES[self.store.settings.template], self.store.settings.storage_dtype
            root = backend.request_cache_dir(self.request_cache_dir, llm, template, settings, dtype)
            self._requests[key] = Generator(llm, template, root, dtype, self.store.tiers,
                                            budget_bytes=gb_to_bytes(self.limits.request_cache_gb), backend=backend,
                                            settings=settings)
        return self._requests[key]

    def refresh(self) -> None:
        """Open the store's newest generation if ``pced index`` published one (under ``_prepare``).
        If it cannot be opened, keep serving the one we have and say so in /health."""
        try:
            if not self.store.changed():
                return
            fresh = self.store.reopen()
            fresh.retrieve("warm up", top_k=1, top_n=1, rerank=False)  # load its indexes now, not mid-question
        except Exception as exc:  # noqa: BLE001 - the old generation still answers; /health tells why
            self.reload_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.error("serving store generation %s: could not open the new one: %s", self.store.generation,
                      self.reload_error)
            return
        self.store, self.reload_error = fresh, None
        self.reloads += 1
        log.info("serving store generation %s (%d documents)", fresh.generation, len(fresh.documents))

    def watch_store(self, every_s: float) -> None:
        """Open a generation ``pced index`` publishes within ``every_s`` seconds, between requests as
        well as before them, so that /health and /metrics name the generation the next answer comes
        from without a request (a replica in a rollout is seen on the new generation as soon as it is)."""
        def watch() -> None:
            while not self._watching.wait(every_s):
                with self._prepare:
                    self.refresh()

        if every_s > 0:
            threading.Thread(target=watch, name="pced-store-watch", daemon=True).start()

    def store_health(self) -> dict:
        return {"generation": self.store.generation, "documents": len(self.store.documents), "reloads": self.reloads,
                "newer_generation_unread": self.reload_error}

    def request_cache_health(self) -> dict | None:
        """The request cache of the answering backend; another backend's (the default one's, once a
        baseline method has used it) under its name."""
        mine = (self.backend.name, self.settings)
        if not self._requests:
            return None
        health = self._requests[mine].caches.stats() if mine in self._requests else {}
        for (name, settings), generator in self._requests.items():
            if (name, settings) != mine and name != self.backend.name:
                health[name] = generator.caches.stats()
        return health

    @property
    def generator(self):
        """The generator the answering backend runs PCED with."""
        return self.store.generator_for(self.backend, self.settings)

    @property
    def llm(self):
        return self.generator.llm

    def pool_health(self) -> dict | None:
        """The device tier's budget, bytes held and hits (None without --gpu-cache-gb on a CPU model)."""
        pool = getattr(self.generator.caches, "pool", None)
        return None if pool is None else pool.stats()

    def backend_health(self) -> dict:
        width = {"max_concurrent": self._lanes[self.backend.name][1]} if self.backend.capabilities.concurrent_questions else {}
        return {"name": self.backend.name, **width, **self.backend.health(self.generator)}

    def failure(self) -> str | None:
        """Why the answering backend can answer no more in this process (its engine died), or None."""
        return self.backend.failure(self.generator)

    def refusal(self) -> RequestError | None:
        """The 503 every new request gets now (the engine died, or the server drains), or None."""
        failure = self.failure()
        return engine_dead(failure) if failure is not None else self.stopping

    def cut(self, reason: RequestError) -> None:
        """End every request accepted and not finished (queued or running) with ``reason``."""
        with self._lock:
            for run in self._runs:
                run.stop(reason)

    def submit(self, job: Job) -> Run:
        refusal = self.refusal()
        if refusal is not None:
            raise refusal
        options = job.options
        if self.backend is not self.default and self.backend.runs(options):  # the rest: the default backend's lane
            try:
                job = replace(job, options=replace(options, backend=self.backend.name, backend_settings=self.settings))
            except UserError as exc:  # what the backend refuses of a request it runs (greedy only: temperature)
                raise RequestError(str(exc), "temperature" if options.sampling.temperature > 0 else None,
                                   "unsupported_value") from None
        lane = job.options.backend
        with self._lock:
            if self.pending >= self.limits.max_queue:
                raise RequestError(f"the server is busy ({self.pending} requests queued); retry later", None,
                                   "overloaded", status=503, type_="server_error")
            self.pending += 1
            run = Run(asyncio.get_running_loop(), lane)
            self._runs.append(run)
        self._lanes[lane][0].submit(self._work, job, run, time.perf_counter())
        return run

    def ahead_of(self, run: Run) -> int:
        """Requests of the same lane submitted before ``run`` that keep it waiting (0: it runs now)."""
        with self._lock:
            if run not in self._runs:
                return 0
            before = [r for r in self._runs[: self._runs.index(run)] if r.lane == run.lane]
            return max(0, len(before) - self._lanes[run.lane][1] + 1)

    def close(self, wait_s: float = 5.0) -> None:
        """Stop the running generations at their next token, drop the queues, and once the runs have
        ended (up to ``wait_s``) shut the backends' engines down (server shutdown)."""
        self._watching.set()
        self.cut(shutting_down())
        deadline = time.monotonic() + wait_s
        while self.pending and time.monotonic() < deadline:  # a run ends at its next token
            time.sleep(0.05)
        for executor, _ in self._lanes.values():
            executor.shutdown(wait=False, cancel_futures=True)
        for backend in dict.fromkeys([self.backend, self.default]):
            backend.shutdown()

    def _count(self, outcome: str, run: Run, ran: bool = True) -> None:
        with self._lock:
            self.pending -= 1
            self._runs.remove(run)
            self.counts[outcome] += 1
            if ran:  # a skipped job generated nothing
                self.last_tokens = run.tokens

    def _check_lengths(self, candidates: list[Candidate]) -> None:
        """Request documents get the store's own limit (longer ones would have been chunked at indexing)."""
        llm = self.llm
        limit = self.store.settings.document_token_limit(llm.max_context)
        for c in candidates:
            n = len(llm.tokenizer.encode(c.document.render(), add_special_tokens=False))
            if n > limit:
                raise RequestError(f"document {c.document.id!r} has {n} tokens; this server takes at most {limit} "
                                   "per document (split it)", "documents", "document_too_long")

    def _work(self, job: Job, run: Run, submitted: float) -> None:
        queue_s = time.perf_counter() - submitted
        if run.cancelled.is_set():
            self._end(run, ran=False)
            return
        deadline = Deadline(self.limits.request_timeout_s)  # from the start of the job, not its queueing
        try:
            with self._prepare:
                deadline.check()
                self.refresh()
                if job.candidates is None:
                    asked = ask(self.store, job.question, job.options)
                else:
                    self._check_lengths(job.candidates)
                    asked = ask_candidates(self.requests_for(job.options), job.candidates, job.question, job.options)
            generation = asked.generation
            generation.deadline = deadline
            steps = iter(generation)
            first = next(steps, None)  # the prefill: its errors still reach the client as a status code
            run.emit("start", Started(asked.candidates, asked.retrieval_s, queue_s))
            for step in itertools.chain([first] if first is not None else [], steps):
                if run.cancelled.is_set():
                    break
                run.tokens += 1
                run.emit("token", step)
            else:
                answer = generation.answer()
                answer.timings["queue_s"] = queue_s
                finished = generation.tracker.finished
                length = len(answer.trace) >= job.options.sampling.max_new_tokens and not finished
                with self._prepare:
                    prompt_tokens = len(self.llm.tokenizer.encode(job.question, add_special_tokens=False))
                prompt_tokens += int(answer.stats.get("context_tokens", 0))
                self._count("completed", run)
                self.metrics.observe(answer, run.lane, job.options.method, from_store=job.candidates is None)
                run.emit("done", Finished(answer, "length" if length else "stop", prompt_tokens))
                return
            close = getattr(steps, "close", None)
            if close is not None:
                close()  # runs the generation's cleanup now, not at garbage collection
            self._end(run)
        except TimeLimitError as exc:
            log.warning("request stopped at the time limit (%g s) after %d tokens", deadline.seconds, run.tokens)
            self._count("timed_out", run)
            run.emit("error", exc)
        except Exception as exc:  # reported to the client as an error body; the worker lives on
            if is_data_error(exc) or isinstance(exc, EngineDeadError):
                log.error("generation failed: %s", exc)
            elif not is_client_error(exc):
                log.exception("generation failed")
            self._count("failed", run)
            run.emit("error", exc)

    def _end(self, run: Run, ran: bool = True) -> None:
        """A run that stopped before its answer: the client left, or the server stopped it."""
        if run.stopped_by is None:
            self._count("cancelled", run, ran)
            run.emit("cancelled", None)
        else:
            self._count("failed", run, ran)
            run.emit("error", run.stopped_by)


def draining() -> RequestError:
    return RequestError("the server is shutting down and takes no new requests; retry on another replica or once it "
                        "is back", None, "draining", status=503, type_="server_error")


def shutting_down() -> RequestError:
    return RequestError("the server shut down before this answer finished (its drain time ran out); retry", None,
                        "shutting_down", status=503, type_="server_error")


def engine_dead(why: str) -> RequestError:
    why = why.rstrip(". ")
    return RequestError(f"{why}; this server answers no more and stops for its supervisor to start it again", None,
                        "engine_dead", status=503, type_="server_error")


def is_client_error(exc: BaseException) -> bool:
    """Errors the request caused (bad settings, a prompt too long for the model): 4xx, not 500."""
    return isinstance(exc, UserError)


def is_data_error(exc: BaseException) -> bool:
    """The server's own stored data is damaged (a cache file): a 500 that says so, without a traceback."""
    return isinstance(exc, DataError)


async def next_event(run: Run, is_disconnected=None, poll_s: float = 0.25) -> tuple[str, object]:
    """The run's next event; while waiting, cancel the run if the client has gone away."""
    while True:
        try:
            return await asyncio.wait_for(run.events.get(), poll_s if is_disconnected else None)
        except asyncio.TimeoutError:
            if await is_disconnected():
                run.cancel()
                return "cancelled", None
