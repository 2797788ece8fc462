"""How ``pced serve`` stops: it drains on SIGTERM, and exits non-zero when its engine dies.

SIGTERM or Ctrl+C: new requests get 503 ``draining`` and /health 503 ``not ready``; the requests
already accepted (running or queued) finish, for up to ``Limits.drain_timeout_s``, and those
still unfinished then end with a 503 error; the backends' engines are shut down and the process
exits 0. A second signal ends the drain at once.

A dead engine (``Backend.failure``: vLLM marked it dead) is not restarted in this process: a worker
that died may have left device memory and shared memory behind, and only a fresh process is clean.
Its requests have already ended with 503 ``engine_dead``; every new one gets that 503 at once and
/health 503 ``not ready`` naming the cause; the other requests accepted drain as above; then the
process exits ``ENGINE_DEAD_EXIT`` for its supervisor (systemd, Kubernetes) to start a new one.
vLLM's own OpenAI server stops the same way on an engine's death (its ``EngineDeadError`` handler
and watchdog: vllm/entrypoints/serve/exception_handling/handlers/vllm_error.py:28-64,
vllm/entrypoints/launchers/launcher.py:312-332).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from typing import NoReturn

import uvicorn

from .worker import Worker, draining, engine_dead, shutting_down

ENGINE_DEAD_EXIT = 75  # EX_TEMPFAIL (sysexits.h): a fresh process will do; distinct from pced's 1 and 2, uvicorn's 3
# after an engine died, the least time the server still answers (503, saying why) before it stops,
# so that the clients and probes of that moment read the cause rather than a refused connection
DEAD_NOTICE_S = 5.0
GRACEFUL_S = 5  # uvicorn's wait for open connections once the drain is over (they have finished by then)
log = logging.getLogger("pced.server")


class Server(uvicorn.Server):
    """uvicorn's server with pced's stop: ``on_tick`` (every 0.1 s) watches for a signal or a dead
    engine and ends the main loop once the drain is over; ``exit_code`` is the process's."""

    def __init__(self, config: uvicorn.Config, worker: Worker, drain_timeout_s: float):
        super().__init__(config)
        self.worker, self.drain_timeout_s = worker, drain_timeout_s
        self.exit_code = 0
        self.signals = 0
        self.drain_until: float | None = None  # the drain's end at the latest (None: serving)
        self.notice_until = 0.0

    def handle_exit(self, sig, frame) -> None:
        # uvicorn's own handler stops listening at once and raises the signal again after its
        # shutdown (the process then dies by it); this one refuses new requests from now on, and
        # the next tick drains
        self.signals += 1
        if self.worker.stopping is None:
            self.worker.stopping = draining()

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        now = time.monotonic()
        if self.exit_code == 0 and (failure := self.worker.failure()) is not None:
            log.error("%s; stopping with exit code %d for the supervisor to start the server again", failure,
                      ENGINE_DEAD_EXIT)
            self.exit_code = ENGINE_DEAD_EXIT
            self.notice_until = now + DEAD_NOTICE_S
            self._drain(now, engine_dead(failure))
        elif self.signals and self.drain_until is None:
            log.warning("draining: %d request(s) accepted finish within %g s; new ones get 503", self.worker.pending,
                        self.drain_timeout_s)
            self._drain(now, draining())
        if self.drain_until is None:
            return False
        if self.worker.pending and now < self.drain_until and self.signals < 2:
            return False
        if self.worker.pending:
            self.worker.cut(shutting_down())  # they end at their next token, with an error event
        return now >= self.notice_until

    def _drain(self, now: float, refusal) -> None:
        self.worker.stopping = refusal
        until = now + self.drain_timeout_s
        self.drain_until = until if self.drain_until is None else min(self.drain_until, until)


def serve(app, host: str, port: int, log_level: str, drain_timeout_s: float) -> int:
    """Serve ``app`` (``create_app``) until a signal or a dead engine stops it; the exit code."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=GRACEFUL_S)
    server = Server(config, app.state.worker, drain_timeout_s)
    server.run()  # a port already taken: uvicorn logs it and exits 1
    return server.exit_code


def exit_now(code: int) -> NoReturn:
    """End the process once the server has stopped (its requests ended, its engines shut down):
    Python's exit handlers run (logging, multiprocessing's and vLLM's clean-ups), the interpreter's
    teardown does not. That teardown collects every object the model, the retrievers and the engine
    made, and runs torch's C++ destructors: 2.5-9 s on two cores, freeing nothing the exit does not
    (and freezing the objects instead makes triton report them as leaked)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more to say
            pass
    os._exit(code)
