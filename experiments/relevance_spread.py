"""How spread out the relevance priors are, per retriever: what gamma actually weighs.

PCED adds ``gamma * log r_k`` to expert k's scores, so gamma's effect is set by how far apart the
log r of one question's candidates lie. For the candidate lists of a finished ``pced eval`` run
(results.jsonl ``experts``), this recomputes r for the same documents with each retriever of
the run's store (Appendix B normalizations) and reports, over questions, the median range
(best minus worst log r) and standard deviation of log r, and the share of candidates clipped
at r = 1e-8 (a BM25 score of 0: no query term in the document). It also reports the gate each
prior puts between a question's best and worst candidate (``--gammas``): gamma x the log r range
under the paper's log prior, gamma x range / std under ``--prior standardized``, as the median
and the 10th-90th percentiles over questions: how much one gamma means across retrievers and
questions.

    python experiments/relevance_spread.py runs/eval/hotpotqa runs/stores/hotpotqa-distractor-SmolLM2-135M-Instruct-rag
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from pced.retrieval.scores import EPS


def gates(ranges: list[float], stds: list[float], gammas: list[float]) -> dict:
    """Best-to-worst gate (logits) of each prior and gamma: median [p10, p90] over questions."""
    from pced.decoding.rule import SPREAD_FLOOR

    out = {}
    for prior in ("log", "standardized"):
        for gamma in gammas:
            values = [gamma * (r if prior == "log" else r / max(s, SPREAD_FLOOR)) for r, s in zip(ranges, stds)]
            out[f"{prior} gamma={gamma:g}"] = [round(float(np.percentile(values, q)), 2) for q in (50, 10, 90)]
    return out


def spread(store, records: list[dict], retriever: str, gammas: list[float]) -> dict:
    position = {doc.id: row for row, doc in enumerate(store.documents)}
    r = store.retriever(retriever)
    ranges, stds, clipped, n = [], [], 0, 0
    for record in records:
        rows = [position[e["doc_id"]] for e in record["experts"] if e["doc_id"] in position]
        if len(rows) < 2:
            continue
        raw = np.asarray(r.scores(record["question"]), dtype=np.float64)[rows]
        rel = np.asarray(r.normalize(raw), dtype=np.float64)
        logs = np.log(rel)
        ranges.append(float(logs.max() - logs.min()))
        stds.append(float(logs.std()))
        clipped += int((rel <= EPS * 1.0001).sum())
        n += len(rows)
    return {"questions": len(ranges), "median_log_r_range": round(statistics.median(ranges), 4),
            "p90_log_r_range": round(float(np.percentile(ranges, 90)), 4),
            "median_log_r_std": round(statistics.median(stds), 4),
            "clipped_share": round(clipped / max(n, 1), 4), "gate_median_p10_p90": gates(ranges, stds, gammas)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a pced eval output folder (results.jsonl)")
    parser.add_argument("store", help="the store that run used")
    parser.add_argument("--retrievers", default="hybrid,sparse,dense")
    parser.add_argument("--k", type=int, default=None, help="only records with this top-k (default: the most common)")
    parser.add_argument("--gammas", default="1,2.5,32", help="gammas for the gate table")
    args = parser.parse_args()

    from pced.evaluation.datasets import load_dataset
    from pced.store import DocumentStore

    run = Path(args.run)
    meta = json.loads((run / "run.json").read_text())
    records = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines() if line.strip()]
    records = [r for r in records if r["method"] == "pced"]
    ks = [r["settings"]["top_k"] for r in records]
    k = args.k or max(set(ks), key=ks.count)
    questions = {e.id: e.question for e in load_dataset(meta["dataset"], setting=meta["setting"]).examples}
    first = {}
    for r in records:
        if r["settings"]["top_k"] == k and r["example_id"] not in first:
            first[r["example_id"]] = {**r, "question": questions[r["example_id"]]}
    store = DocumentStore.open(args.store)
    out = {"dataset": meta["dataset"], "setting": meta["setting"], "top_k": k,
           "retrievers": {name: spread(store, list(first.values()), name, [float(g) for g in args.gammas.split(",")])
                          for name in args.retrievers.split(",")}}
    print(json.dumps(out, indent=2))
    (run / "relevance_spread.json").write_text(json.dumps(out, indent=2) + "\n")
    names = list(next(iter(out["retrievers"].values()))["gate_median_p10_p90"])
    lines = [f"### {meta['dataset']} ({meta['setting']}), top {k}: spread of log r and the best-to-worst gate", "",
             "Gate = logits between a question's best and worst candidate: median [10th, 90th percentile] over "
             "questions.", "",
             "| retriever | median log r range | median std | clipped | " + " | ".join(names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    for name, row in out["retrievers"].items():
        cells = [f"{v[0]:g} [{v[1]:g}, {v[2]:g}]" for v in row["gate_median_p10_p90"].values()]
        lines.append(f"| {name} | {row['median_log_r_range']} | {row['median_log_r_std']} | {row['clipped_share']} | "
                     + " | ".join(cells) + " |")
    (run / "relevance_spread.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
