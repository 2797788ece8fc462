"""Paired comparison of configs on the same questions: is a difference more than noise?

With 100 questions one question moves a score by a point, so two configs' means say little on
their own. Each config is compared with a reference config on the examples both answered:
the mean per-question difference, a paired bootstrap 95% interval for it, and how many
questions each one won. A setting "measurably" wins only when the interval excludes 0.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["format_comparison", "paired_comparison"]


def paired_comparison(records: Sequence[dict], reference: str | None = None, n_boot: int = 2000,
                      seed: int = 0) -> dict:
    """Every config against ``reference`` (default: the first config in ``records``).

    Returns {"reference": key, "rows": [{config, method, n, score, reference_score, delta,
    ci_low, ci_high, wins, losses}]}, scores and deltas in percent points.
    """
    by_config: dict[str, dict[str, float]] = {}
    methods: dict[str, str] = {}
    for record in records:
        by_config.setdefault(record["config"], {})[str(record["example_id"])] = float(record["score"])
        methods.setdefault(record["config"], record["method"])
    if not by_config:
        return {"reference": reference, "rows": []}
    reference = reference if reference is not None else next(iter(by_config))
    if reference not in by_config:
        raise KeyError(f"no results for reference config {reference!r}")
    base = by_config[reference]
    rng = np.random.default_rng(seed)
    rows = []
    for key, scores in by_config.items():
        common = [e for e in scores if e in base]
        if not common:
            continue
        diff = np.array([scores[e] - base[e] for e in common], dtype=np.float64)
        boots = rng.integers(0, len(diff), size=(n_boot, len(diff)))
        means = diff[boots].mean(axis=1)
        low, high = np.percentile(means, [2.5, 97.5])
        rows.append({
            "config": key, "method": methods[key], "n": len(common),
            "score": round(100.0 * float(np.mean([scores[e] for e in common])), 2),
            "reference_score": round(100.0 * float(np.mean([base[e] for e in common])), 2),
            "delta": round(100.0 * float(diff.mean()), 2),
            "ci_low": round(100.0 * float(low), 2), "ci_high": round(100.0 * float(high), 2),
            "wins": int((diff > 0).sum()), "losses": int((diff < 0).sum()),
        })
    return {"reference": reference, "rows": rows}


def format_comparison(comparison: dict, title: str = "") -> str:
    """Markdown: one row per config, the reference first."""
    lines = [f"# {title}\n" if title else "",
             f"Paired against `{str(comparison['reference']).replace('|', ', ')}` on the questions both answered; Δ and its "
             "95% paired-bootstrap interval in points; wins/losses = questions where the config "
             "scored higher/lower than the reference. * = the interval excludes 0.\n",
             "| Config | n | score | reference | Δ | 95% interval | wins | losses |",
             "|---|---|---|---|---|---|---|---|"]
    for row in comparison["rows"]:
        mark = " *" if row["ci_low"] > 0 or row["ci_high"] < 0 else ""
        config = row["config"].replace("|", "\\|")  # a bare | would split the Markdown cell
        lines.append(f"| `{config}` | {row['n']} | {row['score']:.1f} | {row['reference_score']:.1f} | "
                     f"{row['delta']:+.1f}{mark} | [{row['ci_low']:+.1f}, {row['ci_high']:+.1f}] | "
                     f"{row['wins']} | {row['losses']} |")
    return "\n".join(line for line in lines if line) + "\n"
