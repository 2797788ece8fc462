"""Print the README "Results" tables from finished ``pced eval`` folders (their summary.json).

    python experiments/results_readme.py [--runs runs/eval] > /tmp/results.md

Methods table: each method's score per dataset (n questions), its paired difference from PCED
with the 95% bootstrap interval, and median TTFT / total seconds. Ablation tables: every
config of an ``*-ablation`` folder against PCED's default rule.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DATASETS = ["hotpotqa", "musique", "nq", "bbh-date", "bbh-web-of-lies", "bbh-tracking7"]
METHODS = [("pced", "PCED"), ("all", "All"), ("single", "Single"), ("ape", "APE"), ("mapreduce", "MapReduce")]


def load(folder: Path) -> dict | None:
    path = folder / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


def main_rows(summary: dict) -> dict[str, dict]:
    """method -> its row at the PCED reference's top-k (PCED: the reference config itself)."""
    reference = summary["paired"]["reference"]
    rows = {r["config"]: r for r in summary["results"]}
    k = rows[reference]["top_k"]
    paired = {r["config"]: r for r in summary["paired"]["rows"]}
    out = {"pced": {**rows[reference], "paired": paired[reference]}}
    for r in summary["results"]:
        if r["method"] != "pced" and r["top_k"] == k and r["method"] not in out:
            out[r["method"]] = {**r, "paired": paired.get(r["config"])}
    return out


def methods_tables(runs: Path) -> str:
    found = {d: s for d in DATASETS if (s := load(runs / d))}
    head = "| Method | " + " | ".join(found) + " |\n|---|" + "---|" * len(found)
    score_lines, time_lines = [head], [head]
    for method, name in METHODS:
        cells, times = [], []
        for summary in found.values():
            row = main_rows(summary).get(method)
            if row is None:
                cells.append("–"), times.append("–")
                continue
            p = row["paired"]
            delta = "" if method == "pced" or p is None else (
                f" ({p['delta']:+.0f}{'*' if p['ci_low'] > 0 or p['ci_high'] < 0 else ''})")
            lenient = f" / {row['icl_lenient']:.1f}" if "icl_lenient" in row else ""
            cells.append(f"{row['score']:.1f}{lenient}{delta} n={row['n']}")
            times.append(f"{row['ttft_s_median']:.2f} / {row['total_s_median']:.2f}")
        score_lines.append(f"| {name} | " + " | ".join(cells) + " |")
        time_lines.append(f"| {name} | " + " | ".join(times) + " |")
    return ("Scores (metric in percent; BBH: strict / lenient exact match, strict being LOFT's ICL exact match "
            "(`icl_em`) and lenient ours (`icl_lenient`); in brackets the paired "
            "difference from PCED on the same questions in the primary metric, * where its 95% "
            "bootstrap interval excludes 0):\n\n" + "\n".join(score_lines)
            + "\n\nMedian TTFT / total seconds per answer:\n\n" + "\n".join(time_lines) + "\n")


def label(row: dict, reference: dict) -> str:
    changed = [f"{name}={row.get(name)}" for name in ("beta", "gamma", "aggregation", "score_space", "top_k")
               if row.get(name) != reference.get(name)]
    return ", ".join(changed) or "default (paper rule)"


def ablation_table(summary: dict) -> str:
    rows = {r["config"]: r for r in summary["results"]}
    reference = rows[summary["paired"]["reference"]]
    lines = ["| Setting | n | score | Δ vs default | 95% interval | wins / losses |", "|---|---|---|---|---|---|"]
    for p in summary["paired"]["rows"]:
        row = rows[p["config"]]
        mark = "*" if p["ci_low"] > 0 or p["ci_high"] < 0 else ""
        lines.append(f"| {label(row, reference)} | {p['n']} | {p['score']:.1f} | {p['delta']:+.1f}{mark} | "
                     f"[{p['ci_low']:+.1f}, {p['ci_high']:+.1f}] | {p['wins']} / {p['losses']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="runs/eval")
    runs = Path(parser.parse_args().runs)
    print(methods_tables(runs))
    for folder in sorted(runs.glob("*-ablation")):
        summary = load(folder)
        if summary:
            print(f"\n{folder.name} ({summary['n_examples']} questions):\n")
            print(ablation_table(summary))


if __name__ == "__main__":
    main()
