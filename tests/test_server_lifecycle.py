"""How ``pced serve`` stops: SIGTERM drains (new requests 503, /health 503, the answer in flight
finishes, exit 0), on the transformers backend with the tiny model. The drain is the server's
own code (``server.lifecycle``, ``Worker.cut``), the same for every backend; a dead engine's stop
is tested with vLLM in tests/test_vllm_server.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("uvicorn")
import httpx  # noqa: E402

from helpers.server import QUESTION, free_port, live_server, tiny_store, wait_healthy  # noqa: E402

pytestmark = pytest.mark.slow  # a `pced serve` subprocess, uvicorn on a real port

STOP_BOUND_S = 30  # SIGTERM with nothing left to drain to the process's exit (uvicorn's 5 s wait, the lifespan)
LONG = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 1024, "stream": True,
        "pced": {"top_k": 3}}


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_llm):
    return tiny_store(tmp_path_factory, tiny_llm)


def data_lines(lines) -> list[dict | str]:
    """The SSE payloads until [DONE] (included), JSON decoded."""
    payloads = []
    for line in lines:
        if line.startswith("data:"):
            data = line[5:].strip()
            payloads.append(data if data == "[DONE]" else json.loads(data))
            if data == "[DONE]":
                return payloads
    return payloads


def test_sigterm_drains_the_answer_in_flight_refuses_new_ones_and_exits_0(store, tmp_path):
    port, log = free_port(), tmp_path / "serve.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "pced.cli", "serve", str(store.root), "--port", str(port),
                                    "--log-level", "warning", "--drain-timeout", "300"],
                                   stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PCED_API_KEY": ""})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, log, time.monotonic() + 180)
        with httpx.Client(base_url=url, timeout=120) as http:
            with http.stream("POST", "/v1/chat/completions", json={**LONG, "max_tokens": 256}) as running:
                lines = running.iter_lines()
                assert next(line for line in lines if '"doc_id"' in line)  # generating (for seconds)
                process.send_signal(signal.SIGTERM)
                health = http.get("/health")
                assert health.status_code == 503, health.text
                assert health.json()["status"] == "not ready" and health.json()["reason"] == "draining"
                assert health.json()["pending"] == 1
                refused = http.post("/v1/chat/completions", json={**LONG, "stream": False, "max_tokens": 2})
                assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining", refused.text
                rest = data_lines(lines)
            assert rest[-1] == "[DONE]" and not any("error" in chunk for chunk in rest[:-1])
            assert rest[-2]["choices"][0]["finish_reason"] in ("stop", "length")  # the whole answer, not cut
        assert process.wait(timeout=STOP_BOUND_S) == 0, log.read_text()[-2000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_cut_request_ends_with_an_error_event_and_new_ones_get_the_refusal(store):
    """What the drain does when its time is up (``Worker.cut``) and while it runs (``Worker.stopping``)."""
    from pced.server import create_app
    from pced.server.worker import draining, shutting_down

    app = create_app(store)
    worker = app.state.worker
    with live_server(app) as url, httpx.Client(base_url=url, timeout=120) as http:
        with http.stream("POST", "/v1/chat/completions", json=LONG) as running:
            lines = running.iter_lines()
            assert next(line for line in lines if '"doc_id"' in line)
            worker.stopping = draining()
            worker.cut(shutting_down())
            rest = data_lines(lines)
        assert rest[-1] == "[DONE]" and rest[-2]["error"]["code"] == "shutting_down"
        refused = http.post("/v1/pced/answer", json={"question": QUESTION})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["reason"] == "draining"
