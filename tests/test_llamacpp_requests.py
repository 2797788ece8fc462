"""llama.cpp sequence states under a byte budget: documents sent with a request (server, ``pced
generate --docs``) in a bounded request cache of their own, never in the store; a store indexed
with ``--kv-budget-gb`` encodes states when first asked for and answers as an unbounded one.

Skipped where llama-cpp-python is not installed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from pced.cli import main  # noqa: E402
from pced.documents import Document  # noqa: E402
from pced.kv.budget import GB  # noqa: E402
from pced.backends.llamacpp.settings import LlamaSettings  # noqa: E402
from pced.options import AskOptions  # noqa: E402
from pced.pipeline import ask  # noqa: E402
from pced.decoding.sampling import SamplingConfig  # noqa: E402
from pced.server import Limits, create_app  # noqa: E402
from pced.store import DocumentStore, IndexSettings, index_store  # noqa: E402

LLAMA = LlamaSettings(threads=1)
FACTS = [Document(f"d{i}", f"Fact {i}: the {c} lantern of Vey{i} is kept in tower {i * 7}.", f"Vey{i}")
         for i, c in enumerate(["red", "blue", "green", "amber", "violet", "silver"])]
QUESTIONS = ["Where is the red lantern kept?", "Which tower keeps the amber lantern?", "What colour is Vey5's lantern?",
             "Where is the red lantern kept?", "Which lantern is in tower 14?"]
OPTIONS = AskOptions(top_k=2, top_n=6, rerank=False, backend="llamacpp", backend_settings=LLAMA,
                     sampling=SamplingConfig(max_new_tokens=6))


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def state_bytes(generator) -> int:
    return max(p.stat().st_size for p in (generator.caches.root / "seq").glob("*/*.safetensors"))


def answers(store) -> list:
    out = []
    for question in QUESTIONS:
        asked = ask(store, question, OPTIONS)
        answer = asked.answer()
        out.append((answer.token_ids, [s.doc_id for s in answer.trace], [c.document.id for c in asked.candidates]))
        stats = store.generator_for("llamacpp", LLAMA).caches.stats()
        if stats["budget_bytes"] is not None:  # the question in flight may hold its own two past the budget
            assert stats["bytes"] <= max(stats["budget_bytes"], 2 * state_bytes(store.generator_for("llamacpp", LLAMA)))
    return out


@pytest.fixture(scope="module")
def full_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama") / "full"
    store, report = index_store(FACTS, root, IndexSettings(), progress=False, backend="llamacpp", backend_settings=LLAMA)
    assert report["kv_encoded"] == len(FACTS)
    return store


@pytest.mark.slow
def test_a_budgeted_llamacpp_store_answers_as_an_unbounded_one(tmp_path, full_store, capsys):
    expected = answers(full_store)
    assert full_store.generator_for("llamacpp", LLAMA).caches.stats()["misses"] == 0

    budget_gb = 3 * state_bytes(full_store.generator_for("llamacpp", LLAMA)) / GB  # three states: others evict
    bounded, report = index_store(FACTS, tmp_path / "bounded", IndexSettings(kv_budget_gb=budget_gb), progress=False,
                                  backend="llamacpp", backend_settings=LLAMA)
    assert report["kv_encoded"] == 0 and report["on_demand"]
    assert not list((tmp_path / "bounded" / "llamacpp-f16" / "seq").glob("*/*.safetensors"))
    assert answers(bounded) == expected
    stats = bounded.generator_for("llamacpp", LLAMA).caches.stats()
    assert stats["evictions"] > 0 and stats["misses"] > 3 and stats["hits"] > 0
    assert stats["bytes"] <= stats["budget_bytes"] == int(budget_gb * GB)
    assert main(["store", "stats", str(tmp_path / "bounded"), "--json"]) == 0  # without loading a model
    listed = json.loads(capsys.readouterr().out)["llamacpp-f16_budget"]
    assert {k: listed[k] for k in ("hits", "misses", "evictions")} == {k: stats[k] for k in ("hits", "misses", "evictions")}


@pytest.mark.slow
def test_an_evicted_state_is_encoded_again_when_loaded(tmp_path):
    store, _ = index_store(FACTS[:2], tmp_path / "s", IndexSettings(lazy_kv=True), progress=False, backend="llamacpp", backend_settings=LLAMA)
    caches = store.generator_for("llamacpp", LLAMA).caches
    digest = caches.add([FACTS[0].render()])[0]
    before = caches.load(digest).data.copy()
    caches.path_for(digest).unlink()  # another process evicted it meanwhile
    assert (caches.load(digest).data == before).all()  # the same bytes: encoding is deterministic
    assert caches.path_for(digest).is_file()


def request_documents(batch: int, n: int = 8) -> list[dict]:
    return [{"id": f"r{batch}-{i}", "text": f"Request fact {batch}.{i}: the harbour bell {i} rings at {i} o'clock.",
             "score": 0.5} for i in range(n)]


@pytest.mark.slow
def test_request_documents_on_llamacpp_leave_the_store_byte_identical_within_their_budget(tmp_path, full_store):
    before = tree_digest(full_store.root)
    store = DocumentStore.open(full_store.root)
    budget_gb = 14 * 700_000 / GB  # about 14 of these documents' states (one request holds 8)
    app = create_app(store, Limits(request_cache_gb=budget_gb), backend="llamacpp", settings=LLAMA,
                     request_cache_dir=str(tmp_path / "requests"))
    texts = []
    with TestClient(app) as client:
        for batch in (0, 1, 2, 2):
            response = client.post("/v1/pced/answer", json={"question": "When does the harbour bell 3 ring?",
                                                            "documents": request_documents(batch), "top_k": 8,
                                                            "max_tokens": 6})
            assert response.status_code == 200, response.text
            assert len(response.json()["experts"]) == 8
            texts.append(response.json()["answer"])
        cache = client.get("/health").json()["request_cache"]
    assert tree_digest(full_store.root) == before
    assert texts[2] == texts[3]  # the repeated request, from its stored states, answers the same
    assert cache["budget_bytes"] == int(budget_gb * GB)
    assert 0 < cache["bytes"] <= cache["budget_bytes"] and cache["evictions"] > 0
    assert (cache["misses"], cache["hits"]) == (3 * 8, 8)  # the repeated batch was found, not encoded again
    assert list((tmp_path / "requests" / "llamacpp-f16" / "seq").glob("*/*.safetensors"))


@pytest.mark.slow
def test_a_baseline_with_documents_on_a_llamacpp_server_uses_the_transformers_request_cache(tmp_path, full_store):
    before = tree_digest(full_store.root)
    app = create_app(DocumentStore.open(full_store.root), backend="llamacpp", settings=LLAMA,
                     request_cache_dir=str(tmp_path / "requests"))
    with TestClient(app) as client:
        response = client.post("/v1/pced/answer", json={"question": "When does the harbour bell 1 ring?",
                                                        "method": "ape", "documents": request_documents(0, 2),
                                                        "max_tokens": 4})
        assert response.status_code == 200, response.text
        cache = client.get("/health").json()["request_cache"]
    assert tree_digest(full_store.root) == before
    assert cache["transformers"]["misses"] == 2 and cache["transformers"]["bytes"] > 0
    assert list((tmp_path / "requests" / "kv").glob("*/*.safetensors"))


@pytest.mark.slow
def test_generate_on_llamacpp_keeps_its_states_in_the_bounded_request_cache(tmp_path, capsys):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps(d) + "\n" for d in request_documents(0, 3)))
    kv = tmp_path / "kv"
    args = ["generate", "--docs", str(docs), "--question", "When does the harbour bell 2 ring?", "--backend",
            "llamacpp", "--kv-dir", str(kv), "--request-cache-gb", "0.5", "--max-new-tokens", "6", "--json",
            "--threads", "1"]
    outputs = []
    for _ in range(2):
        assert main(args) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0]["answer"] == outputs[1]["answer"]
    counters = json.loads((kv / "llamacpp-f16" / "budget.json").read_text())  # the server's layout for --kv-dir
    assert (counters["misses"], counters["hits"]) == (3, 3)  # the second run read the states the first stored
    assert main(args + ["--cache-type", "q8_0"]) == 0  # another cache type in the same --kv-dir: a folder of its own
    capsys.readouterr()
    assert len(list((kv / "llamacpp-q8_0" / "seq").glob("*/*.safetensors"))) == 3
    assert len(list((kv / "llamacpp-f16" / "seq").glob("*/*.safetensors"))) == 3
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"id": "long", "text": "word " * 3000, "score": 0.5}) + "\n")
    assert main(["generate", "--docs", str(long), "--question", "What?", "--backend", "llamacpp", "--kv-dir",
                 str(kv)]) == 2
    assert "per document" in capsys.readouterr().err
