"""Would batching several questions' rows into one llama_decode pay on llama.cpp?

One PCED question at k experts is k + 1 rows per decode step. This times a decode step of
Q * (k + 1) rows (Q questions batched) against Q steps of k + 1 rows (answered in turn), on the
embedded GGUF, rows holding ``--doc-tokens`` cells each (random tokens: speed does not depend on
them). Prints and saves JSON + Markdown (medians of ``--repeats`` steps).

    python experiments/llamacpp_batching.py --out runs/llamacpp-batching
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--questions", default="1,2,4")
    parser.add_argument("--doc-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="runs/llamacpp-batching")
    args = parser.parse_args()
    from pced.backends.llamacpp.model import LlamaModel
    from pced.backends.llamacpp.settings import LlamaSettings

    llm = LlamaModel(None, LlamaSettings(threads=args.threads))
    counts = [int(q) for q in args.questions.split(",")]
    rows = (args.k + 1) * max(counts)
    row_cells = args.doc_tokens + 2 * args.repeats * len(counts) + 8  # every count steps a row twice per repeat at most
    ctx = llm.context(rows * row_cells, rows, seq_cells=row_cells)
    generator = torch.Generator().manual_seed(0)
    for seq in range(rows):  # each row's context: doc_tokens random tokens
        ids = torch.randint(100, llm.n_vocab - 100, (args.doc_tokens,), generator=generator).tolist()
        ctx.decode(ids, range(args.doc_tokens), [seq] * args.doc_tokens, [False] * args.doc_tokens)
    position = [args.doc_tokens] * rows
    results = {"k": args.k, "doc_tokens": args.doc_tokens, "threads": llm.threads, "repeats": args.repeats, "rows": []}

    def step(seqs: list[int]) -> float:
        started = time.perf_counter()
        ctx.decode([42] * len(seqs), [position[s] for s in seqs], seqs, [True] * len(seqs))
        for s in seqs:
            position[s] += 1
        return time.perf_counter() - started

    for q in counts:
        batched = statistics.median(step(list(range(q * (args.k + 1)))) for _ in range(args.repeats))
        # in turn: question i's rows alone, one after another
        in_turn = statistics.median(sum(step(list(range(i * (args.k + 1), (i + 1) * (args.k + 1)))) for i in range(q))
                                    for _ in range(args.repeats))
        results["rows"].append({"questions": q, "rows_per_step": q * (args.k + 1), "batched_step_s": batched,
                                "in_turn_s": in_turn, "speedup": in_turn / batched})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "batching.json").write_text(json.dumps(results, indent=2))
    lines = [f"k = {args.k}, {args.doc_tokens} cells per row, {llm.threads} threads, medians of {args.repeats}", "",
             "| questions | rows | one batched step ms | steps in turn ms | speed-up |", "|---|---|---|---|---|"]
    for r in results["rows"]:
        lines.append(f"| {r['questions']} | {r['rows_per_step']} | {r['batched_step_s'] * 1000:.1f} | "
                     f"{r['in_turn_s'] * 1000:.1f} | {r['speedup']:.2f}x |")
    (out / "batching.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
