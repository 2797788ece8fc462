"""What the loop guard (``pced.decoding.repetition``) would do to every answer stored under docs/results:
how many it cuts, and whether any score moves, for several minimum spans.

    python experiments/loop_guard.py --spans 4,5,6,8 --out docs/results/loop_guard

The guard only stops an answer (greedy decoding chooses the same tokens up to the cut), so the
guarded answer is the stored answer cut where the guard fires; this replays each stored trace
through ``LoopGuard`` and scores the cut answer with the run's own metric. The trace stores each
token's text, not its id: tokens are compared by that text (stripped, as ``key_of`` does), which
is the guard's key except for a token that decodes to half a character. Prints a Markdown table
and writes ``OUT.md`` / ``OUT.json`` with every changed score.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import sys
from pathlib import Path

from pced.evaluation.metrics import score
from pced.decoding.repetition import LoopGuard


def stored_answers(root: Path) -> list[dict]:
    answers = []
    for path in sorted(root.glob("*/results.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as lines:
            for line in lines:
                record = json.loads(line)
                trace = record.get("trace")
                if not trace:
                    continue
                trace = trace if isinstance(trace, list) else ast.literal_eval(trace)
                answers.append({**record, "run": path.parent.name, "tokens": [step[0] for step in trace]})
    return answers


def cut_at(tokens: list[str], span: int) -> int | None:
    guard = LoopGuard(span, max(1, len(tokens)))
    for token in tokens:
        if guard.push(token.strip() or token):
            return guard.keep
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=Path("docs/results"))
    parser.add_argument("--spans", default="4,5,6,8")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    answers = stored_answers(args.results)
    questions = len({(a["run"].split("-")[0], a["example_id"]) for a in answers})
    rows, changed = [], {}
    for span in (int(s) for s in args.spans.split(",")):
        cut, tokens_cut, f1_change, moved = 0, 0, [], []
        for answer in answers:
            keep = cut_at(answer["tokens"], span)
            if keep is None:
                continue
            cut += 1
            tokens_cut += len(answer["tokens"]) - keep
            text = "".join(answer["tokens"][:keep])
            new = score(answer["metric"], text, answer["gold"])
            if new != answer["score"]:
                moved.append({"run": answer["run"], "example_id": answer["example_id"], "config": answer["config"],
                              "score": answer["score"], "cut_score": new, "answer": answer["prediction"], "cut": text})
            if "f1" in answer.get("metrics", {}):
                f1_change.append(score("f1", text, answer["gold"]) - answer["metrics"]["f1"])
        mean_f1 = 100 * sum(f1_change) / len(f1_change) if f1_change else 0.0
        rows.append({"span": span, "answers_cut": cut, "tokens_cut": tokens_cut, "scores_changed": len(moved),
                     "scores_lost": sum(m["cut_score"] < m["score"] for m in moved), "mean_f1_change": round(mean_f1, 2)})
        changed[span] = moved
    lines = [f"{len(answers)} stored answers ({questions} distinct questions, every run under {args.results}).", "",
             "| minimum span | answers cut | tokens not generated | scores changed (lost) | mean F1 change on the cut answers (points) |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['span']} | {r['answers_cut']} | {r['tokens_cut']} | {r['scores_changed']} ({r['scores_lost']}) | "
              f"{r['mean_f1_change']:+.1f} |" for r in rows]
    text = "\n".join(lines)
    print(text)
    for span, moved in changed.items():
        for m in moved[:3]:
            print(f"  span {span}: {m['run']} {m['score']} -> {m['cut_score']}: {m['cut']!r} (was {m['answer'][:80]!r})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(text + "\n")
        args.out.with_suffix(".json").write_text(json.dumps({"answers": len(answers), "questions": questions, "rows": rows,
                                                             "changed": changed}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
