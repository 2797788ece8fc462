"""pced serve's API in process (FastAPI TestClient) on a tiny-model store: the contract, the
OpenAI shapes, streaming, request documents, and every refusal as the right 4xx."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from pced.text.answers import answer_json  # noqa: E402
from pced.methods import make_generation  # noqa: E402
from pced.decoding.rule import RuleConfig  # noqa: E402
from pced.decoding.sampling import SamplingConfig  # noqa: E402
from pced.server import Limits, create_app  # noqa: E402
from helpers.server import QUESTION, sse_chunks, tiny_store  # noqa: E402

CONTRACT = {"answer", "method", "experts", "trace", "beta", "timings"}


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_llm):
    return tiny_store(tmp_path_factory, tiny_llm)


@pytest.fixture(scope="module")
def client(store):
    with TestClient(create_app(store)) as client:
        yield client


def direct_answer(store, question, top_k, max_tokens):
    candidates = store.retrieve(question, top_k=top_k)
    answer = make_generation(store.generator, "pced", candidates, question, RuleConfig(),
                             SamplingConfig(max_new_tokens=max_tokens)).answer()
    return answer_json(answer, candidates)


def test_health_and_models(client, store):
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["documents"] == len(store.documents)
    assert health["model"] == store.llm.name
    assert health["kv_pool"] is None  # a CPU model without --gpu-cache-gb: caches go straight from the mapping
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [store.llm.name]
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"] and "/static/app.js" in page.text
    assert client.get("/static/app.js").status_code == 200


def test_answer_endpoint_is_the_ask_json_contract(client, store):
    response = client.post("/v1/pced/answer", json={"question": QUESTION, "top_k": 3, "max_tokens": 8})
    assert response.status_code == 200, response.text
    out = response.json()
    assert CONTRACT <= set(out)
    assert {"retrieval_s", "cache_load_s", "ttft_s", "total_s", "queue_s"} <= set(out["timings"])
    expected = direct_answer(store, QUESTION, 3, 8)
    # Same retrieval, same greedy decoding: token for token the Python API's answer.
    assert out["answer"] == expected["answer"]
    assert out["trace"] == expected["trace"] and len(out["trace"]) == 8
    assert [e["doc_id"] for e in out["experts"]] == [e["doc_id"] for e in expected["experts"]]
    assert out["beta"] == pytest.approx(expected["beta"], abs=1e-6)
    ids = {e["doc_id"] for e in out["experts"]}
    assert all(t["doc_id"] in ids for t in out["trace"])  # max aggregation: a document wins every token


def test_chat_completion_carries_trace_and_usage(client):
    body = {"model": "anything", "messages": [{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
            "max_tokens": 8, "pced": {"top_k": 3}}
    out = client.post("/v1/chat/completions", json=body).json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["role"] == "assistant"
    pced = choice["message"]["pced"]
    assert {"trace", "experts", "beta", "timings", "method"} <= set(pced) and len(pced["beta"]) == 3
    contract = client.post("/v1/pced/answer", json={"question": QUESTION, "top_k": 3, "max_tokens": 8}).json()
    assert choice["message"]["content"] == contract["answer"] and pced["trace"] == contract["trace"]
    assert out["usage"]["completion_tokens"] == 8
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + 8 and out["usage"]["prompt_tokens"] > 8


def test_streaming_sends_experts_first_then_tokens_then_trace(client):
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8, "stream": True, "pced": {"top_k": 3}}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks = sse_chunks(response.iter_lines())
    first, tokens, last = chunks[0], chunks[1:-1], chunks[-1]
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"
    experts = [e["doc_id"] for e in first["pced"]["experts"]]
    assert len(experts) == 3 and all(0 < e["relevance"] < 1 for e in first["pced"]["experts"])
    assert tokens and all(c["pced"]["doc_id"] in experts for c in tokens)
    assert {c["id"] for c in chunks} == {first["id"]}
    assert last["choices"][0]["finish_reason"] == "length" and last["usage"]["completion_tokens"] == 8
    text = "".join(c["choices"][0]["delta"]["content"] for c in tokens)
    contract = client.post("/v1/pced/answer", json={"question": QUESTION, "top_k": 3, "max_tokens": 8}).json()
    assert text == contract["answer"] and last["pced"]["trace"] == contract["trace"]
    streamed = [(c["pced"]["index"], c["pced"]["doc_id"]) for c in tokens]
    assert streamed == [(i, t["doc_id"]) for i, t in enumerate(contract["trace"]) if t["token"]]


def test_request_documents_replace_retrieval(client):
    documents = [{"id": "a", "text": "The sky over Vantor is green.", "title": "Sky", "score": 0.9},
                 {"id": "b", "text": "Vantor has two moons.", "score": 0.4},
                 {"text": "Untitled note without an id."}]
    out = client.post("/v1/pced/answer", json={"question": "What colour is the sky?", "documents": documents,
                                               "max_tokens": 5, "gamma": 1.0, "beta": 0.5}).json()
    assert [(e["doc_id"], e["title"], e["relevance"]) for e in out["experts"]] == [("a", "Sky", 0.9), ("b", "", 0.4), ("doc3", "", 1.0)]
    assert out["beta"] == [0.5, 0.5, 0.5]
    assert all(t["doc_id"] in {"a", "b", "doc3"} for t in out["trace"])
    pruned = client.post("/v1/pced/answer", json={"question": "What colour is the sky?", "documents": documents,
                                                  "max_tokens": 2, "max_experts": 2}).json()
    assert [e["doc_id"] for e in pruned["experts"]] == ["a", "doc3"]  # the two most relevant, in the given order
    single = client.post("/v1/pced/answer", json={"question": "What colour?", "documents": documents[:1],
                                                  "method": "single", "max_tokens": 3}).json()
    assert single["method"] == "single" and all(t["doc_id"] is None for t in single["trace"])


def test_bad_requests_each_get_the_right_4xx(store):
    key = "s3cret"
    app = create_app(store, Limits(max_body_bytes=20_000), api_key=key)
    auth = {"Authorization": f"Bearer {key}"}
    ok_chat = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2}
    cases = [
        # (name, method, path, kwargs, status, code)
        ("no key", "POST", "/v1/chat/completions", {"json": ok_chat}, 401, "invalid_api_key"),
        ("wrong key", "POST", "/v1/pced/answer", {"json": {"question": "q"}, "headers": {"Authorization": "Bearer nope"}}, 401, "invalid_api_key"),
        ("no key on models", "GET", "/v1/models", {}, 401, "invalid_api_key"),
        ("no key on health", "GET", "/health", {}, 401, "invalid_api_key"),
        ("wrong key on health", "GET", "/health", {"headers": {"Authorization": "Bearer nope"}}, 401, "invalid_api_key"),
        ("malformed JSON", "POST", "/v1/chat/completions", {"content": b'{"messages": [', "headers": {**auth, "Content-Type": "application/json"}}, 400, "invalid_json"),
        ("not an object", "POST", "/v1/pced/answer", {"json": [1, 2], "headers": auth}, 400, "invalid_value"),
        ("empty body", "POST", "/v1/pced/answer", {"headers": auth}, 400, None),
        ("empty question", "POST", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "  "}]}, "headers": auth}, 400, "empty_question"),
        ("empty answer question", "POST", "/v1/pced/answer", {"json": {"question": ""}, "headers": auth}, 400, "empty_question"),
        ("no user message", "POST", "/v1/chat/completions", {"json": {"messages": [{"role": "system", "content": "hi"}]}, "headers": auth}, 400, "missing_user_message"),
        ("no messages", "POST", "/v1/chat/completions", {"json": {"messages": []}, "headers": auth}, 400, "invalid_value"),
        ("top_k=0", "POST", "/v1/chat/completions", {"json": {**ok_chat, "pced": {"top_k": 0}}, "headers": auth}, 400, "invalid_value"),
        ("top_k huge", "POST", "/v1/pced/answer", {"json": {"question": "q", "top_k": 10**9}, "headers": auth}, 400, "invalid_value"),
        ("top_k string", "POST", "/v1/pced/answer", {"json": {"question": "q", "top_k": "3"}, "headers": auth}, 400, "invalid_value"),
        ("question number", "POST", "/v1/pced/answer", {"json": {"question": 42}, "headers": auth}, 400, "invalid_value"),
        ("messages string", "POST", "/v1/chat/completions", {"json": {"messages": "hi"}, "headers": auth}, 400, "invalid_value"),
        ("max_tokens=0", "POST", "/v1/chat/completions", {"json": {**ok_chat, "max_tokens": 0}, "headers": auth}, 400, "invalid_value"),
        ("max_tokens huge", "POST", "/v1/chat/completions", {"json": {**ok_chat, "max_tokens": 100_000}, "headers": auth}, 400, "invalid_value"),
        ("temperature string", "POST", "/v1/chat/completions", {"json": {**ok_chat, "temperature": "hot"}, "headers": auth}, 400, "invalid_value"),
        ("temperature 5", "POST", "/v1/chat/completions", {"json": {**ok_chat, "temperature": 5}, "headers": auth}, 400, "invalid_value"),
        ("unknown method", "POST", "/v1/chat/completions", {"json": {**ok_chat, "pced": {"method": "magic"}}, "headers": auth}, 400, "invalid_value"),
        ("unknown pced option", "POST", "/v1/chat/completions", {"json": {**ok_chat, "pced": {"topk": 3}}, "headers": auth}, 400, "invalid_value"),
        ("max_experts=0", "POST", "/v1/chat/completions", {"json": {**ok_chat, "pced": {"max_experts": 0}}, "headers": auth}, 400, "invalid_value"),
        ("negative gamma", "POST", "/v1/pced/answer", {"json": {"question": "q", "gamma": -1}, "headers": auth}, 400, "invalid_value"),
        ("colbert on a MiniLM store", "POST", "/v1/pced/answer", {"json": {"question": "q", "retriever": "colbert", "max_tokens": 1}, "headers": auth}, 400, "invalid_value"),
        ("n=2", "POST", "/v1/chat/completions", {"json": {**ok_chat, "n": 2}, "headers": auth}, 400, "unsupported_value"),
        ("too many stops", "POST", "/v1/chat/completions", {"json": {**ok_chat, "stop": ["a", "b", "c", "d", "e"]}, "headers": auth}, 400, "invalid_value"),
        ("question too long", "POST", "/v1/pced/answer", {"json": {"question": "why " * 1001}, "headers": auth}, 400, "question_too_long"),
        ("too many documents", "POST", "/v1/pced/answer", {"json": {"question": "q", "documents": [{"text": "x"}] * 65}, "headers": auth}, 400, "invalid_value"),
        ("empty documents", "POST", "/v1/pced/answer", {"json": {"question": "q", "documents": []}, "headers": auth}, 400, "invalid_value"),
        ("blank document", "POST", "/v1/pced/answer", {"json": {"question": "q", "documents": [{"text": "  "}]}, "headers": auth}, 400, "invalid_value"),
        ("duplicate ids", "POST", "/v1/pced/answer", {"json": {"question": "q", "documents": [{"id": "a", "text": "x"}, {"id": "a", "text": "y"}]}, "headers": auth}, 400, "invalid_value"),
        ("document too long", "POST", "/v1/pced/answer", {"json": {"question": "q", "documents": [{"text": "word " * 3000}]}, "headers": auth}, 400, "document_too_long"),
        ("score above 1", "POST", "/v1/pced/answer", {"json": {"question": "q", "documents": [{"text": "x", "score": 2}]}, "headers": auth}, 400, "invalid_value"),
        ("oversized body", "POST", "/v1/pced/answer", {"json": {"question": "q", "documents": [{"text": "x" * 30_000}]}, "headers": auth}, 413, "request_too_large"),
        ("oversized chunked body", "POST", "/v1/pced/answer", {"content": iter([b'{"question": "', b"x" * 25_000, b'"}']), "headers": auth}, 413, "request_too_large"),
        ("unknown path", "GET", "/v1/nothing", {"headers": auth}, 404, "http_404"),
        ("wrong verb", "GET", "/v1/chat/completions", {"headers": auth}, 405, "http_405"),
    ]
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/health").status_code == 401  # it tells the model, documents and queue: keyed
        assert client.get("/").status_code == 200 and client.get("/static/app.js").status_code == 200  # the page's files
        for name, method, path, kwargs, status, code in cases:
            response = client.request(method, path, **kwargs)
            assert response.status_code == status, (name, response.status_code, response.text)
            error = response.json()["error"]
            assert error["message"] and error["type"] == "invalid_request_error", (name, error)
            assert code is None or error["code"] == code, (name, error)
            assert "Traceback" not in response.text
        assert client.post("/v1/pced/answer", json={"question": QUESTION, "max_tokens": 2}, headers=auth).status_code == 200
        assert client.get("/health", headers=auth).json()["failed"] == 2  # colbert and the long document reached the worker


def test_unexpected_failures_are_500_without_details_and_queue_limits_503(store, monkeypatch):
    app = create_app(store)

    def broken(*args, **kwargs):
        raise RuntimeError("secret internals /etc/passwd")

    monkeypatch.setattr(app.state.worker.store, "retrieve", broken)
    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.post("/v1/pced/answer", json={"question": QUESTION, "max_tokens": 2})
        assert response.status_code == 500
        assert response.json()["error"]["type"] == "server_error" and "secret" not in response.text
        body = {"messages": [{"role": "user", "content": QUESTION}], "stream": True}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 500 and "secret" not in response.text
    with TestClient(create_app(store, Limits(max_queue=0))) as client:
        response = client.post("/v1/pced/answer", json={"question": QUESTION})
        assert response.status_code == 503 and json.loads(response.text)["error"]["code"] == "overloaded"


def test_health_reports_the_device_pool_it_answers_from(tmp_path_factory, tiny_llm):
    from pced.kv.tiers import CacheTiers
    from pced.store import DocumentStore

    store = DocumentStore.open(tiny_store(tmp_path_factory, tiny_llm).root, tiny_llm, tiers=CacheTiers(gpu_cache_gb=0.5))
    with TestClient(create_app(store)) as client:
        answers = [client.post("/v1/pced/answer", json={"question": QUESTION, "top_k": 3, "max_tokens": 6}).json()
                   for _ in range(2)]
        pool = client.get("/health").json()["kv_pool"]
    assert answers[0]["answer"] == answers[1]["answer"] == direct_answer(store, QUESTION, 3, 6)["answer"]
    assert pool["budget_bytes"] == 2**29 and pool["entries"] == 3 and pool["misses"] == 3 and pool["hits"] >= 3


def test_server_takes_prior_and_ngram_in_the_pced_object(store):
    from pced.documents import Candidate, Document

    documents = [{"id": "a", "text": "Mira Quell founded the Zorblax company.", "score": 0.9},
                 {"id": "b", "text": "Mira Quell was born in the town of Oskvale.", "score": 0.4}]
    with TestClient(create_app(store), raise_server_exceptions=False) as client:
        body = {"question": QUESTION, "documents": documents, "max_tokens": 16, "prior": "standardized",
                "no_repeat_ngram": 2}
        response = client.post("/v1/pced/answer", json=body)
        assert response.status_code == 200, response.text
        chat = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": QUESTION}], "documents": documents, "max_tokens": 16,
            "pced": {"prior": "standardized", "no_repeat_ngram": 2}})
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == response.json()["answer"]
        for bad in ({"prior": "nope"}, {"no_repeat_ngram": -1}, {"no_repeat_ngram": "3"}, {"no_repeat_ngram": 2.5}):
            refused = client.post("/v1/pced/answer", json={"question": QUESTION, **bad})
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_value", (bad, refused.text)
    candidates = [Candidate(Document(d["id"], d["text"], ""), d["score"], {"given": d["score"]}) for d in documents]
    direct = make_generation(store.generator, "pced", candidates, QUESTION, RuleConfig(prior="standardized"),
                             SamplingConfig(max_new_tokens=16, no_repeat_ngram=2)).answer()
    assert response.json()["answer"] == direct.text


def test_the_page_asks_what_the_cli_asks(client):
    from pced.options import METHODS, AskOptions

    defaults = client.get("/defaults").json()
    assert defaults == {"method": AskOptions.method, "methods": list(METHODS), "top_k": AskOptions.top_k,
                        "max_top_k": Limits().max_top_k, "max_tokens": SamplingConfig().max_new_tokens,
                        "max_tokens_limit": Limits().max_tokens}
    page = client.get("/").text + client.get("/static/app.js").text
    for field in ('id="top-k"', 'id="max-tokens"'):  # the form's inputs carry no value of their own
        tag = page[page.index(field) - 40:page.index(field) + 80]
        assert "value=" not in tag and "max=" not in tag, tag
    assert "<option>" not in page and "|| 4" not in page and "|| 64" not in page
@pytest.mark.parametrize("method", ["pced", "mapreduce"])
def test_a_request_over_the_time_limit_ends_with_its_error_and_the_next_request_runs(store, monkeypatch, method):
    import time

    import pced.decoding.loop

    pick = pced.decoding.loop.pick_token

    def slow_pick(*args, **kwargs):  # a slow model: 0.1 s a token (mapreduce: its map calls too)
        time.sleep(0.1)
        return pick(*args, **kwargs)

    app = create_app(store, Limits(request_timeout_s=0.5))
    body = {"question": QUESTION, "top_k": 3, "max_tokens": 64, "method": method}
    with TestClient(app) as client:
        monkeypatch.setattr("pced.decoding.loop.pick_token", slow_pick)
        started = time.monotonic()
        response = client.post("/v1/pced/answer", json=body)
        elapsed = time.monotonic() - started
        health = client.get("/health").json()
        assert response.status_code == 504, response.text
        error = response.json()["error"]
        assert error["code"] == "timeout" and "time limit of 0.5 s" in error["message"], error
        assert elapsed < 2.0 and health["timed_out"] == 1 and health["pending"] == 0
        assert health["last_tokens"] < 64  # stopped, not run to the end
        stream = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": QUESTION}],
                                                            "max_tokens": 64, "stream": True, "pced": {"method": method}})
        if method == "pced":  # it started (200), then stopped at the limit: an error event ends the stream
            assert stream.status_code == 200 and sse_chunks(stream.text.splitlines())[-1]["error"]["code"] == "timeout"
        else:  # the map calls ran into the limit before the first token: still a status code
            assert stream.status_code == 504 and stream.json()["error"]["code"] == "timeout"
        monkeypatch.setattr("pced.decoding.loop.pick_token", pick)
        after = client.post("/v1/pced/answer", json={**body, "method": "pced", "max_tokens": 2})
        assert after.status_code == 200 and len(after.json()["trace"]) == 2
        assert client.get("/health").json()["timed_out"] == 2


@pytest.mark.parametrize("header, server, names, allowed", [
    ("127.0.0.1:8000", ("127.0.0.1", 8000), (), True),
    ("localhost:8000", ("127.0.0.1", 8000), (), True),
    ("[::1]:8000", ("::1", 8000), (), True),
    ("192.168.1.5:8000", ("192.168.1.5", 8000), (), True),  # bound to 0.0.0.0, reached on this address
    ("evil.example:8000", ("127.0.0.1", 8000), (), False),
    ("localhost:9000", ("127.0.0.1", 8000), (), False),
    ("localhost", ("127.0.0.1", 8000), (), False),  # port 80 implied
    ("", ("127.0.0.1", 8000), (), False),
    ("pced.lan:8000", ("10.0.0.2", 8000), ("pced.lan",), True),
    ("testserver", ("testserver", 80), (), True),
])
def test_host_allowed(header, server, names, allowed):
    from pced.server.app import host_allowed

    assert host_allowed(header, server, names) is allowed
