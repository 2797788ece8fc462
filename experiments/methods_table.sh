#!/usr/bin/env bash
# The five methods on the first 20 HotpotQA questions, each with its own 10 paragraphs (distractor
# setting): subspan EM, time to first token, total time. Same candidates, template and greedy
# decoding for every method; PCED in both score spaces. Resumable: re-running skips finished answers.
set -euo pipefail
pced eval --dataset hotpotqa --methods pced,all,single,ape,mapreduce --score-space logits,logprobs \
  --top-k 10 --limit 20 --out "${1:-runs/eval/hotpotqa}"
cat "${1:-runs/eval/hotpotqa}/table.md"
