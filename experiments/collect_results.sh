#!/usr/bin/env bash
# Copy finished pced eval folders (runs/eval/*) into docs/results/ for the README: tables,
# paired comparisons, summaries, plots, and the per-answer results (gzipped).
set -euo pipefail
for run in runs/eval/*/; do
  name=$(basename "$run"); dest=docs/results/$name
  [ -f "$run/summary.json" ] || continue
  mkdir -p "$dest"
  cp "$run"/{table.md,paired.md,summary.json,run.json} "$dest"/
  cp "$run"/*.png "$dest"/ 2>/dev/null || true
  cp "$run"/relevance_spread.json "$dest"/ 2>/dev/null || true
  gzip -9 -n -c "$run/results.jsonl" > "$dest/results.jsonl.gz"
  echo "$dest: $(zcat "$dest/results.jsonl.gz" | wc -l) answers"
done
