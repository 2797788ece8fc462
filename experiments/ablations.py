"""The README's PCED ablations: beta, gamma, aggregation, score space and top-k, one at a time
around the default rule, on one dataset, into one results file.

Each sweep is exactly a ``pced eval`` command (printed before it runs); this script only
interleaves them in chunks of examples so that, when it stops at ``--deadline``, every setting
has been measured on the same questions. Rerunning resumes (finished answers are skipped).

    python experiments/ablations.py hotpotqa --default-k 10 --ks 2,4,6,8 --limit 100
    python experiments/ablations.py nq --default-k 8 --ks 2,4,16,32 --limit 100
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime

SWEEPS = {
    "beta": "0,0.5,1",
    # the paper's range (<= 4) and beyond it: with our normalizations one question's candidates
    # differ by ~0.1-0.3 in log r (experiments/relevance_spread.py), so gamma <= 4 moves logits < ~1
    "gamma": "0,1,2.5,8,32",
    "aggregation": "max,moe,poe",
    "score_space": "logits,logprobs",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset")
    parser.add_argument("--default-k", type=int, required=True, help="top-k of the beta/gamma/aggregation sweeps")
    parser.add_argument("--ks", required=True, help="the other top-k values of the top-k sweep")
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--chunk", type=int, default=5, help="examples per round of sweeps")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--out", default=None, help="default runs/eval/<dataset>-ablation")
    parser.add_argument("--deadline", default=None, help="HH:MM (local time): start no round after it")
    args = parser.parse_args()

    from pced.evaluation.runner import EvalConfig, run_eval
    from pced.llm import load_model

    out = args.out or f"runs/eval/{args.dataset}-ablation"
    ks = sorted({args.default_k, *(int(k) for k in args.ks.split(","))})
    sweeps = [(f"--{name.replace('_', '-')} {values} --top-k {args.default_k}",
               {name: [v if name in ("aggregation", "score_space") or v in ("dynamic", "elementwise") else float(v)
                       for v in values.split(",")], "top_k": [args.default_k]})
              for name, values in SWEEPS.items()]
    sweeps[0][1]["beta"].insert(0, "dynamic")
    sweeps[0] = (sweeps[0][0].replace("--beta ", "--beta dynamic,"), sweeps[0][1])
    sweeps.append((f"--top-k {','.join(map(str, ks))}", {"top_k": ks}))
    common = f"pced eval --dataset {args.dataset} --max-new-tokens {args.max_new_tokens} --out {out}"
    print("The sweeps (each a pced eval command; run here in chunks of examples):")
    for flags, _ in sweeps:
        print(f"  {common} {flags} --limit {args.limit}")
    llm = load_model()
    rounds = []
    for limit in range(args.chunk, args.limit + args.chunk, args.chunk):
        limit = min(limit, args.limit)
        if args.deadline:
            finish = time.time() + (max(rounds[-3:]) if rounds else 0.0)
            hh, mm = map(int, args.deadline.split(":"))
            if datetime.fromtimestamp(finish) > datetime.now().replace(hour=hh, minute=mm, second=0):
                print(f"stopping before examples {limit - args.chunk + 1}-{limit}: the round would end after "
                      f"{args.deadline}; every sweep holds the first {limit - args.chunk} examples", flush=True)
                return
        started = time.time()
        for _, fields in sweeps:
            run_eval(EvalConfig(dataset=args.dataset, limit=limit, max_new_tokens=args.max_new_tokens,
                                out=out, progress=False, **fields), llm=llm)
        elapsed = time.time() - started
        if elapsed > 30:  # a resumed round that found everything done says nothing about the next one
            rounds.append(elapsed)
        print(f"round up to {limit} examples: {elapsed:.0f} s", flush=True)


if __name__ == "__main__":
    main()
