"""Re-score stored ICL results with LOFT's exact match and rebuild their reports. No model.

``icl_em`` became exactly LOFT's (google-deepmind/loft ``utils.extract_prediction`` +
``evaluation/icl.py``); pced's former strict metric lives on as ``icl_em_pced``. For every record
of ``<dir>/results.jsonl.gz`` whose metric is ``icl_em`` this sets ``score`` to the new
``icl_em`` of the stored prediction and keeps pced's variant as ``metrics["icl_em_pced"]`` (equal
to the old ``score``), rewrites the file, then rebuilds ``summary.json``, ``table.md`` and
``paired.md`` with :func:`pced.evaluation.report.write_reports` (meta read from the existing
summary.json). Running it twice changes nothing the second time.

    python scripts/rescore_icl.py                          # the three stored BBH runs
    python scripts/rescore_icl.py docs/results/bbh-date    # or the folders named
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import tempfile
from pathlib import Path

from pced.evaluation.metrics import icl_em, icl_em_pced
from pced.evaluation.report import write_reports

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIRS = [ROOT / "docs" / "results" / name
                for name in ("bbh-date", "bbh-web-of-lies", "bbh-tracking7")]
REPORTS = ("summary.json", "table.md", "paired.md")
META_KEYS = ("dataset", "setting", "model", "metric")


def _replace_bytes(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def rescore_records(records: list[dict]) -> dict[str, dict[str, float]]:
    """Re-score in place; per config: old and new mean score in percent and records changed."""
    totals: dict[str, dict[str, float]] = {}
    for record in records:
        if record.get("metric") != "icl_em" or "error" in record:
            continue
        metrics = record.setdefault("metrics", {})
        ours = icl_em_pced(record["prediction"], record["gold"])
        old = metrics.get("icl_em_pced", record["score"])  # already re-scored: the kept value
        if old != ours:
            raise SystemExit(f"{record['example_id']} {record['config']}: stored score {old} is not "
                             f"icl_em_pced's {ours}; not a pced icl_em score?")
        new = icl_em(record["prediction"], record["gold"])
        metrics["icl_em_pced"] = ours
        row = totals.setdefault(record["config"], {"method": record["method"], "n": 0, "old": 0.0,
                                                   "new": 0.0, "changed": 0})
        row["n"] += 1
        row["old"] += old
        row["new"] += new
        row["changed"] += int(record["score"] != new)
        record["score"] = new
    for row in totals.values():
        row["old"] = round(100.0 * row["old"] / row["n"], 2)
        row["new"] = round(100.0 * row["new"] / row["n"], 2)
    return totals


def rescore_dir(out: Path) -> dict[str, dict[str, float]]:
    path = out / "results.jsonl.gz"
    records = [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode("utf-8")
               .splitlines() if line.strip()]
    totals = rescore_records(records)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    _replace_bytes(path, gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0))

    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    meta = {key: summary.get(key) for key in META_KEYS}
    with tempfile.TemporaryDirectory() as tmp:  # write_reports reads a plain results.jsonl
        (Path(tmp) / "results.jsonl").write_text(text, encoding="utf-8")
        write_reports(tmp, meta)
        for built in sorted(Path(tmp).iterdir()):
            if built.name in REPORTS or built.suffix == ".png":
                _replace_bytes(out / built.name, built.read_bytes())
    return totals


def main(argv: list[str]) -> None:
    dirs = [Path(a) for a in argv] or DEFAULT_DIRS
    print("| Task | Method | Config | n | old icl_em (pced) | new icl_em (LOFT) | changed |")
    print("|---|---|---|---|---|---|---|")
    for out in dirs:
        for config, row in rescore_dir(out).items():
            print(f"| {out.name} | {row['method']} | `{config}` | {row['n']} | {row['old']:.1f} | "
                  f"{row['new']:.1f} | {row['changed']} |")


if __name__ == "__main__":
    main(sys.argv[1:])
