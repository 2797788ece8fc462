"""Recall of the gold HotpotQA paragraphs for the embedded retrievers (BM25, MiniLM, hybrid).

Corpus-wide setting: all 994 paragraphs of the 100 training questions form one corpus; each
question's two supporting paragraphs (named by title in ``supporting_facts``) are the gold.
Reports, per retriever and k, the mean fraction of gold titles in the top-k and the fraction of
questions with all gold found. Prints a Markdown table, writes ``recall.json`` / ``recall.md``.

    python experiments/retrieval_recall.py [--data DIR] [--out runs/retrieval_recall] [--k 8 90]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from pced.documents import Document
from pced.retrieval import BM25Retriever, DenseRetriever, HybridRetriever

REPO_ROOT = Path(__file__).resolve().parents[1]


def default_data_dir() -> Path:
    """``$PCED_DATA_DIR`` if set, else ``<repo>/../shared/data``."""
    return Path(os.environ.get("PCED_DATA_DIR") or REPO_ROOT.parent / "shared" / "data")


def load_hotpotqa(data_dir: Path) -> tuple[list[Document], list[dict[str, Any]]]:
    """Documents (id = title; sentences joined as written, they carry their own leading spaces)
    and the questions with their gold titles."""
    folder = data_dir / "hotpotqa"
    corpus = json.loads((folder / "hotpotqa_train_corpus.json").read_text(encoding="utf-8"))
    documents = [Document(id=title, text="".join(sents).strip(), title=title)
                 for title, sents in corpus.items()]
    raw = json.loads((folder / "hotpotqa_train_100.json").read_text(encoding="utf-8"))
    questions = [{"id": q["_id"], "question": q["question"],
                  "gold": sorted({title for title, _ in q["supporting_facts"]})} for q in raw]
    return documents, questions


def recall_at(ranked_ids: list[list[str]], questions: list[dict[str, Any]], k: int) -> dict[str, float]:
    """Mean fraction of gold ids in the top-k, and fraction of questions with all gold there."""
    fractions, complete = [], []
    for ids, q in zip(ranked_ids, questions, strict=True):
        found = len(set(q["gold"]) & set(ids[:k]))
        fractions.append(found / len(q["gold"]))
        complete.append(found == len(q["gold"]))
    return {"recall": sum(fractions) / len(fractions), "all_gold": sum(complete) / len(complete)}


def evaluate(retriever: Any, questions: list[dict[str, Any]], ks: list[int]) -> dict[str, Any]:
    start = time.perf_counter()
    hits = retriever.search_many([q["question"] for q in questions], top_n=max(ks))
    search_s = time.perf_counter() - start
    ranked = [[h.doc_id for h in row] for row in hits]
    return {"k": {str(k): recall_at(ranked, questions, k) for k in ks}, "search_s": search_s}


def markdown_table(results: dict[str, Any], ks: list[int]) -> str:
    columns = " | ".join(f"recall@{k} | all gold@{k}" for k in ks)
    header = f"| retriever | {columns} | index s | search s |"
    rule = "|---|" + "---|---|" * len(ks) + "---|---|"
    rows = []
    for name, res in results.items():
        at = res["k"]
        cells = " | ".join(f"{at[str(k)]['recall']:.3f} | {at[str(k)]['all_gold']:.3f}" for k in ks)
        rows.append(f"| {name} | {cells} | {res['index_s']:.1f} | {res['search_s']:.1f} |")
    return "\n".join([header, rule, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=None,
                        help="data dir (default $PCED_DATA_DIR or ../shared/data)")
    parser.add_argument("--out", type=Path, default=Path("runs/retrieval_recall"))
    parser.add_argument("--k", type=int, nargs="+", default=[8, 90])
    args = parser.parse_args(argv)
    data_dir = args.data or default_data_dir()
    if not (data_dir / "hotpotqa").is_dir():
        print(f"error: no hotpotqa data under {data_dir}", file=sys.stderr)
        return 2
    documents, questions = load_hotpotqa(data_dir)

    sparse, dense = BM25Retriever(), DenseRetriever()
    results: dict[str, Any] = {}
    for name, retriever in [("sparse (bm25)", sparse), ("dense (minilm)", dense)]:
        start = time.perf_counter()
        retriever.index(documents)
        index_s = time.perf_counter() - start
        results[name] = {**evaluate(retriever, questions, args.k), "index_s": index_s}
    hybrid = HybridRetriever(sparse, dense)  # reuses both indexes: no re-encoding
    results["hybrid (bm25+minilm)"] = {**evaluate(hybrid, questions, args.k),
                                       "index_s": results["sparse (bm25)"]["index_s"]
                                       + results["dense (minilm)"]["index_s"]}

    table = markdown_table(results, args.k)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"dataset": "hotpotqa_train_100 (corpus: hotpotqa_train_corpus, 994 passages)",
               "questions": len(questions), "documents": len(documents), "ks": args.k,
               "results": results,
               "retrievers": {"sparse": sparse.describe(), "dense": dense.describe()}}
    (args.out / "recall.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    (args.out / "recall.md").write_text(
        f"# Gold-paragraph recall on HotpotQA ({len(questions)} questions, {len(documents)} passages)\n\n"
        + table + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
