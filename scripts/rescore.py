"""Add secondary metrics that a finished run's records lack (e.g. ``icl_lenient``, added after
a run started) from their stored predictions, then rewrite results.jsonl atomically. No model.

    python scripts/rescore.py runs/eval/bbh-date    # then rerun its pced eval: "nothing to do" rebuilds the reports
"""

import json
import os
import sys
import tempfile
from pathlib import Path

from pced.evaluation.metrics import score
from pced.evaluation.runner import SECONDARY

run = Path(sys.argv[1])
path = run / "results.jsonl"
lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
added = 0
for record in lines:
    for name in SECONDARY.get(record["metric"], ()):
        if name not in record.setdefault("metrics", {}) and "error" not in record:
            record["metrics"][name] = score(name, record["prediction"], record["gold"])
            added += 1
fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=run)
with os.fdopen(fd, "w", encoding="utf-8") as handle:
    handle.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in lines)
os.chmod(tmp, 0o644)
os.replace(tmp, path)
print(f"{path}: {added} metric values added to {len(lines)} records")
