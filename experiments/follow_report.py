"""Decode-time relevance on HotpotQA, by question type: paired differences and the second hop.

Reads a ``pced eval --dataset hotpotqa --follow ...`` output folder and the HotpotQA file it came
from, and reports, for bridge and comparison questions apart:

- each config's score, paired against PCED with decode-time relevance off (95% bootstrap);
- on bridge questions, the share of answer tokens won by the *second-hop* gold paragraph (the
  gold paragraph the question ranked lower: the one its words point to less), and how often that
  paragraph was an expert at all (from the start, or by joining).

    python experiments/follow_report.py runs/eval/hotpotqa-follow [--data ../shared/data]

Writes follow.md and follow.json into the folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pced.evaluation import load_dataset, resolve_data_dir
from pced.evaluation.compare import format_comparison, paired_comparison
from pced.fs import atomic_write_json, atomic_write_text


def second_hop(record: dict, question_relevance: dict[str, float]) -> str | None:
    """The gold paragraph the question ranked lowest (not among the question's experts: lowest)."""
    gold = record.get("gold_doc_ids") or []
    if len(gold) < 2:
        return None
    return min(gold, key=lambda d: question_relevance.get(d, -1.0))


def hop_share(records: list[dict]) -> dict:
    """Per config: mean share of answer tokens won by the second-hop paragraph; how often it was an expert."""
    question_relevance: dict[str, dict[str, float]] = {}
    for r in records:  # the question-only relevance of the run's retriever: no decode-time relevance, no --relevance
        if r["method"] == "pced" and "follow" not in r["config"] and "|rel=" not in r["config"]:
            question_relevance.setdefault(r["example_id"], {e["doc_id"]: e["relevance"] for e in r["experts"]})
    out: dict[str, dict] = {}
    for r in records:
        if r["method"] != "pced" or r["example_id"] not in question_relevance:
            continue
        hop = second_hop(r, question_relevance[r["example_id"]])
        if hop is None:
            continue
        read = {e["doc_id"] for e in r["experts"]} | {e["doc_id"] for e in r.get("joined", [])}
        won = sum(1 for _, doc in r["trace"] if doc == hop)
        row = out.setdefault(r["config"], {"questions": 0, "share_sum": 0.0, "read": 0, "joined": 0})
        row["questions"] += 1
        row["share_sum"] += won / max(1, len(r["trace"]))
        row["read"] += hop in read
        row["joined"] += hop in {e["doc_id"] for e in r.get("joined", [])}
    return {k: {"questions": v["questions"], "second_hop_token_share": round(v["share_sum"] / v["questions"], 4),
                "second_hop_read": v["read"], "second_hop_joined": v["joined"]} for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a pced eval output folder (results.jsonl) on hotpotqa")
    parser.add_argument("--data", default=None, help="the shared data folder (default: pced's own lookup)")
    args = parser.parse_args(argv)
    folder = Path(args.folder)
    records = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines() if line.strip()]
    run = json.loads((folder / "run.json").read_text())
    dataset = load_dataset("hotpotqa", setting=run.get("setting"), data_dir=args.data or resolve_data_dir())
    types = {str(e.id): (e.metadata or {}).get("type") for e in dataset.examples}
    reference = next(r["config"] for r in records if r["method"] == "pced" and "follow" not in r["config"])
    report: dict = {"folder": str(folder), "reference": reference, "types": {}}
    text = [f"# Decode-time relevance on HotpotQA ({run.get('setting')}), by question type", ""]
    for kind in ("bridge", "comparison"):
        chosen = [r for r in records if types.get(str(r["example_id"])) == kind]
        if not chosen:
            continue
        comparison = paired_comparison(chosen, reference)
        report["types"][kind] = {"paired": comparison}
        text.append(format_comparison(comparison, f"{kind} questions ({len({r['example_id'] for r in chosen})})"))
        if kind == "bridge":
            shares = hop_share(chosen)
            report["types"][kind]["second_hop"] = shares
            text += ["", "Second-hop gold paragraph on bridge questions (the gold paragraph the question ranked lower):", "",
                     "| config | questions | share of answer tokens it won | an expert (from the start or joined) | joined |",
                     "|---|---|---|---|---|"]
            text += [f"| `{k.replace('|', chr(92) + '|')}` | {v['questions']} | {100 * v['second_hop_token_share']:.1f}% | {v['second_hop_read']} | "
                     f"{v['second_hop_joined']} |" for k, v in shares.items()]
        text.append("")
    atomic_write_json(folder / "follow.json", report)
    atomic_write_text(folder / "follow.md", "\n".join(text) + "\n")
    print("\n".join(text))
    print(f"follow_report: wrote {folder / 'follow.md'} and {folder / 'follow.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
