"""Share of answer tokens won by a gold document, per config of a pced eval run (PCED only).

A direct view of gating that a truncated answer's exact match can hide: with the retrieval
prior working, the tokens come from the gold document(s). Prints a Markdown table.

    python experiments/gold_share.py runs/eval/nq-ablation
"""

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

shares = defaultdict(list)
for line in (Path(sys.argv[1]) / "results.jsonl").read_text().splitlines():
    r = json.loads(line)
    gold = set(r.get("gold_doc_ids") or [])
    if r["method"] != "pced" or not gold or not r["trace"]:
        continue
    won = [doc for _, doc in r["trace"] if doc is not None]
    shares[r["config"]].append(sum(doc in gold or doc.split("#")[0] in gold for doc in won) / max(len(won), 1))
print("| config | n | tokens from a gold document (mean %) |\n|---|---|---|")
for config, values in shares.items():
    print(f"| `{config.replace('|', chr(92) + '|')}` | {len(values)} | {100 * statistics.mean(values):.1f} |")
