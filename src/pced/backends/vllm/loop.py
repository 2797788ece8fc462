"""One thread owns the vLLM engine and steps it; any thread submits requests and reads their outputs.

This is what lets many questions decode at once (continuous batching): each question's requests
are added to the running engine between two steps, and every step advances all of them. The
engine is built *inside* the thread, so the calls that bind the CPU build's OpenMP threads and every
later ``step()`` happen on the same thread.

``submit(prompts, params, sink)`` queues the requests; after each step ``sink(output)`` is called
(on the engine thread: keep it short) with every ``RequestOutput`` of those requests. If the engine
fails, every live sink gets ``sink(exception)`` and the loop refuses further work.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Sequence

from ...errors import PcedError
from .channel import carriers

log = logging.getLogger("pced.vllm")
Sink = Callable[[object], None]  # a vllm RequestOutput, or the exception that stopped the engine


class EngineError(PcedError, RuntimeError):
    """The vLLM engine stopped (it failed to start or failed in a step)."""


class EngineLoop:
    def __init__(self, build: Callable[[], object], name: str = "pced-vllm"):
        """``build()`` returns a ``vllm.LLM``; it runs on the loop's thread. Raises what it raised."""
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._failed: BaseException | None = None
        self._ready = threading.Event()
        self.llm = None
        self._thread = threading.Thread(target=self._run, args=(build,), name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failed is not None:
            raise self._failed

    def submit(self, request_ids: Sequence[str], prompts: Sequence[list[int]], params: Sequence, sink: Sink) -> None:
        if self._failed is not None:
            raise EngineError(f"the vLLM engine has stopped: {self._failed}")
        self._commands.put(("add", list(zip(request_ids, prompts, params)), sink))

    def abort(self, request_ids: Sequence[str]) -> None:
        self._commands.put(("abort", list(request_ids), None))

    def close(self, timeout: float = 60.0) -> None:
        """End the thread after the step in progress; live requests get an ``EngineError``, and the
        engine is released with the thread."""
        self._commands.put(("close", None, None))
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self, build) -> None:
        try:
            self.llm = build()
        except BaseException as exc:  # reported by __init__ on the caller's thread
            self._failed = exc
            self._ready.set()
            return
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
                        live = [r for r in payload if self._sinks.pop(r, None) is not None]
                        if live:
                            engine.abort_request(live)
                    else:
                        self._add(engine, payload, sink)
                if engine.has_unfinished_requests():
                    for output in engine.step():
                        sink = self._sinks.get(output.request_id)
                        if sink is not None:
                            if output.finished:
                                del self._sinks[output.request_id]
                            sink(output)
        except BaseException as exc:
            log.exception("the vLLM engine failed")
            self._stop(EngineError(f"the vLLM engine failed: {exc}"))

    def _stop(self, error: EngineError) -> None:
        self._failed = error
        for sink in set(self._sinks.values()):
            sink(error)
        self._sinks.clear()
        shutdown = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if shutdown is not None and hasattr(shutdown, "shutdown"):
            shutdown.shutdown()
        self.llm = None

    def _add(self, engine, requests, sink: Sink) -> None:
        from vllm.inputs import TokensPrompt

        added = []
        try:
            for request_id, prompt, params in requests:
                engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
                self._sinks[request_id] = sink
                added.append(request_id)
        except Exception as exc:  # a request the engine refuses (too long, bad params): only its sender hears
            for request_id in added:
                self._sinks.pop(request_id, None)
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
