"""The worker's two promises about the store: request documents never touch it, and a store being
indexed keeps being served (the new generation picked up without a restart)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from pced.documents import Document  # noqa: E402
from pced.kv.budget import GB  # noqa: E402
from pced.server import Limits, create_app  # noqa: E402
from pced.store import DocumentStore, IndexSettings, index_store  # noqa: E402

from helpers.cli import write_jsonl  # noqa: E402
from helpers.server import CORPUS, QUESTION, live_server  # noqa: E402


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def new_store(root: Path, tiny_llm):
    documents = [Document(doc_id, text, title) for doc_id, title, text in CORPUS]
    store, _ = index_store(documents, root, IndexSettings(model=str(tiny_llm.path), storage_dtype="float32"),
                           llm=tiny_llm, progress=False)
    return DocumentStore.open(root, tiny_llm)


def request_documents(batch: int) -> list[dict]:
    return [{"id": f"r{batch}-{i}", "text": f"Request fact {batch}.{i}: the harbour bell {i} rings at {i} o'clock.",
             "score": 0.5} for i in range(64)]


def test_request_documents_leave_the_store_byte_identical_and_the_request_cache_in_its_budget(tmp_path, tiny_llm):
    store = new_store(tmp_path / "store", tiny_llm)
    before = tree_digest(store.root)
    budget_gb = 2_000_000 / GB  # about 100 of these documents' caches (one request holds 64 at once)
    app = create_app(store, Limits(request_cache_gb=budget_gb), request_cache_dir=str(tmp_path / "requests"))
    with TestClient(app) as client:
        for batch in (0, 1, 2, 2):
            response = client.post("/v1/pced/answer", json={"question": QUESTION, "documents": request_documents(batch),
                                                            "top_k": 64, "max_tokens": 2})
            assert response.status_code == 200, response.text
            assert len(response.json()["experts"]) == 64
        cache = client.get("/health").json()["request_cache"]
    assert tree_digest(store.root) == before
    assert cache["budget_bytes"] == int(budget_gb * GB)
    assert 0 < cache["bytes"] <= cache["budget_bytes"] and cache["evictions"] > 0
    # the repeated batch was shared: its 64 documents were found, not encoded again
    assert (cache["misses"], cache["hits"]) == (3 * 64, 64)


@pytest.mark.slow
def test_a_served_store_under_a_concurrent_index_answers_every_request(tmp_path, tiny_llm, tiny_model_dir):
    root = tmp_path / "store"
    store = new_store(root, tiny_llm)
    more = write_jsonl(tmp_path / "more.jsonl", [
        {"id": f"m{i}", "title": f"Harbour {i}", "text": f"Harbour {i} of Oskvale has {i} boats and a red crane. " * 3}
        for i in range(40)])
    statuses, generations = [], set()
    app = create_app(store)
    with live_server(app) as url:
        import httpx

        with httpx.Client(base_url=url, timeout=120) as http:
            index = subprocess.Popen([sys.executable, "-m", "pced.cli", "index", str(more), "--out", str(root),
                                      "--model", str(tiny_model_dir), "--storage-dtype", "float32"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            deadline = time.monotonic() + 400
            while time.monotonic() < deadline and len(statuses) < 300:
                done = index.poll() is not None
                response = http.post("/v1/pced/answer", json={"question": QUESTION, "top_k": 3, "max_tokens": 2})
                statuses.append((response.status_code, response.text[:200]))
                generations.add(http.get("/health").json()["store"]["generation"])
                if done:
                    break
            out, err = index.communicate(timeout=60)
            assert index.returncode == 0, err
            health = http.get("/health").json()
    assert statuses and all(code == 200 for code, _ in statuses), [s for s in statuses if s[0] != 200][:3]
    assert generations >= {1, 2}  # it served the old generation during the run and the new one after
    assert health["store"]["generation"] == 2 and health["documents"] == len(CORPUS) + 40
    assert health["store"]["reloads"] == 1 and health["store"]["newer_generation_unread"] is None
