"""One thread owns the vLLM engine and steps it; any thread submits requests and reads their outputs.

This is what lets many questions decode at once (continuous batching): each question's requests
are added to the running engine between two steps, and every step advances all of them. The
engine is built *inside* the thread, so the calls that bind the CPU build's OpenMP threads and every
later ``step()`` happen on the same thread.

``submit(prompts, params, sink)`` queues the requests; after each step ``sink(output)`` is called
(on the engine thread: keep it short) with every ``RequestOutput`` of those requests. If the engine
fails, every live sink gets ``sink(exception)`` and the loop refuses further work.

An engine that dies (one of vLLM's processes killed or crashed) is found as soon as vLLM marks
it dead: every live request and every later ``submit`` get an ``EngineDeadError`` at once, and
``death`` says why. Nothing restarts it here: a process whose worker died may hold device and
shared memory the dead worker left behind, so only a fresh process is clean (the server exits
for its supervisor to restart it, ``pced.server.lifecycle``).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
from typing import Callable, Sequence

from ...errors import EngineDeadError, PcedError
from .channel import carriers

log = logging.getLogger("pced.vllm")
Sink = Callable[[object], None]  # a vllm RequestOutput, or the exception that stopped the engine
WATCH_S = 0.05  # how often the watcher reads vLLM's engine_dead flag


class EngineError(PcedError, RuntimeError):
    """The vLLM engine stopped (it failed to start, or it was closed)."""


def engine_client(llm) -> object | None:
    """vLLM's engine-core client of an ``LLM`` (``SyncMPClient`` when the engine runs in processes of its own)."""
    return getattr(getattr(llm, "llm_engine", None), "engine_core", None)


def marked_dead(client) -> bool:
    """Whether vLLM has marked its engine dead: its monitor of the engine-core processes
    (v1/engine/core_client.py:800-827), an engine core's ENGINE_CORE_DEAD message after its
    executor lost a worker (:570-573; v1/engine/core.py:1771-1774), or the client's shutdown (:512)."""
    return bool(getattr(getattr(client, "resources", None), "engine_dead", False))


class EngineLoop:
    def __init__(self, build: Callable[[], object], name: str = "pced-vllm",
                 explain: Callable[[], str | None] = lambda: None):
        """``build()`` returns a ``vllm.LLM``; it runs on the loop's thread. Raises what it raised.
        ``explain()``: once the engine has died, which of its processes died and how, in one line."""
        self._explain = explain
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._lock = threading.Lock()  # the sinks and the failure: the engine thread and the watcher both end them
        self._failed: BaseException | None = None
        self._closing = False
        self._stopped = threading.Event()
        self._ready = threading.Event()
        self.llm = None
        self._client = None
        self._thread = threading.Thread(target=self._run, args=(build,), name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failed is not None:
            raise self._failed
        # before vLLM's own clean-up at exit (weakref.finalize's, registered earlier, runs later): the
        # engine is closed, not found dead
        atexit.register(self.close)
        threading.Thread(target=self._watch, name=f"{name}-watch", daemon=True).start()

    @property
    def death(self) -> EngineDeadError | None:
        """Why the engine died (None while it runs, and after ``close``)."""
        failed = self._failed
        return failed if isinstance(failed, EngineDeadError) else None

    def submit(self, request_ids: Sequence[str], prompts: Sequence[list[int]], params: Sequence, sink: Sink) -> None:
        with self._lock:  # nothing is queued once the loop has failed: nobody would read it
            if self._failed is not None:
                raise self._refusal()
            self._commands.put(("add", list(zip(request_ids, prompts, params)), sink))

    def abort(self, request_ids: Sequence[str]) -> None:
        self._commands.put(("abort", list(request_ids), None))

    def close(self, timeout: float = 60.0) -> None:
        """End the thread after the step in progress; live requests get an ``EngineError``, and the
        engine is released with the thread."""
        self._closing = True  # the client's own shutdown marks it dead too (core_client.py:512): not a death
        self._commands.put(("close", None, None))
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _refusal(self) -> PcedError:
        death = self.death
        if death is not None:
            return EngineDeadError(str(death))
        return EngineError(f"the vLLM engine has stopped: {self._failed}")

    def _run(self, build) -> None:
        try:
            self.llm = build()
        except BaseException as exc:  # reported by __init__ on the caller's thread
            self._failed = exc
            self._ready.set()
            return
        self._client = engine_client(self.llm)
        self._ready.set()
        engine = self.llm.llm_engine
        try:
            while True:
                # wait for work only when the engine has none; otherwise take what has queued up
                block = not engine.has_unfinished_requests()
                while True:
                    try:
                        kind, payload, sink = self._commands.get(block=block)
                    except queue.Empty:
                        break
                    block = False
                    if kind == "close":
                        self._stop(EngineError("the vLLM engine was closed"))
                        return
                    if kind == "abort":
                        with self._lock:
                            live = [r for r in payload if self._sinks.pop(r, None) is not None]
                        if live:
                            engine.abort_request(live)
                    else:
                        self._add(engine, payload, sink)
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    with self._lock:
                        sinks = [self._sinks.pop(o.request_id, None) if o.finished else self._sinks.get(o.request_id)
                                 for o in outputs]
                    for sink, output in zip(sinks, outputs):
                        if sink is not None:
                            sink(output)
        except BaseException as exc:
            if self._closing:  # a step cut short by the engine's own close: not a death
                self._stop(EngineError("the vLLM engine was closed"))
                return
            # the loop takes no more work after this: to the server the engine is dead either way
            dead = marked_dead(self._client)
            log.error("the vLLM engine died: %s", exc, exc_info=not dead)
            self._stop(EngineDeadError(f"the vLLM engine died: {(self._explain() if dead else None) or exc}"))

    def _watch(self) -> None:
        """When vLLM's monitor finds an engine-core process gone it shuts its client down, which
        ends the thread that reads the engine's outputs without a word to ``get_output``
        (core_client.py:811-817, :957-962, :989-999): a step in flight would wait for ever. Read the
        flag vLLM sets; on death fail every request at once and wake the engine thread."""
        while not self._stopped.wait(WATCH_S):
            if self._closing or not marked_dead(self._client):
                continue
            why = self._explain() or "one of its processes exited (vLLM's log above says which)"
            error = EngineDeadError(f"the vLLM engine died: {why}")
            if self._fail(error):
                log.error("%s", error)
            outputs = getattr(self._client, "outputs_queue", None)
            if outputs is not None:
                outputs.put_nowait(error)  # get_output raises it (core_client.py:993-996): the step ends
            self._commands.put(("close", None, None))  # an idle thread wakes and releases the engine
            return

    def _fail(self, error: BaseException) -> bool:
        """Record the loop's failure (the first one stands) and hand it to every live request;
        whether this was the first."""
        with self._lock:
            first = self._failed is None
            if first:
                self._failed = error
            sinks = set(self._sinks.values())
            self._sinks.clear()
            error = self._failed
        for sink in sinks:
            sink(error)
        return first

    def _stop(self, error: BaseException) -> None:
        self._fail(error)
        self._stopped.set()
        if self._client is not None and hasattr(self._client, "shutdown"):
            self._client.shutdown()
        self.llm = None
        while True:  # requests queued before the failure that the thread will never read
            try:
                kind, _, sink = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                sink(self._failed)

    def _add(self, engine, requests, sink: Sink) -> None:
        from vllm.inputs import TokensPrompt

        added = []
        try:
            # rendered as vLLM's input processor would render raw prompts, which it warns is deprecated
            # (v1/engine/input_processor.py:407-428; the renderer: v1/engine/llm_engine.py:98)
            inputs = engine.renderer.render_cmpl([TokensPrompt(prompt_token_ids=p) for _, p, _ in requests])
            for (request_id, _, params), prompt in zip(requests, inputs):
                engine.add_request(request_id, prompt, params)
                with self._lock:
                    if self._failed is not None:  # the watcher failed the loop meanwhile
                        raise self._refusal()
                    self._sinks[request_id] = sink
                added.append(request_id)
        except Exception as exc:  # a request the engine refuses (too long, bad params): only its sender hears
            with self._lock:
                for request_id in added:
                    self._sinks.pop(request_id, None)
            if marked_dead(self._client) or self._failed is not None:
                self._fail(EngineDeadError(f"the vLLM engine died: {exc}"))
                sink(self._refusal())
                return
            if added:
                engine.abort_request(added)
            sink(exc)


class Collector:
    """A sink that keeps each request's token ids (and their carriers) and wakes a waiting thread on every change."""

    def __init__(self, request_ids: Sequence[str],
                 on_tokens: Callable[[str, list[int]], BaseException | None] | None = None):
        self.ids = list(request_ids)
        self.tokens: dict[str, list[int]] = {r: [] for r in self.ids}
        self.carriers: dict[str, list[float]] = {r: [] for r in self.ids}  # per token, where asked (channel.py)
        self.cached: dict[str, int] = {}
        self.transfer: dict[str, dict] = {}  # a finished request's kv_transfer_params (its KV connector's report)
        self.finished: set[str] = set()
        self.error: BaseException | None = None
        self._changed = threading.Condition()
        # called on the engine thread with a request's id and all its tokens so far, whenever they
        # grow; an exception it returns stops the waiting thread (it is raised there)
        self.on_tokens = on_tokens

    def __call__(self, output) -> None:
        with self._changed:
            if isinstance(output, BaseException):
                self.error = output
            else:
                new = list(output.outputs[0].token_ids) if output.outputs else []
                self.tokens[output.request_id].extend(new)
                if new:
                    self.carriers[output.request_id].extend(carriers(output.outputs[0]))
                if output.num_cached_tokens is not None:
                    self.cached[output.request_id] = output.num_cached_tokens
                if output.finished:
                    self.finished.add(output.request_id)
                    if getattr(output, "kv_transfer_params", None):
                        self.transfer[output.request_id] = output.kv_transfer_params
                if self.on_tokens is not None and new:
                    self.error = self.on_tokens(output.request_id, self.tokens[output.request_id]) or self.error
            self._changed.notify_all()

    @property
    def done(self) -> bool:
        return self.error is not None or len(self.finished) == len(self.ids)

    def wait(self, ready: Callable[[], bool]) -> None:
        """Block until ``ready()`` or every request has finished; raise the engine's error if any."""
        with self._changed:
            self._changed.wait_for(lambda: ready() or self.done)
            if self.error is not None:
                raise self.error
