"""pced serve over real HTTP: uvicorn on 127.0.0.1 (a free port), the official ``openai`` client
unchanged (streaming and not), and a client that leaves mid-stream freeing the model at once."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402

from pced.server import create_app  # noqa: E402
from helpers.server import QUESTION, live_server, tiny_store  # noqa: E402

pytestmark = pytest.mark.slow  # uvicorn on a real port, and a `pced serve` subprocess

KEY = "test-key-123"


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_llm):
    return tiny_store(tmp_path_factory, tiny_llm)


@pytest.fixture(scope="module")
def server(store):
    app = create_app(store, api_key=KEY)
    with live_server(app) as url:
        yield url, app


def test_openai_client_non_streaming_and_streaming(server, store):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == [store.llm.name]
    extra = {"pced": {"top_k": 3}}
    response = client.chat.completions.create(model=store.llm.name, messages=[{"role": "user", "content": QUESTION}],
                                              max_tokens=8, extra_body=extra)
    message = response.choices[0].message
    assert message.role == "assistant" and message.content and response.choices[0].finish_reason == "length"
    pced = message.model_extra["pced"]
    assert len(pced["experts"]) == 3 and len(pced["trace"]) == 8 and len(pced["beta"]) == 3
    assert "".join(t["token"] for t in pced["trace"]) == message.content
    assert response.usage.completion_tokens == 8

    stream = client.chat.completions.create(model=store.llm.name, messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=8, stream=True, extra_body=extra)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    assert chunks[0].model_extra["pced"]["experts"] == pced["experts"]
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].model_extra["pced"]["trace"] == pced["trace"]

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError, match="top_k"):
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": QUESTION}],
                                       extra_body={"pced": {"top_k": 0}})


def wait_for(predicate, seconds=20.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out waiting for the server")


def test_client_leaving_frees_the_slot(server):
    url, app = server
    worker = app.state.worker
    headers = {"Authorization": f"Bearer {KEY}"}
    before = dict(worker.counts)
    long_body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 1024, "stream": True}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=long_body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(line for line in lines if '"doc_id"' in line)  # the first token arrived
            # A second request waits behind the first; it gives up while queued.
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/pced/answer", json={"question": QUESTION, "max_tokens": 1024}, timeout=0.5)
            time.sleep(0.75)  # the server polls waiting clients every 0.25 s; the first run is still going (~9 s)
        # Leaving the stream closes the connection: the worker stops at its next token ...
        wait_for(lambda: worker.counts["cancelled"] == before["cancelled"] + 2 and worker.pending == 0)
        assert worker.counts["completed"] == before["completed"]
        assert 1 <= worker.last_tokens < 1024
        # ... so the next request runs at once.
        started = time.perf_counter()
        quick = http.post("/v1/pced/answer", json={"question": QUESTION, "max_tokens": 4})
        assert quick.status_code == 200 and len(quick.json()["trace"]) == 4
        assert time.perf_counter() - started < 10
        health = http.get("/health").json()
        assert health["completed"] == before["completed"] + 1 and health["pending"] == 0


def test_body_limits_over_real_http(server):
    url, _ = server
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
        chunked = http.post("/v1/pced/answer", content=iter([b'{"question": "', b"x" * 1_100_000, b'"}']))
        assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
        sized = http.post("/v1/pced/answer", content=b'{"question": "' + b"x" * 1_100_000 + b'"}')
        assert sized.status_code == 413
        malformed = http.post("/v1/chat/completions", content=b'{"messages": ')
        assert malformed.status_code == 400 and malformed.json()["error"]["code"] == "invalid_json"


def test_pced_serve_command(tmp_path, store, capsys):
    import os
    import subprocess
    import sys

    from pced.cli import main
    from helpers.server import free_port

    assert main(["serve", str(tmp_path / "nothing")]) == 2
    assert "not a pced store" in capsys.readouterr().err
    assert main(["serve", str(store.root), "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err
    command = [sys.executable, "-m", "pced.cli", "serve"]
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(command + [str(store.root), "--port", str(port), "--log-level", "warning"],
                              stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PCED_API_KEY": KEY})
    try:
        url = f"http://127.0.0.1:{port}"

        def healthy():
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, seconds=120)
        assert httpx.post(f"{url}/v1/pced/answer", json={"question": QUESTION}).status_code == 401
        answer = httpx.post(f"{url}/v1/pced/answer", json={"question": QUESTION, "max_tokens": 3},
                            headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert answer.status_code == 200 and len(answer.json()["trace"]) == 3
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
    assert "API key required" in (tmp_path / "serve.log").read_text()


def test_queued_stream_gets_headers_and_a_comment_at_once(server):
    url, app = server
    worker = app.state.worker
    headers = {"Authorization": f"Bearer {KEY}"}
    long_body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 1024, "stream": True}
    short_body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 3, "stream": True}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as first, httpx.Client(base_url=url, headers=headers,
                                                                                          timeout=60) as second:
        with first.stream("POST", "/v1/chat/completions", json=long_body) as running:
            lines = running.iter_lines()
            assert next(line for line in lines if '"doc_id"' in line)  # the first request is generating
            started = time.perf_counter()
            with second.stream("POST", "/v1/chat/completions", json=short_body) as queued:
                waited = time.perf_counter() - started
                assert queued.status_code == 200 and queued.headers["content-type"].startswith("text/event-stream")
                queued_lines = queued.iter_lines()
                assert next(queued_lines) == ": queued, 1 request(s) ahead"
                assert waited < 5, waited  # headers at once, not after the first request's 1,024 tokens
        # leaving both streams cancels both; the queued one never ran
        wait_for(lambda: worker.pending == 0)


def test_langchain_chat_openai_against_pced_serve(server, store):
    langchain_openai = pytest.importorskip("langchain_openai")

    url, _ = server
    chat = langchain_openai.ChatOpenAI(base_url=f"{url}/v1", api_key=KEY, model=store.llm.name, max_tokens=6,
                                       temperature=0, extra_body={"pced": {"top_k": 2}})
    reply = chat.invoke(QUESTION)
    direct = httpx.post(f"{url}/v1/pced/answer", headers={"Authorization": f"Bearer {KEY}"},
                        json={"question": QUESTION, "top_k": 2, "max_tokens": 6}, timeout=60).json()
    assert direct["answer"] and reply.content == direct["answer"]
    assert "".join(chunk.content for chunk in chat.stream(QUESTION)) == direct["answer"]
