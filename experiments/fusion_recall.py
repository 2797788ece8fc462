"""Hybrid fusions by gold recall, on the candidates ``pced eval`` would give PCED.

For each dataset (its eval store under runs/stores, built by ``pced eval`` if missing) and each
hybrid fusion (``hybrid`` = the paper's harmonic mean, ``hybrid-mean``, ``hybrid-rrf``), on the first
``--limit`` questions: the mean fraction of gold documents in the top-k, the share of questions
with every gold document in the top-k, and the expert slots "vetoed" by the fusion: candidates in
the top-k whose relevance is below 1e-6 (with the log prior they can never win a token), with how
many of those are gold. No language model runs: retrieval only.

    python experiments/fusion_recall.py --dataset hotpotqa --dataset musique [--setting distractor] [--limit 100]

Writes runs/fusion_recall/<dataset>-<setting>.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tqdm.auto import tqdm

from pced.evaluation.config import EvalConfig
from pced.evaluation.datasets import load_dataset
from pced.evaluation.sources import CandidateSource, model_setting_of, prepare_store
from pced.fs import atomic_write_json, atomic_write_text
from pced.llm import load_model

FUSIONS = ("hybrid", "hybrid-mean", "hybrid-rrf")
VETO = 1e-6


def document_id(candidate) -> str:
    """The example's document id of a candidate (a long document's chunk "id#3" counts as "id")."""
    base, _, number = candidate.document.id.rpartition("#")
    return base if base and number.isdigit() else candidate.document.id


def measure(source: CandidateSource, examples, ks: list[int]) -> dict:
    rows = {f"recall@{k}": [] for k in ks} | {f"all_gold@{k}": [] for k in ks}
    vetoed, vetoed_gold = [], []
    for example in tqdm(examples, desc=source.config.retriever, unit="question"):
        ranked = source.candidates(example, [max(ks)])[(max(ks), None)]
        gold = set(example.gold_doc_ids)
        if not gold:
            continue
        ids = [document_id(c) for c in ranked]
        for k in ks:
            found = len(gold & set(ids[:k]))
            rows[f"recall@{k}"].append(found / len(gold))
            rows[f"all_gold@{k}"].append(float(found == len(gold)))
        low = [c for c in ranked if c.relevance < VETO]
        vetoed.append(len(low))
        vetoed_gold.append(sum(document_id(c) in gold for c in low))
    out = {name: sum(values) / max(1, len(values)) for name, values in rows.items()}
    out.update(questions=len(vetoed), vetoed_slots=sum(vetoed) / max(1, len(vetoed)),
               vetoed_gold=sum(vetoed_gold), questions_with_vetoed_gold=sum(1 for v in vetoed_gold if v))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", action="append", required=True)
    parser.add_argument("--setting", default=None, help="distractor or corpus (default: the dataset's own)")
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--ks", default="2,4,8")
    parser.add_argument("--out", default="runs/fusion_recall")
    args = parser.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    llm = load_model(device="cpu", dtype="float32")
    out = Path(args.out)
    for name in args.dataset:
        dataset = load_dataset(name, setting=args.setting, limit=args.limit)
        base = EvalConfig(dataset=name, setting=args.setting, limit=args.limit, top_k=(max(ks),), progress=True)
        store = prepare_store(base, dataset, llm, model_setting_of(base, llm))
        results = {}
        for fusion in FUSIONS:
            config = EvalConfig(**{**base.__dict__, "retriever": fusion})
            results[fusion] = measure(CandidateSource(dataset, store, config), dataset.examples, ks)
        label = f"{dataset.name}-{dataset.setting or 'default'}"
        lines = [f"### {label}: {args.limit} questions, gold documents in the hybrid's top-k by fusion", "",
                 "| fusion | " + " | ".join(f"recall@{k}" for k in ks) + " | " + " | ".join(f"all gold@{k}" for k in ks)
                 + f" | slots with r < {VETO:g} (of {max(ks)}) | gold among them (questions) |",
                 "|---|" + "---|" * (2 * len(ks) + 2)]
        for fusion, r in results.items():
            lines.append(f"| {fusion} | " + " | ".join(f"{r[f'recall@{k}']:.3f}" for k in ks) + " | "
                         + " | ".join(f"{r[f'all_gold@{k}']:.2f}" for k in ks)
                         + f" | {r['vetoed_slots']:.2f} | {r['vetoed_gold']} ({r['questions_with_vetoed_gold']}) |")
        text = "\n".join(lines) + "\n"
        print(text)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / f"{label}.json", {"dataset": dataset.name, "setting": dataset.setting,
                                                  "limit": args.limit, "results": results})
        atomic_write_text(out / f"{label}.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
