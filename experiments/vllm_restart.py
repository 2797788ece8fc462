"""The first question after ``pced serve --backend vllm`` says it is ready, against the questions
after it: its time to first token over the median of the next ``--warm`` ones, per start, with the
server's warm start (the default) and without it (``--no-warm-start``), the two alternating.

    python experiments/vllm_restart.py --out runs/vllm-restart [--k 8] [--doc-tokens 448] [--restarts 3] [--warm 10]

Builds a store (``pced index``, once) of ``1 + --warm`` sets of k secret-code documents of exactly
``--doc-tokens`` tokens, each set under a title word of its own. Each question names its set's word
and retrieves exactly that set (the sparse retriever, top-k = k), so every question of a start reads
documents no earlier question of that start read: the first from the store's files like the others,
and never a prefix-cache hit for its first token; a restarted server's prefix cache is empty, and
every question's wording is new. Per start: the server's start, the first question's TTFT, the
median TTFT of the next ``--warm``, their ratio, and the prompt tokens vLLM computed and read from
the store (from ``/health`` before and after each question). Per arm: the median ratio over its
starts. Saves restart.json, restart.md and restart.png under ``--out``.
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

ARMS = {"warm start": [], "no warm start": ["--no-warm-start"]}


def tag(index: int) -> str:
    """A made-up title word per set (the sparse retriever's tokens are lower-case words)."""
    return "ledger" + "".join(chr(97 + (index // 26 ** i) % 26) for i in range(3))


def build_store(out: Path, k: int, sets: int, doc_tokens: int, seed: int) -> tuple[Path, list[tuple[str, list[str]]]]:
    from pced.evaluation.secret_code import make_secret_code
    from pced.llm import load_model

    store = out / "store"
    dataset = make_secret_code(load_model().tokenizer, n_docs=k, doc_tokens=doc_tokens, seed=seed, n_examples=sets)
    groups = [(tag(i), sorted(d.id for d in example.documents)) for i, example in enumerate(dataset.examples)]
    if not (store / "manifest.json").is_file():
        corpus = out / "corpus.jsonl"
        corpus.write_text("".join(json.dumps({"id": d.id, "title": tag(i), "text": d.text}) + "\n"
                                  for i, example in enumerate(dataset.examples) for d in example.documents))
        subprocess.run([sys.executable, "-m", "pced.cli", "index", str(corpus), "--out", str(store)], check=True)
    return store, groups


def serve(store: Path, port: int, kv_cache_gb: float, log: Path, extra: list[str]) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "pced.cli", "serve", str(store), "--backend", "vllm",
                                "--port", str(port), "--kv-cache-gb", str(kv_cache_gb), "--log-level", "warning", *extra],
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
            time.sleep(0.5)


def ask(url: str, question: str, k: int, new_tokens: int) -> dict:
    before = httpx.get(f"{url}/health").json()["backend"]
    reply = httpx.post(f"{url}/v1/pced/answer", timeout=1200, json={
        "question": question, "top_k": k, "top_n": k, "rerank": False, "retriever": "sparse", "max_tokens": new_tokens})
    reply.raise_for_status()
    body = reply.json()
    after = httpx.get(f"{url}/health").json()["backend"]
    return {"question": question, "ttft_s": body["timings"]["ttft_s"], "total_s": body["timings"]["total_s"],
            "experts": sorted(e["doc_id"] for e in body["experts"]),
            **{key: after[key] - before[key] for key in ("prompt_tokens", "prefilled_tokens", "store_tokens")}}


def one_start(arm: str, store: Path, groups: list, args, number: int, log: Path) -> tuple[dict, int]:
    started = time.perf_counter()
    process = serve(store, args.port, args.kv_cache_gb, log, ARMS[arm])
    start_s = time.perf_counter() - started
    url = f"http://127.0.0.1:{args.port}"
    try:
        answers = []
        for word, ids in groups[: 1 + args.warm]:
            number += 1
            answer = ask(url, f"({number}) What does the {word} record say?", args.k, args.new_tokens)
            answer["own_documents"] = answer["experts"] == ids
            answers.append(answer)
    finally:
        process.terminate()
        process.wait(timeout=120)
    after = statistics.median(a["ttft_s"] for a in answers[1:])
    return {"arm": arm, "start_s": start_s, "first": answers[0], "after": answers[1:],
            "median_after_ttft_s": after, "ratio": answers[0]["ttft_s"] / after}, number


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/vllm-restart")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--doc-tokens", type=int, default=448)
    parser.add_argument("--restarts", type=int, default=3, help="starts per arm")
    parser.add_argument("--warm", type=int, default=10, help="questions after the first, per start")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--kv-cache-gb", type=float, default=0.5)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of: {', '.join(ARMS)}")
    parser.add_argument("--port", type=int, default=8417)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    arms = [a.strip() for a in args.arms.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store, groups = build_store(out, args.k, 1 + args.warm, args.doc_tokens, args.seed)
    number, starts = 0, []
    for restart in range(args.restarts):
        for arm in arms:  # alternating, so that a slower stretch of the machine falls on both arms
            start, number = one_start(arm, store, groups, args, number, out / f"server-{arm.replace(' ', '-')}-{restart}.log")
            starts.append(start)
            print(json.dumps({key: start[key] for key in ("arm", "start_s", "median_after_ttft_s", "ratio")}
                             | {"first_ttft_s": start["first"]["ttft_s"]}), flush=True)
    summary = {"k": args.k, "doc_tokens": args.doc_tokens, "kv_cache_gb": args.kv_cache_gb, "warm": args.warm,
               "new_tokens": args.new_tokens, "cpu_count": os.cpu_count(),
               "own_documents": all(a["own_documents"] for s in starts for a in [s["first"], *s["after"]]),
               "arms": {arm: {"median_ratio": statistics.median(s["ratio"] for s in starts if s["arm"] == arm),
                              "ratios": [s["ratio"] for s in starts if s["arm"] == arm]} for arm in arms},
               "starts": starts}
    (out / "restart.json").write_text(json.dumps(summary, indent=1))
    lines = ["# The first question after `pced serve --backend vllm` is ready, against the next ones", "",
             f"{os.cpu_count()} CPUs (shared); k = {args.k} documents of {args.doc_tokens} tokens per question, each "
             f"question its own documents (read from the store: none in vLLM's prefix cache) and its own wording; KV "
             f"cache {args.kv_cache_gb:g} GiB; {args.new_tokens} new tokens. Ratio: the first question's time to first "
             f"token over the median of the next {args.warm}. Every question read its own documents: "
             f"{summary['own_documents']}.", ""]
    lines += [f"- **{arm}**: median ratio over {len(v['ratios'])} starts **{v['median_ratio']:.2f}x** "
              f"({', '.join(f'{r:.2f}' for r in v['ratios'])})" for arm, v in summary["arms"].items()]
    lines += ["", "| start | arm | server start s | first TTFT s | median TTFT of the next s | ratio | first: computed / "
              "from the store |", "|---|---|---|---|---|---|---|"]
    for index, s in enumerate(starts):
        lines.append(f"| {index // len(arms) + 1} | {s['arm']} | {s['start_s']:.0f} | {s['first']['ttft_s']:.3f} | "
                     f"{s['median_after_ttft_s']:.3f} | {s['ratio']:.2f} | {s['first']['prefilled_tokens']} / "
                     f"{s['first']['store_tokens']} |")
    (out / "restart.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    styles = dict(zip(ARMS, ("-o", "--x")))
    for index, s in enumerate(starts):
        ttfts = [s["first"]["ttft_s"]] + [a["ttft_s"] for a in s["after"]]
        ax.plot(range(len(ttfts)), ttfts, styles.get(s["arm"], "-"), color=f"C{index // len(arms)}", alpha=0.8,
                label=f"start {index // len(arms) + 1}, {s['arm']}")
    ax.set(xlabel="question after the server is ready (0: the first)", ylabel="TTFT s", yscale="log",
           title=f"first question after a start, k={args.k}", xticks=list(range(1 + args.warm)))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "restart.png", dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
