"""From ``results.jsonl`` to ``summary.json``, ``table.md`` and the ablation plots.

Everything here is rebuilt from the whole results file on every run, so a resumed or extended
evaluation always reports every answer it holds. Rows keep the order in which their config
first appears in the file (the grid order of the first example).
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any, Sequence

from pced.fs import atomic_write_text

__all__ = ["completed_pairs", "format_table", "read_results", "summarize", "write_plots", "write_reports"]

METHOD_NAMES = {"pced": "PCED", "all": "Corpus in Ctx (All)", "single": "Corpus in Ctx (Single)",
                "ape": "APE", "mapreduce": "MapReduce"}
RULE_SETTINGS = ("beta", "gamma", "aggregation", "score_space", "prior")
SETTING_ORDER = (*RULE_SETTINGS, "top_k", "retriever", "relevance", "no_repeat_ngram", "loop_span")
# Settings a record leaves out at the value every earlier record was decoded with (RunConfig.settings);
# their table column only appears when a row sets them.
IMPLIED = {"prior": "log", "no_repeat_ngram": 0, "loop_span": 0}
OPTIONAL_COLUMNS = ("relevance", *IMPLIED)
# plot file -> the setting it sweeps; top-k and the n-gram ban are drawn for every method, the others for PCED only
PLOTS = {"topk.png": "top_k", "beta.png": "beta", "gamma.png": "gamma",
         "aggregation.png": "aggregation", "score_space.png": "score_space", "prior.png": "prior",
         "relevance.png": "relevance", "no_repeat_ngram.png": "no_repeat_ngram"}
EVERY_METHOD = ("top_k", "no_repeat_ngram")
AXIS_LABELS = {"top_k": "top-k experts", "beta": "beta", "gamma": "gamma", "aggregation": "aggregation",
               "score_space": "score space", "prior": "prior", "relevance": "relevance from",
               "no_repeat_ngram": "no-repeat n-gram (0 = off)", "loop_span": "loop guard span (0 = off)"}
SHORT_NAMES = {"aggregation": "agg", "score_space": "space", "top_k": "k", "retriever": "ret", "relevance": "rel",
               "no_repeat_ngram": "nrng", "loop_span": "loop"}


def read_results(path: Path) -> list[dict]:
    """Every complete record of a results.jsonl (a torn last line is ignored)."""
    if not Path(path).is_file():
        return []
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def completed_pairs(path: Path) -> set[tuple[str, str]]:
    """(example_id, config) pairs already in results.jsonl; a torn last line (a killed run) is cut off."""
    if not path.is_file():
        return set()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as handle:
            handle.truncate(end)
    done = set()
    for line in data[:end].decode("utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            done.add((str(record["example_id"]), record["config"]))
    return done


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 6) if values else None


def _recall(record: dict) -> float | None:
    gold = record.get("gold_doc_ids") or []
    if not gold:
        return None
    ids = [e["doc_id"] for e in record.get("experts", [])]
    return sum(any(i == g or i.startswith(g + "#") for i in ids) for g in gold) / len(gold)


def summarize(records: Sequence[dict], meta: dict) -> dict:
    """Per config: mean score in percent (as in the paper's tables), n, errors, median timings."""
    groups: dict[str, list[dict]] = {}
    for record in records:
        groups.setdefault(record["config"], []).append(record)
    rows = []
    for key, group in groups.items():
        first = group[0]
        answered = [r for r in group if "error" not in r]
        row: dict[str, Any] = {
            "method": first["method"], "config": key, "metric": first.get("metric", meta.get("metric")),
            "score": round(100.0 * sum(r["score"] for r in group) / len(group), 2), "n": len(group),
            "errors": len(group) - len(answered),
            "ttft_s_median": _median([r["timings"]["ttft_s"] for r in answered if "ttft_s" in r["timings"]]),
            "total_s_median": _median([r["timings"]["total_s"] for r in answered if "total_s" in r["timings"]]),
        }
        row.update(first.get("settings", {}))
        for name in first.get("metrics", {}):
            row[name] = round(100.0 * sum(r.get("metrics", {}).get(name, 0.0) for r in group) / len(group), 2)
        recalls = [x for x in map(_recall, group) if x is not None]
        if recalls:
            row["gold_recall"] = round(100.0 * sum(recalls) / len(recalls), 2)
        rows.append(row)
    return {"dataset": meta.get("dataset"), "setting": meta.get("setting"), "model": meta.get("model"),
            "metric": meta.get("metric"), "n_examples": len({r["example_id"] for r in records}),
            "results": rows}


def setting(row: dict, name: str) -> Any:
    """A summary row's setting, with the implied value where its records leave it out (the prior
    is PCED's only)."""
    value = row.get(name)
    if value is None and name in IMPLIED and (name != "prior" or row.get("method") == "pced"):
        return IMPLIED[name]
    return value


def _cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def follow_label(row: dict) -> str:
    """PCED's decode-time relevance of a row: off, rescore, join<=N or rescore+join<=N ("–" for baselines)."""
    if row.get("method") != "pced":
        return "–"
    parts = (["rescore"] if row.get("rescore") else []) + ([f"join<={row['max_joins']}"] if row.get("max_joins") else [])
    return "+".join(parts) or "off"


def format_table(summary: dict) -> str:
    """A Markdown table shaped like the paper's: one row per config."""
    metric = summary.get("metric") or "score"
    head = (f"# {summary.get('dataset')} ({summary.get('setting')}), {summary.get('model')}\n\n"
            f"{summary.get('n_examples', 0)} examples; score = mean {metric} in percent; "
            "timings are medians in seconds.\n\n")
    rows = summary.get("results", [])
    settings = [s for s in SETTING_ORDER if s not in OPTIONAL_COLUMNS or any(r.get(s) for r in rows)]
    names = {"beta": "β", "gamma": "γ", "aggregation": "Aggregation", "score_space": "Score space", "prior": "Prior",
             "top_k": "k", "retriever": "Retriever", "relevance": "Relevance", "no_repeat_ngram": "No-repeat n-gram",
             "loop_span": "Loop span"}
    follows = any("rescore" in r or "max_joins" in r for r in rows)  # PCED's decode-time relevance swept
    columns = ["Method", *(names[s] for s in settings), *(["Follow"] if follows else []), "n", metric, "TTFT (s)", "Total (s)"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        errors = f" ({row['errors']} errors)" if row.get("errors") else ""
        cells = [METHOD_NAMES.get(row["method"], row["method"]), *(_cell(setting(row, s)) for s in settings),
                 *([follow_label(row)] if follows else []), str(row["n"]), f"{row['score']:.1f}{errors}",
                 *(f"{row[t]:.3f}" if row.get(t) is not None else "–" for t in ("ttft_s_median", "total_s_median"))]
        lines.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def _curve(rows: list[dict], parameter: str) -> tuple[list[tuple[Any, float]], dict]:
    """(value, score) points of ``parameter`` with every other setting fixed, and the first row of
    that curve. In a one-run sweep the others sit at their first values; when several runs share
    the file, at the values that give the longest curve (the first of equally long ones)."""
    others = [s for s in SETTING_ORDER if s != parameter]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(str(setting(row, s)) for s in others), []).append(row)
    best = max(groups.values(), key=len, default=[])  # one row per value; max keeps the first of ties
    return ([(setting(r, parameter), r["score"]) for r in best], best[0]) if len(best) >= 2 else ([], {})


def write_plots(summary: dict, out: Path) -> list[Path]:
    """topk.png (every method) and one PNG per swept PCED setting; only where a sweep exists."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary.get("results", [])
    methods = list(dict.fromkeys(r["method"] for r in rows))
    written = []
    for name, parameter in PLOTS.items():
        found = {m: _curve([r for r in rows if r["method"] == m], parameter)
                 for m in (methods if parameter in EVERY_METHOD else ["pced"])}
        curves = {m: points for m, (points, _) in found.items() if points}
        if not curves:
            continue
        reference = found[next(iter(curves))][1]
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for c in curves.values() for v, _ in c)
        labels = list(dict.fromkeys(str(v) for c in curves.values() for v, _ in c))
        for method, points in curves.items():
            if numeric:
                points = sorted(points, key=lambda p: p[0])
                xs = [p[0] for p in points]
            else:
                xs = [labels.index(str(p[0])) for p in points]
            ax.plot(xs, [p[1] for p in points], marker="o", label=METHOD_NAMES.get(method, method))
        if parameter == "top_k":
            ax.set_xscale("log", base=2)
            ticks = sorted({v for c in curves.values() for v, _ in c})
            ax.set_xticks(ticks, [str(t) for t in ticks])
        elif not numeric:
            ax.set_xticks(range(len(labels)), labels)
        scores = [p[1] for c in curves.values() for p in c]
        if parameter not in EVERY_METHOD:  # baselines at the same top-k, for scale
            for row in rows:
                if row["method"] != "pced" and all(setting(row, s) == setting(reference, s)
                                                   for s in ("top_k", "retriever", "no_repeat_ngram", "loop_span")):
                    ax.axhline(row["score"], linestyle="--", linewidth=1, color="grey")
                    ax.annotate(METHOD_NAMES.get(row["method"], row["method"]), (0.01, row["score"]),
                                xycoords=("axes fraction", "data"), fontsize=7, color="grey")
                    scores.append(row["score"])
        ax.set_ylim(max(0.0, min(scores) - 5.0), min(100.0, max(scores) + 5.0))
        ax.set_xlabel(AXIS_LABELS[parameter])
        ax.set_ylabel(f"{summary.get('metric') or 'score'} (%)")
        fixed = ", ".join(f"{SHORT_NAMES.get(s, s)}={_cell(reference.get(s))}" for s in SETTING_ORDER
                          if s != parameter and reference.get(s) is not None)
        ax.set_title(f"{summary.get('dataset')}: {summary.get('model')}\n{fixed}", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = Path(out) / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def write_reports(out: str | os.PathLike, meta: dict) -> dict:
    """Rebuild summary.json, table.md, paired.md and the plots from ``out/results.jsonl``; returns the summary."""
    from .compare import format_comparison, paired_comparison

    out = Path(out)
    records = read_results(out / "results.jsonl")
    summary = summarize(records, meta)
    summary["paired"] = paired_comparison(records)  # every config against the first (PCED's default rule)
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    table = format_table(summary)
    atomic_write_text(out / "table.md", table)
    atomic_write_text(out / "paired.md", format_comparison(summary["paired"], f"{summary.get('dataset')}: paired differences"))
    write_plots(summary, out)
    return summary
