"""What an operator watches: ``/metrics`` in Prometheus' format, scraped and parsed, agreeing with
``/health``; and ``/health`` naming a store generation ``pced index`` published without a request."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from pced.documents import Document  # noqa: E402
from pced.server import Limits, create_app  # noqa: E402
from pced.store import DocumentStore, IndexSettings, index_store  # noqa: E402
from helpers.server import CORPUS, QUESTION  # noqa: E402
from helpers.server import metric as value  # noqa: E402
from helpers.server import metric_samples as samples  # noqa: E402


@pytest.fixture()
def store(tmp_path, tiny_llm):
    documents = [Document(doc_id, text, title) for doc_id, title, text in CORPUS]
    store, _ = index_store(documents, tmp_path / "store", IndexSettings(model=str(tiny_llm.path), storage_dtype="float32"),
                           llm=tiny_llm, progress=False)
    return store


def test_metrics_count_what_health_counts_and_time_each_answer(store):
    with TestClient(create_app(store, Limits(store_poll_s=0))) as client:
        for max_tokens in (4, 6):
            assert client.post("/v1/pced/answer", json={"question": QUESTION, "top_k": 3,
                                                        "max_tokens": max_tokens}).status_code == 200
        assert client.post("/v1/pced/answer", json={"question": QUESTION, "max_tokens": 4, "method": "all"}).status_code == 200
        assert client.post("/v1/pced/answer", json={"question": "", "max_tokens": 4}).status_code == 400  # refused: not counted
        health = client.get("/health").json()
        scrape = client.get("/metrics")
    assert scrape.status_code == 200 and scrape.headers["content-type"].startswith("text/plain")
    scraped = samples(scrape.text)
    for outcome in ("completed", "cancelled", "failed", "timed_out"):
        assert value(scraped, "pced_requests_total", outcome=outcome) == health[outcome]
    assert health["completed"] == 3
    assert value(scraped, "pced_requests_pending") == health["pending"] == 0
    assert value(scraped, "pced_ready") == 1
    assert value(scraped, "pced_store_generation") == health["store"]["generation"]
    assert value(scraped, "pced_store_documents") == health["documents"] == len(CORPUS)
    assert value(scraped, "pced_ttft_seconds_count", backend="transformers", method="pced") == 2
    assert value(scraped, "pced_ttft_seconds_count", backend="transformers", method="all") == 1
    assert value(scraped, "pced_ttft_seconds_sum", backend="transformers", method="pced") > 0
    assert value(scraped, "pced_decode_seconds_per_token_count", backend="transformers", method="pced") == 2
    generated = value(scraped, "pced_generated_tokens_total", backend="transformers", method="pced")
    assert 2 <= generated <= 4 + 6
    # PCED's documents came from the store's caches; concatenation computed its whole prompt
    assert value(scraped, "pced_prompt_tokens_total", backend="transformers", source="store") > 0
    assert value(scraped, "pced_prompt_tokens_total", backend="transformers", source="computed") > 0


def test_health_and_metrics_name_a_new_generation_without_a_request(store, tiny_llm):
    with TestClient(create_app(store, Limits(store_poll_s=0.2))) as client:
        before = client.get("/health").json()["store"]
        index_store([Document("ilden", "Mira Quell moved to Port Ilden.", "Port Ilden")], store.root,
                    IndexSettings(model=str(tiny_llm.path), storage_dtype="float32"), llm=tiny_llm, progress=False)
        deadline = time.monotonic() + 30
        while client.get("/health").json()["store"]["generation"] == before["generation"]:
            assert time.monotonic() < deadline, "the server did not open the new generation within 30 s"
            time.sleep(0.1)
        after = client.get("/health").json()
        scraped = samples(client.get("/metrics").text)
    assert after["store"]["generation"] == before["generation"] + 1 and after["documents"] == len(CORPUS) + 1
    assert after["completed"] == 0  # no request was asked
    assert value(scraped, "pced_store_generation") == after["store"]["generation"]
    assert value(scraped, "pced_store_reloads_total") == after["store"]["reloads"] == 1
    assert DocumentStore.open(store.root).generation == after["store"]["generation"]
