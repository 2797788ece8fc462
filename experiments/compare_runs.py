"""Paired comparison of one config across two ``pced eval`` runs on the same questions (for settings
that are a run's identity, not a sweep: the storage dtype, the model, the backend).

    python experiments/compare_runs.py runs/eval/hotpotqa-follow runs/eval/hotpotqa-int8 \
        --config "pced|beta=dynamic|gamma=32|agg=max|space=logits|k=8|ret=hybrid" \
        --labels float16,int8 --out docs/results/int8/hotpotqa

Prints and writes ``OUT.md`` / ``OUT.json``: each run's score on the common questions, the paired
difference (second minus first) with its 95% bootstrap interval, wins and losses, and how many
answers are identical.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pced.evaluation.compare import format_comparison, paired_comparison
from pced.fs import atomic_write_json, atomic_write_text


def records(run: Path, config: str) -> dict[str, dict]:
    out = {}
    for line in (run / "results.jsonl").read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if record["config"] == config:
                out[str(record["example_id"])] = record
    if not out:
        raise SystemExit(f"{run}: no records of config {config!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--config", required=True, help="the config key (results.jsonl 'config') in both runs")
    parser.add_argument("--labels", default="first,second")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    labels = args.labels.split(",")
    a, b = records(args.first, args.config), records(args.second, args.config)
    common = [e for e in a if e in b]
    comparison = paired_comparison([{"config": label, "method": label, "example_id": e, "score": run[e]["score"]}
                                    for label, run in zip(labels, (a, b)) for e in common], reference=labels[0])
    same = sum(a[e]["prediction"] == b[e]["prediction"] for e in common)
    text = (f"`{args.config}` on {len(common)} common questions; {same} answers identical.\n\n"
            + format_comparison(comparison))
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out.with_suffix(".md"), text)
        atomic_write_json(args.out.with_suffix(".json"), {"config": args.config, "runs": [str(args.first), str(args.second)],
                                                          "labels": labels, "questions": len(common),
                                                          "identical_answers": same, "comparison": comparison})
    return 0


if __name__ == "__main__":
    sys.exit(main())
