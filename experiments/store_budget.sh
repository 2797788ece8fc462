#!/bin/bash
# Index a corpus with and without on-demand KV encoding, then ask one question twice on the
# on-demand store (its documents not encoded yet, then cached). Prints and saves OUT/store_budget.json
# and OUT/store_budget.md.
#   experiments/store_budget.sh CORPUS.jsonl OUT "question" [BUDGET_GB]
# The HotpotQA corpus is a JSON object {title: [sentences]}; JSON Lines of it:
#   python -c "import json; d=json.load(open('hotpotqa_train_corpus.json'));
#   [print(json.dumps({'id': t, 'title': t, 'text': ''.join(v).strip()})) for t, v in d.items()]" > corpus.jsonl
set -euo pipefail
corpus=$1 out=$2 question=$3 budget=${4:-1}
mkdir -p "$out"
rm -rf "$out/full" "$out/lazy"
declare -A secs
timed() { local name=$1; shift; local s e; s=$(date +%s.%N); "$@" > "$out/$name.out" 2> "$out/$name.err"; e=$(date +%s.%N); secs[$name]=$(echo "$e - $s" | bc); }
timed index_full pced index "$corpus" --out "$out/full"
timed index_on_demand pced index "$corpus" --out "$out/lazy" --kv-budget-gb "$budget"
timed ask_on_demand_first pced ask "$out/lazy" "$question" --json
timed ask_on_demand_second pced ask "$out/lazy" "$question" --json
timed ask_full pced ask "$out/full" "$question" --json
python - "$out" "$question" "$budget" "${secs[index_full]}" "${secs[index_on_demand]}" "${secs[ask_on_demand_first]}" \
    "${secs[ask_on_demand_second]}" "${secs[ask_full]}" <<'PY'
import json, subprocess, sys
from pathlib import Path
out, question, budget = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
names = ["index_full_s", "index_on_demand_s", "ask_on_demand_first_s", "ask_on_demand_second_s", "ask_full_s"]
result = {"question": question, "kv_budget_gb": budget, **{n: round(float(v), 1) for n, v in zip(names, sys.argv[4:])}}
size = lambda p: int(subprocess.check_output(["du", "-sb", str(p)]).split()[0])
result.update(full_store_bytes=size(out / "full"), full_kv_bytes=size(out / "full" / "kv"),
              on_demand_store_bytes=size(out / "lazy"), on_demand_kv_bytes=size(out / "lazy" / "kv"))
from pced.store import DocumentStore
result["on_demand_cache_stats"] = DocumentStore.open(out / "lazy").cache_stats()
for name in ("ask_on_demand_first", "ask_on_demand_second", "ask_full"):
    result[name.replace("ask_", "answer_")] = json.loads((out / f"{name}.out").read_text().splitlines()[-1])["answer"]
(out / "store_budget.json").write_text(json.dumps(result, indent=2))
rows = "\n".join(f"| {k} | {v} |" for k, v in result.items())
(out / "store_budget.md").write_text(f"| measure | value |\n|---|---|\n{rows}\n")
print(json.dumps(result, indent=2))
PY
