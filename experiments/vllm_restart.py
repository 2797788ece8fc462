"""A restarted ``pced serve --backend vllm`` needs no warm-up: its first answer reads the documents'
KV from the store (pced's connector), and its time to first token is set beside a warm answer's
(a new question over the same documents, now in vLLM's prefix cache), on the same server.

    python experiments/vllm_restart.py --out runs/vllm-restart [--k 16] [--doc-tokens 448] [--restarts 3]

Builds a store of k secret-code documents of exactly ``--doc-tokens`` tokens (``pced index``, once),
so that every question retrieves all of them (top-k = k). Then ``--restarts`` times: starts the
server (``--kv-cache-gb``), asks a question never asked (the first answer after the start), then
``--warm`` more new questions, and stops it. Per question: time to first token (the answer's
``timings.ttft_s``), and from ``/health`` before and after it, the prompt tokens vLLM computed and
read from the store. Saves restart.json, restart.md and restart.png under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def build_store(out: Path, k: int, doc_tokens: int, seed: int) -> tuple[Path, str]:
    from pced.evaluation.secret_code import make_secret_code
    from pced.llm import load_model

    store = out / "store"
    dataset = make_secret_code(load_model().tokenizer, n_docs=k, doc_tokens=doc_tokens, seed=seed)
    example = dataset.examples[0]
    if not (store / "manifest.json").is_file():
        corpus = out / "corpus.jsonl"
        corpus.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in example.documents))
        subprocess.run([sys.executable, "-m", "pced.cli", "index", str(corpus), "--out", str(store)], check=True)
    return store, example.question


def serve(store: Path, port: int, kv_cache_gb: float, log: Path) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "pced.cli", "serve", str(store), "--backend", "vllm",
                                "--port", str(port), "--kv-cache-gb", str(kv_cache_gb), "--log-level", "warning"],
                               stdout=open(log, "w"), stderr=subprocess.STDOUT, env={**os.environ, "PCED_API_KEY": ""})
    deadline = time.monotonic() + 1200
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"pced serve exited: {log.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError("pced serve did not start in 20 minutes")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(1)


def ask(url: str, question: str, k: int, new_tokens: int) -> dict:
    before = httpx.get(f"{url}/health").json()["backend"]
    reply = httpx.post(f"{url}/v1/pced/answer", timeout=1200, json={
        "question": question, "top_k": k, "top_n": k, "rerank": False, "max_tokens": new_tokens})
    reply.raise_for_status()
    body = reply.json()
    after = httpx.get(f"{url}/health").json()["backend"]
    return {"question": question, "ttft_s": body["timings"]["ttft_s"], "total_s": body["timings"]["total_s"],
            "experts": sorted(e["doc_id"] for e in body["experts"]), "answer": body["answer"],
            **{key: after[key] - before[key] for key in ("prompt_tokens", "prefilled_tokens", "store_tokens")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/vllm-restart")
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--doc-tokens", type=int, default=448)
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--warm", type=int, default=2, help="new questions after the first, per start")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--kv-cache-gb", type=float, default=0.5)
    parser.add_argument("--port", type=int, default=8417)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store, question = build_store(out, args.k, args.doc_tokens, args.seed)
    number, starts = 0, []
    for restart in range(args.restarts):
        started = time.perf_counter()
        process = serve(store, args.port, args.kv_cache_gb, out / f"server-{restart}.log")
        start_s = time.perf_counter() - started
        url = f"http://127.0.0.1:{args.port}"
        try:
            answers = []
            for _ in range(1 + args.warm):
                number += 1
                answers.append(ask(url, f"({number}) {question}", args.k, args.new_tokens))
        finally:
            process.terminate()
            process.wait(timeout=60)
        starts.append({"start_s": start_s, "first": answers[0], "warm": answers[1:]})
        print(json.dumps(starts[-1]), flush=True)
    first = [s["first"]["ttft_s"] for s in starts]
    warm = [w["ttft_s"] for s in starts for w in s["warm"]]
    summary = {"k": args.k, "doc_tokens": args.doc_tokens, "kv_cache_gb": args.kv_cache_gb, "cpu_count": os.cpu_count(),
               "median_first_ttft_s": statistics.median(first), "median_warm_ttft_s": statistics.median(warm),
               "first_over_warm": statistics.median(first) / statistics.median(warm),
               "same_documents": all(w["experts"] == s["first"]["experts"] for s in starts for w in s["warm"]),
               "starts": starts}
    (out / "restart.json").write_text(json.dumps(summary, indent=1))
    lines = [f"# A restarted `pced serve --backend vllm`: first answer against warm ones", "",
             f"{os.cpu_count()} CPUs (shared); k = {args.k} documents of {args.doc_tokens} tokens; KV cache "
             f"{args.kv_cache_gb:g} GiB; {args.new_tokens} new tokens; every question new; no warm-up. Median time to "
             f"first token: first answer after a start {summary['median_first_ttft_s']:.3f} s, warm "
             f"{summary['median_warm_ttft_s']:.3f} s: **{summary['first_over_warm']:.2f}x**. Same documents in every "
             f"answer: {summary['same_documents']}.", "",
             "| start | server start s | answer | TTFT s | prompt tokens | computed | from the store |",
             "|---|---|---|---|---|---|---|"]
    for index, start in enumerate(starts):
        for name, row in [("first", start["first"])] + [(f"warm {i + 1}", w) for i, w in enumerate(start["warm"])]:
            lines.append(f"| {index + 1} | {start['start_s']:.0f} | {name} | {row['ttft_s']:.3f} | {row['prompt_tokens']} | "
                         f"{row['prefilled_tokens']} | {row['store_tokens']} |")
    (out / "restart.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for index, start in enumerate(starts):
        ax.plot([0] + list(range(1, 1 + len(start["warm"]))), [start["first"]["ttft_s"]] + [w["ttft_s"] for w in start["warm"]],
                "-o", label=f"start {index + 1}")
    ax.set(xlabel="answer after the start (0: the first, documents from the store)", ylabel="TTFT s",
           title=f"restarted server, k={args.k}", xticks=list(range(1 + args.warm)))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "restart.png", dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
