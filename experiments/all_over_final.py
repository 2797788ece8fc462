"""All (concatenation) over the documents PCED finally read, when experts joined mid-answer.

A PCED run with ``--follow ...join`` reads the question's top-k plus the documents that joined.
Is its answer better because of *how* it reads (isolated experts, the rule) or because it got to
read more? This script answers the second part: for every question of an eval run where documents
joined, it asks All over exactly that final set (the question's top-k in their order, then the
joined ones in the order they joined), with the run's model, template, store and new-token
budget, and compares three scores on the same questions:

- PCED with joins (from the run), All over the question's top-k (from the run, ``--all-config``),
  All over PCED's final set (computed here; on questions without joins it is All over the top-k).

    python experiments/all_over_final.py runs/eval/hotpotqa-corpus [--join-config KEY] [--all-config KEY]

Writes ``all_final.jsonl`` (resumable), ``all_final.md`` and ``all_final.json`` into the run folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm.auto import tqdm

from pced.decoding.sampling import SamplingConfig
from pced.documents import Candidate
from pced.evaluation.compare import format_comparison, paired_comparison
from pced.evaluation.config import EvalConfig
from pced.evaluation.datasets import load_dataset, score_example
from pced.evaluation.sources import model_setting_of, prepare_store
from pced.fs import atomic_write_json, atomic_write_text
from pced.llm import load_model
from pced.options import AskOptions
from pced.pipeline import ask_candidates


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pick(records: list[dict], wanted: str | None, test) -> str:
    keys = sorted({r["config"] for r in records if test(r)})
    if wanted:
        if wanted not in keys:
            raise SystemExit(f"no config {wanted!r} in the run; it has: {', '.join(keys)}")
        return wanted
    if len(keys) != 1:
        raise SystemExit(f"say which config to use; candidates: {', '.join(keys) or 'none'}")
    return keys[0]


def gold_recall(records: list[dict]) -> dict:
    """How joining changed which gold documents PCED read: per question, the gold ids among the
    question's experts and among the experts plus the joined ones."""
    out = {"gold": 0, "gold_in_top_k": 0, "gold_in_final": 0, "missing": 0, "joined": 0, "joins": 0}
    for record in records:
        gold = set(record.get("gold_doc_ids") or [])
        top_k = {e["doc_id"] for e in record["experts"]}
        came = {e["doc_id"] for e in record.get("joined") or []}
        out["gold"] += len(gold)
        out["gold_in_top_k"] += len(gold & top_k)
        out["gold_in_final"] += len(gold & (top_k | came))
        out["joins"] += len(came)
        if gold - top_k:
            out["missing"] += 1
            out["joined"] += bool((gold - top_k) & came)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a pced eval output folder")
    parser.add_argument("--join-config", default=None, help="the PCED config with joins (default: the only one)")
    parser.add_argument("--all-config", default=None, help="All over the question's top-k (default: the only one)")
    args = parser.parse_args(argv)
    run = json.loads((args.run / "run.json").read_text())
    records = read_records(args.run / "results.jsonl")
    join_key = pick(records, args.join_config, lambda r: "join" in r["config"])
    all_key = pick(records, args.all_config, lambda r: r["method"] == "all")
    joined = {r["example_id"]: r for r in records if r["config"] == join_key}
    all_top_k = {r["example_id"]: r for r in records if r["config"] == all_key}
    # the run's examples: its first N (every example of the run answered this config)
    dataset = load_dataset(run["dataset"], setting=run.get("setting"), limit=len(joined), seed=run.get("seed", 42))
    examples = {e.id: e for e in dataset.examples if e.id in joined}
    config = EvalConfig(dataset=run["dataset"], setting=run.get("setting"), storage_dtype=run.get("storage_dtype", "float16"),
                        max_doc_tokens=run.get("max_doc_tokens", 1024), reranker=run.get("reranker"))
    llm = load_model(device="cpu", dtype="float32")
    store = prepare_store(config, dataset, llm, model_setting_of(config, llm))
    by_id = {d.id: d for d in store.documents}
    out_path = args.run / "all_final.jsonl"
    done = {r["example_id"]: r for r in read_records(out_path)} if out_path.is_file() else {}
    todo = [i for i in joined if joined[i].get("joined") and i not in done and i in examples]
    sampling = SamplingConfig(max_new_tokens=run["max_new_tokens"], seed=run.get("seed"))
    with open(out_path, "a", encoding="utf-8") as handle:
        for example_id in tqdm(todo, desc="all over the final set", unit="answer"):
            record, example = joined[example_id], examples[example_id]
            ids = [e["doc_id"] for e in record["experts"]] + [e["doc_id"] for e in record["joined"]]
            relevance = {e["doc_id"]: e["relevance"] for e in record["experts"] + record["joined"]}
            candidates = [Candidate(by_id[i], relevance[i]) for i in ids]
            try:
                answer = ask_candidates(store.generator, candidates, example.question,
                                        AskOptions(method="all", sampling=sampling)).answer()
                prediction, score = answer.text, score_example(run["metric"], answer.text, example)
            except ValueError as exc:  # past the model's window
                prediction, score = "", 0.0
                print(f"{example_id}: {str(exc).splitlines()[0]}", file=sys.stderr)
            row = {"example_id": example_id, "documents": ids, "prediction": prediction, "score": score}
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
            handle.flush()
            done[example_id] = row
    common = [i for i in joined if i in all_top_k]
    final = {i: (done[i]["score"] if i in done else all_top_k[i]["score"]) for i in common}
    scores = {"PCED with joins": [joined[i]["score"] for i in common],
              "All, question's top-k": [all_top_k[i]["score"] for i in common],
              "All, PCED's final set": [final[i] for i in common]}
    for key in sorted({r["config"] for r in records} - {join_key, all_key}):  # Single, PCED without joins, ...
        answered = {r["example_id"]: r["score"] for r in records if r["config"] == key}
        if all(i in answered for i in common):
            scores[key] = [answered[i] for i in common]
    with_joins = [i for i in common if joined[i].get("joined")]
    recall = gold_recall([joined[i] for i in common])
    lines = [f"### {run['dataset']} ({run.get('setting')}): All over the documents PCED read", "",
             f"{len(common)} questions; documents joined in {len(with_joins)} of them (PCED config `{join_key}`).",
             f"A gold document was missing from the question's top-k in {recall['missing']} questions; in "
             f"{recall['joined']} of them a missing gold document joined. Gold documents read: "
             f"{recall['gold_in_top_k']} of {recall['gold']} from the question's top-k, {recall['gold_in_final']} "
             f"in PCED's final set ({recall['joins']} joins in all, {recall['joins'] / max(1, len(common)):.2f} per answer).", "",
             "| reader | score (%) | on the questions with joins (%) |", "|---|---|---|"]
    for name, values in scores.items():
        sub = [v for i, v in zip(common, values) if i in with_joins]
        lines.append(f"| {name} | {100 * sum(values) / max(1, len(values)):.1f} | "
                     f"{100 * sum(sub) / max(1, len(sub)):.1f} (n={len(sub)}) |")
    comparison = paired_comparison([{"config": name, "method": name, "example_id": i, "score": v}
                                    for name, values in scores.items() for i, v in zip(common, values)],
                                   reference="All, PCED's final set")
    lines += ["", format_comparison(comparison)]
    text = "\n".join(lines) + "\n"
    print(text)
    atomic_write_text(args.run / "all_final.md", text)
    atomic_write_json(args.run / "all_final.json", {"join_config": join_key, "all_config": all_key,
                                                    "questions": len(common), "with_joins": len(with_joins),
                                                    "gold": recall,
                                                    "scores": {k: sum(v) / max(1, len(v)) for k, v in scores.items()},
                                                    "paired": comparison})
    return 0


if __name__ == "__main__":
    sys.exit(main())
