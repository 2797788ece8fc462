"""``/metrics``: what an operator watches, in Prometheus' text format (``prometheus_client``).

The server's own state is read when scraped, from the same numbers ``/health`` shows (requests by
outcome, pending, readiness, the store generation it answers from, the answering engine's counters),
so the two never disagree; what only a finished answer knows (its time to first token, its decode
time per token, where its prompt tokens came from, its tokens) is observed as each answer ends. A vLLM
engine's own metrics (``vllm:*``: its queue, KV cache usage, prefix-cache hits, tokens by source),
which it keeps in this process's default registry, follow pced's.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
DECODE_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


class ServerMetrics:
    """The metrics of one server's worker (``server.worker.Worker``)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_WorkerState(worker))
        self.ttft = Histogram("pced_ttft_seconds", "Time to the first token of an answer, from the request's start "
                              "(retrieval, cache loads and prefill included)", ["backend", "method"],
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.decode = Histogram("pced_decode_seconds_per_token", "An answer's decode time per token after its first",
                                ["backend", "method"], buckets=DECODE_BUCKETS, registry=self.registry)
        self.generated = Counter("pced_generated_tokens", "Tokens of finished answers", ["backend", "method"],
                                 registry=self.registry)
        self.prompt = Counter("pced_prompt_tokens", "Tokens of finished answers' prompts by where their keys and values "
                              "came from: the store's caches, or computed (vLLM: also its prefix cache)",
                              ["backend", "source"], registry=self.registry)

    def observe(self, answer: Any, backend: str, method: str, from_store: bool) -> None:
        """A finished answer: its timings, its tokens, and its prompt tokens by source. ``from_store``:
        its documents' caches are the store's (not a request's own documents)."""
        timings, stats, tokens = answer.timings, answer.stats, len(answer.trace)
        self.ttft.labels(backend, method).observe(timings.get("ttft_s", 0.0))
        if tokens > 1:
            self.decode.labels(backend, method).observe(
                max(0.0, timings.get("total_s", 0.0) - timings.get("ttft_s", 0.0)) / (tokens - 1))
        self.generated.labels(backend, method).inc(tokens)
        for source, count in prompt_sources(stats, method, from_store).items():
            self.prompt.labels(backend, source).inc(count)

    def exposition(self) -> bytes:
        """Every metric, pced's then the engine's (``vllm:*``, where an engine in this process keeps them)."""
        from prometheus_client import REGISTRY

        engine = generate_latest(REGISTRY).decode()
        engine_lines = _families(engine, "vllm:")
        return generate_latest(self.registry) + engine_lines.encode()


def prompt_sources(stats: dict, method: str, from_store: bool) -> dict[str, int]:
    """An answer's prompt tokens by source: vLLM counts them itself (tokens the store's connector
    supplied, found in its prefix cache, computed); on pced's own rows a PCED answer's documents come
    from their caches, the store's when ``from_store``, and every other prompt token is computed."""
    if "store_tokens" in stats:
        cached = int(stats.get("cached_tokens", 0)) - int(stats["store_tokens"])
        return {"store": int(stats["store_tokens"]), "prefix_cache": max(0, cached),
                "computed": int(stats.get("prefilled_tokens", 0))}
    context = int(stats.get("context_tokens", 0))
    if method == "pced" and from_store:
        return {"store": context}
    return {"computed": context}


def _families(text: str, prefix: str) -> str:
    """The exposition lines (with their HELP and TYPE lines) of the metrics whose names start with ``prefix``."""
    return "".join(line + "\n" for line in text.splitlines()
                   if line.startswith(prefix) or line.startswith(f"# HELP {prefix}") or line.startswith(f"# TYPE {prefix}"))


class _WorkerState:
    """The worker's state as /health reports it, read at scrape time."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def collect(self):
        worker = self.worker
        requests = CounterMetricFamily("pced_requests", "Requests by outcome (as /health counts them)", labels=["outcome"])
        for outcome, count in worker.counts.items():
            requests.add_metric([outcome], count)
        yield requests
        yield GaugeMetricFamily("pced_requests_pending", "Requests queued or running", value=worker.pending)
        yield GaugeMetricFamily("pced_ready", "1 while the server takes requests (0: draining, or its engine died)",
                                value=0 if worker.refusal() is not None else 1)
        store = worker.store_health()
        yield GaugeMetricFamily("pced_store_generation", "The store generation the server answers from",
                                value=store["generation"])
        yield GaugeMetricFamily("pced_store_documents", "Documents in that generation", value=store["documents"])
        yield CounterMetricFamily("pced_store_reloads", "New store generations opened since the start",
                                  value=store["reloads"])
        engine = CounterMetricFamily("pced_engine", "The answering engine's own counts, as /health's backend reports them "
                                     "(vLLM: questions, prompt tokens, cached, prefilled, from the store, degraded "
                                     "steps, warm-up tokens)", labels=["backend", "count"])
        backend = worker.backend_health()
        for name, value in backend.items():
            if name not in ("name", "max_concurrent") and isinstance(value, int) and not isinstance(value, bool):
                engine.add_metric([backend["name"], name], value)
        yield engine
