"""Shared pieces of the server tests: one tiny-model store per session and a live uvicorn server."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

CORPUS = [
    ("zorblax", "Zorblax", "The Zorblax Company makes tidal clocks. It was founded by Mira Quell."),
    ("quell", "Mira Quell", "Mira Quell was born in the town of Oskvale."),
    ("oskvale", "Oskvale", "Oskvale is a fishing town on Lake Tarnow."),
    ("heron", "Grey heron", "The grey heron is the national bird of Elumia."),
    ("vantor", "Vantor", "Vantor is the capital of Elumia."),
]
QUESTION = "Where was the founder of Zorblax born?"


def tiny_store(tmp_path_factory, tiny_llm):
    """Build once per session (the folder is shared by every server test module), then open."""
    from pced.documents import Document
    from pced.store import DocumentStore, IndexSettings, index_store

    root = Path(tmp_path_factory.getbasetemp()) / "server-store"
    if (root / "manifest.json").is_file():
        return DocumentStore.open(root, tiny_llm)
    documents = [Document(doc_id, text, title) for doc_id, title, text in CORPUS]
    store, _ = index_store(documents, root, IndexSettings(model=str(tiny_llm.path), storage_dtype="float32"),
                           llm=tiny_llm, progress=False)
    return store


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def live_server(app):
    """Run ``app`` with uvicorn on 127.0.0.1 in a thread; yields the base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def sse_chunks(lines) -> list:
    """The JSON payloads of an SSE stream up to ``data: [DONE]`` (asserted present)."""
    import json

    chunks, done = [], False
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        chunks.append(json.loads(data))
    assert done, "the stream did not end with data: [DONE]"
    return chunks


def wait_healthy(process, url: str, log: Path, deadline: float) -> None:
    """Until ``url``/health answers 200: a server started as ``process`` (its output in ``log``),
    which must not exit nor take past ``deadline`` (``time.monotonic()``)."""
    import httpx

    while True:
        assert process.poll() is None, f"pced serve exited: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "pced serve did not start in time"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)


def metric_samples(text: str) -> dict[tuple, float]:
    """Every sample of a /metrics scrape: (name, sorted labels) -> value (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(scraped: dict, name: str, **labels) -> float:
    return scraped[(name, tuple(sorted(labels.items())))]
