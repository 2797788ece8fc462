"""Load test for ``pced serve``: N concurrent clients x M questions on loopback, zero errors expected.

Starts ``pced serve STORE`` itself on a free port (default store: the demo store that ``pced demo``
builds in $PCED_CACHE_DIR/demo-store-<version>), or takes ``--url`` of a running server. Half the
clients stream (SSE, time to first token measured), half do plain chat completions. Prints and
saves median / p95 latency to runs/load_test/results.{json,md} (one section per --backend, and the
requests/s ratio to the first backend when several are given).

    python -m pced.bench.load_test                      # demo store, 20 clients x 5 questions
    python -m pced.bench.load_test --backend A --backend B   # two backends' servers, one after the other
    python -m pced.bench.load_test --store DIR --model PATH
    python -m pced.bench.load_test --url http://127.0.0.1:8000 --api-key KEY
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ..backend import DEFAULT_BACKEND, backend_names

FALLBACK_QUESTIONS = [
    "What is this collection of documents about?",
    "Who founded the company mentioned in the documents?",
    "Where is the capital city?",
    "When was it built?",
    "Which animal is mentioned?",
]


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def load_questions() -> list[str]:
    try:
        from importlib import resources

        items = json.loads((resources.files("pced") / "data" / "demo_questions.json").read_text())
        return [item["question"] for item in items] + FALLBACK_QUESTIONS
    except Exception:
        return FALLBACK_QUESTIONS


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def auth_headers(args) -> dict:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def start_server(args, backend: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "pced.cli", "serve", str(args.store), "--port", str(port), "--log-level", "warning",
               "--backend", backend]
    if args.model:
        command += ["--model", args.model]
    if args.threads:
        command += ["--threads", str(args.threads)]
    env = dict(os.environ, **({"PCED_API_KEY": args.api_key} if args.api_key else {}))
    log = open(Path(args.out) / f"server-{backend}.log", "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"load_test: the server exited with {process.returncode}; see {log.name}")
        try:
            if httpx.get(f"{url}/health", headers=auth_headers(args), timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.terminate()
    raise SystemExit(f"load_test: the server did not answer /health within {args.startup_timeout} s")


async def one_request(http: httpx.AsyncClient, question: str, stream: bool, args) -> dict:
    body = {"model": "pced", "messages": [{"role": "user", "content": question}], "max_tokens": args.max_tokens,
            "stream": stream, "pced": {"top_k": args.top_k}}
    started = time.perf_counter()
    record = {"question": question, "stream": stream, "ok": False, "ttft_s": None, "tokens": 0}
    try:
        if stream:
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                record["status"] = response.status_code
                done = False
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        record["error"] = chunk["error"].get("message")
                        break
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        record["tokens"] += 1
                        if record["ttft_s"] is None:
                            record["ttft_s"] = time.perf_counter() - started
                    if chunk.get("pced", {}).get("timings", {}).get("queue_s") is not None and chunk["choices"][0].get("finish_reason"):
                        record["queue_s"] = chunk["pced"]["timings"]["queue_s"]
                record["ok"] = response.status_code == 200 and done and "error" not in record
        else:
            response = await http.post("/v1/chat/completions", json=body)
            record["status"] = response.status_code
            if response.status_code == 200:
                out = response.json()
                record["tokens"] = out["usage"]["completion_tokens"]
                record["queue_s"] = out["choices"][0]["message"]["pced"]["timings"].get("queue_s")
                record["ok"] = bool(out["choices"][0]["message"]["content"] is not None)
            else:
                record["error"] = response.text[:200]
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
    record["latency_s"] = time.perf_counter() - started
    return record


async def client(index: int, http: httpx.AsyncClient, questions: list[str], args, progress: list[int]) -> list[dict]:
    stream = index % 2 == 0
    picked = [questions[(index + j) % len(questions)] for j in range(args.questions)]
    records = []
    for question in picked:
        records.append(await one_request(http, question, stream, args))
        progress[0] += 1
        if progress[0] % 10 == 0 or progress[0] == args.clients * args.questions:
            print(f"load_test: {progress[0]}/{args.clients * args.questions} requests done", flush=True)
    return records


async def run_load(url: str, args) -> tuple[list[dict], float]:
    headers = auth_headers(args)
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    questions = load_questions()
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=args.timeout, limits=limits) as http:
        started = time.perf_counter()
        progress = [0]
        per_client = await asyncio.gather(*(client(i, http, questions, args, progress) for i in range(args.clients)))
        wall = time.perf_counter() - started
    return [record for records in per_client for record in records], wall


def summarize(records: list[dict], wall: float, args, health: dict, backend: str) -> dict:
    ok = [r for r in records if r["ok"]]
    latency = [r["latency_s"] for r in ok]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    queue = [r["queue_s"] for r in ok if r.get("queue_s") is not None]
    tokens = sum(r["tokens"] for r in ok)

    def stats(values):
        return {"median_s": statistics.median(values) if values else None, "p95_s": percentile(values, 95) if values else None,
                "mean_s": statistics.fmean(values) if values else None, "max_s": max(values) if values else None}

    return {
        "settings": {"clients": args.clients, "questions_per_client": args.questions, "max_tokens": args.max_tokens,
                     "server_threads": args.threads,
                     "top_k": args.top_k, "store": str(args.store) if not args.url else None, "url": args.url,
                     "streaming_clients": (args.clients + 1) // 2},
        "server": {"model": health.get("model"), "documents": health.get("documents"), "backend": backend,
                   "engine": health.get("backend")},
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "requests": len(records), "errors": len(records) - len(ok),
        "error_samples": [r.get("error") or r.get("status") for r in records if not r["ok"]][:5],
        "wall_s": wall, "requests_per_s": len(ok) / wall if wall else None,
        "completion_tokens": tokens, "tokens_per_s": tokens / wall if wall else None,
        "latency": stats(latency), "ttft_streaming": stats(ttft), "server_queue": stats(queue),
    }


def markdown(summary: dict) -> str:
    def row(name, s):
        cells = [f"{s[k]:.2f}" if s[k] is not None else "-" for k in ("median_s", "p95_s", "mean_s", "max_s")]
        return f"| {name} | " + " | ".join(cells) + " |"

    s = summary["settings"]
    return "\n".join([
        f"## pced serve --backend {summary['server']['backend']}",
        "",
        f"{s['clients']} concurrent clients x {s['questions_per_client']} questions on loopback "
        f"({s['streaming_clients']} clients streaming), max_tokens {s['max_tokens']}, top_k {s['top_k']}, "
        f"server --threads {s.get('server_threads') or 'default'}; "
        f"model {summary['server']['model']}, {summary['server']['documents']} documents; "
        f"{summary['machine']['cpus']} CPUs.",
        "",
        f"Requests {summary['requests']}, errors **{summary['errors']}**, wall {summary['wall_s']:.1f} s, "
        f"{summary['requests_per_s']:.2f} requests/s, {summary['tokens_per_s']:.1f} completion tokens/s.",
        "",
        "| seconds | median | p95 | mean | max |",
        "|---|---|---|---|---|",
        row("latency (request to last byte)", summary["latency"]),
        row("time to first token (streaming)", summary["ttft_streaming"]),
        row("queue wait on the server", summary["server_queue"]),
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running pced serve (default: start one on a free port)")
    parser.add_argument("--store", default=None, help="store for the server started here (default: the demo store)")
    parser.add_argument("--model", default=None, help="--model for the server started here")
    parser.add_argument("--api-key", default=os.environ.get("PCED_API_KEY"))
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--questions", type=int, default=5, help="questions per client, asked one after another")
    from ..decoding.sampling import SamplingConfig

    parser.add_argument("--max-tokens", type=int, default=SamplingConfig.max_new_tokens)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--out", default="runs/load_test")
    parser.add_argument("--threads", type=int, default=None,
                        help="--threads for the servers started here (default: pced's own, half the cores)")
    parser.add_argument("--backend", action="append", choices=backend_names(), default=None,
                        help=f"server backend to load-test (repeatable; default {DEFAULT_BACKEND}); ignored with --url")
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    backends = args.backend or [DEFAULT_BACKEND]
    if args.url is None:
        if args.store is None:
            from pced import __version__
            from pced.llm import cache_root

            args.store = cache_root() / f"demo-store-{__version__}"
        if not (Path(args.store) / "manifest.json").is_file():
            raise SystemExit(f"load_test: no store at {args.store} (run `pced demo` once, or pass --store / --url)")
    else:
        backends = ["(given url)"]
    results = []
    for backend in backends:
        process = None
        if args.url is None:
            process, url = start_server(args, backend)
        else:
            url = args.url.rstrip("/")
        try:
            health = httpx.get(f"{url}/health", headers=auth_headers(args), timeout=10).json()
            print(f"load_test: {args.clients} clients x {args.questions} questions against {url} "
                  f"({health.get('model')}, backend {backend}) ...", flush=True)
            records, wall = asyncio.run(run_load(url, args))
            health = httpx.get(f"{url}/health", headers=auth_headers(args), timeout=10).json()  # the engine's counters after the load
        finally:
            if process is not None:
                process.terminate()
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
        summary = summarize(records, wall, args, health, backend)
        print(markdown(summary), flush=True)
        results.append({"summary": summary, "requests": records})
    out = Path(args.out)
    text = "# pced serve load test\n\n" + "\n".join(markdown(r["summary"]) for r in results)
    if len(results) > 1:
        base = results[0]["summary"]["requests_per_s"]
        text += "\n## Requests/s against " + results[0]["summary"]["server"]["backend"] + "\n\n"
        text += "\n".join(f"- {r['summary']['server']['backend']}: {r['summary']['requests_per_s']:.2f} requests/s "
                          f"({r['summary']['requests_per_s'] / base:.2f}x), errors {r['summary']['errors']}"
                          for r in results) + "\n"
    (out / "results.json").write_text(json.dumps({"runs": results}, indent=2) + "\n")
    (out / "results.md").write_text(text)
    print(f"load_test: saved {out / 'results.json'} and {out / 'results.md'}")
    return 0 if all(r["summary"]["errors"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
