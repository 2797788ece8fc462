#!/usr/bin/env bash
# README "Results": PCED against All / Single / APE on >= 100 questions of each dataset, embedded
# model, greedy. Same candidates for every method. Resumable: re-running skips finished answers.
# MapReduce (N+1 model calls, ~60 s per answer on a 2-core CPU) is in experiments/methods_table.sh
# on the first 20 HotpotQA questions only.
set -euo pipefail
methods=pced,all,single,ape
run() { pced eval --no-progress "$@"; }
case "${1:-all}" in
  hotpotqa) run --dataset hotpotqa --methods $methods --top-k 10 --limit 100 --out runs/eval/hotpotqa ;;
  musique)  run --dataset musique --methods $methods --top-k 8 --limit 100 --out runs/eval/musique ;;
  nq)       run --dataset nq --methods $methods --top-k 8 --limit 100 --out runs/eval/nq ;;
  bbh)      # ICL: 8 of 16 seeded exemplars are the experts; answers are short (16 tokens). APE ran on
            # bbh-date only: the 2-core CPU had no time left for it on the other two tasks.
            run --dataset bbh-date --methods $methods --top-k 8 --limit 100 --max-new-tokens 16 --out runs/eval/bbh-date
            for t in bbh-web-of-lies bbh-tracking7; do
              run --dataset $t --methods pced,all,single --top-k 8 --limit 100 --max-new-tokens 16 --out runs/eval/$t
            done ;;
  all)      for d in hotpotqa musique nq bbh; do "$0" $d; done ;;
esac
