"""Per-question wall time of separate ``pced ask`` calls against ``pced ask --questions`` and ``pced chat``
(the model and retrievers loaded once), on the demo store, with the same questions and settings.

    python experiments/daily_use_timing.py --store /tmp/demo-store --rounds 3 --out runs/daily-use

Builds the store from the packaged demo corpus when --store does not exist (the same corpus and
settings ``pced demo`` uses). Each round times, in this order, one process per question, one
``--questions`` process for all of them, and one ``pced chat`` process fed them on stdin; the
per-question time of a one-process mode is its whole wall time (start-up included) over the number
of questions. Also checks that the batch answers equal the separate ones. Prints a Markdown table and
writes ``timing.json`` and ``timing.md`` under --out. Medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

QUESTIONS = [
    "What is the national bird of Elumia?",
    "What is the capital of the country whose national bird is the grey heron?",
    "In which town was the founder of the Zorblax Company born?",
    "Who founded the Zorblax Company?",
    "Which lake is Oskvale on?",
]


def pced(*args: str, stdin: str | None = None) -> tuple[float, subprocess.CompletedProcess]:
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "pced.cli", *args], input=stdin, capture_output=True, text=True,
                            env={**os.environ, "COLUMNS": "200"})
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"pced {' '.join(args)} failed:\n{result.stderr[-2000:]}")
    return elapsed, result


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in ("timings", "id")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", default="/tmp/pced-demo-store")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="runs/daily-use")
    parser.add_argument("--threads", type=int, default=None, help="passed to every pced call")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = Path(args.store)
    threads = ["--threads", str(args.threads)] if args.threads else []
    if not (store / "manifest.json").is_file():
        with resources.as_file(resources.files("pced") / "data" / "demo_corpus.jsonl") as corpus:
            seconds, _ = pced(*threads, "index", str(corpus), "--out", str(store))
        print(f"built {store} in {seconds:.1f} s", file=sys.stderr)
    questions_file = out / "questions.txt"
    questions_file.write_text("\n".join(QUESTIONS) + "\n")
    chat_script = "\n".join(QUESTIONS) + "\n/quit\n"
    rounds = []
    for number in range(1, args.rounds + 1):
        separate, singles = [], []
        for question in QUESTIONS:
            seconds, result = pced(*threads, "ask", str(store), question, "--json")
            separate.append(seconds)
            singles.append(json.loads(result.stdout))
        batch_s, result = pced(*threads, "ask", str(store), "--questions", str(questions_file))
        batch = [json.loads(line) for line in result.stdout.splitlines()]
        chat_s, _ = pced(*threads, "chat", str(store), stdin=chat_script)
        same = [comparable(b) for b in batch] == [comparable(s) for s in singles]
        rounds.append({"separate_s": separate, "batch_s": batch_s, "chat_s": chat_s, "batch_equals_separate": same,
                       "model_total_s": [s["timings"]["total_s"] for s in singles]})
        print(f"round {number}: separate {sum(separate):.1f} s, batch {batch_s:.1f} s, chat {chat_s:.1f} s, "
              f"batch answers equal separate: {same}", file=sys.stderr)
    n = len(QUESTIONS)
    per_question = {
        "separate pced ask calls": statistics.median(statistics.median(r["separate_s"]) for r in rounds),
        "pced ask --questions": statistics.median(r["batch_s"] / n for r in rounds),
        "pced chat": statistics.median(r["chat_s"] / n for r in rounds),
    }
    summary = {"questions": QUESTIONS, "rounds": rounds, "per_question_median_s": per_question, "store": str(store),
               "threads": args.threads, "cpu_count": os.cpu_count(),
               "all_batches_equal_separate": all(r["batch_equals_separate"] for r in rounds)}
    (out / "timing.json").write_text(json.dumps(summary, indent=2))
    base = per_question["separate pced ask calls"]
    lines = ["| mode | wall time per question (s, median of rounds) | vs separate calls |", "|---|---|---|"]
    lines += [f"| {mode} | {seconds:.2f} | {base / seconds:.1f}x |" for mode, seconds in per_question.items()]
    lines.append(f"\n{n} questions, {len(rounds)} rounds; batch answers equal the separate ones in every round: "
                 f"{summary['all_batches_equal_separate']}")
    (out / "timing.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
