"""How `pced chat` should answer a follow-up question ("Where was she born?" after "Who founded
the Zorblax Company?"): five ways of bringing the previous turn in, on the demo store, with the
embedded model and `pced chat`'s default settings.

    python experiments/chat_followups.py --store /tmp/demo-store --out docs/daily-use
    python experiments/chat_followups.py --ways alone --out OUT      # one way; run several at once
    python experiments/chat_followups.py --table --out OUT            # the table of the ways run so far

- alone: the follow-up as typed, for retrieval and for the model;
- whole history: the previous turns prepended to the question, for retrieval and for the model
  (what `pced chat` did before);
- retrieval with the turn: retrieval searches with the previous question and answer and the
  question, the model is asked the question alone (the documents retrieved carry the names the
  question only refers to);
- retrieval and prompt with the turn: retrieval and the model both get the previous turn and the
  question;
- retrieval with the names the answer gave (what `pced chat` does, `pced.cli.chat.follow_up_query`):
  retrieval searches with the question and the capitalized words the previous answer added to its
  question ("Mira Quell"), the model is asked the question as typed.

Each first question is answered once (cached in OUT/firsts.json) and its answer is the previous
turn of every way. Per way: how many follow-ups name the expected answer, how many repeat the
previous answer, the question suffix each row prefills (tokens: what the turn costs every
expert), time to first token and total time (medians). Builds the store from the packaged
demo corpus when --store does not exist. Writes `followups-<way>.json` per way and
`followups.json` / `followups.md` under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

PAIRS = [  # first question, follow-up, what the follow-up's answer should name
    ("Who founded the Zorblax Company?", "Where was she born?", "Oskvale"),
    ("Who designed the Glass Library?", "Where was he born?", "Pellmoor"),
    ("What is the capital of Elumia?", "What is it famous for?", "Glass Library"),
    ("Who discovered Ferro's Comet?", "Which bakery did he open?", "Ferro Bakery"),
    ("Who wrote the opera The Heron?", "Where was she born?", "Kessa"),
    ("Which river does the Renn Bridge cross?", "Where does it rise?", "Korrin Hills"),
]


def ways():
    """Each way: (store, options, question, turns) -> (the Asked answer, the text the model was asked)."""
    from pced.cli.chat import follow_up_query
    from pced.pipeline import ask, ask_candidates

    def with_turn(question, turns):
        previous, answer = turns[-1]
        return f"Q: {previous}\nA: {answer}\nQ: {question}"

    def whole_history(store, options, question, turns):
        text = "".join(f"Q: {q}\nA: {a}\n" for q, a in turns) + f"Q: {question}"
        return ask(store, text, options), text

    def retrieval_with_the_turn(store, options, question, turns):
        candidates = store.retrieve(with_turn(question, turns), options.retriever, top_k=options.top_k,
                                    top_n=options.top_n, rerank=options.rerank)
        return ask_candidates(store.generator_for(options.backend, options.backend_settings), candidates, question, options), question

    def retrieval_and_prompt_with_the_turn(store, options, question, turns):
        text = with_turn(question, turns)
        return ask(store, text, options), text

    return {
        "alone": lambda store, options, question, turns: (ask(store, question, options), question),
        "whole history": whole_history,
        "retrieval with the turn": retrieval_with_the_turn,
        "retrieval and prompt with the turn": retrieval_and_prompt_with_the_turn,
        "retrieval with the names the answer gave (pced chat)": lambda store, options, question, turns: (
            ask(store, question, options, query=follow_up_query(question, turns)), question),
    }


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def write_table(out: Path) -> str:
    table = {}
    for name in ways():
        path = out / f"followups-{slug(name)}.json"
        if path.is_file():
            table[name] = json.loads(path.read_text())
    lines = ["| way | follow-ups answered | repeat the previous answer | suffix tokens a row (median) | "
             "time to first token (s, median) | total (s, median) |", "|---|---|---|---|---|---|"]
    for name, rows in table.items():
        lines.append(f"| {name} | {sum(r['found'] for r in rows)} / {len(rows)} | "
                     f"{sum(r['repeats_previous'] for r in rows)} | {statistics.median(r['suffix_tokens'] for r in rows):.0f} | "
                     f"{statistics.median(r['ttft_s'] for r in rows):.2f} | {statistics.median(r['total_s'] for r in rows):.2f} |")
    text = "\n".join(lines)
    (out / "followups.md").write_text(text + "\n")
    (out / "followups.json").write_text(json.dumps({"ways": table}, indent=1) + "\n")
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", default="/tmp/demo-store")
    parser.add_argument("--out", default="runs/daily-use")
    parser.add_argument("--ways", default=None, help="comma list of ways to run (default: all)")
    parser.add_argument("--table", action="store_true", help="only write the table of the ways already run")
    args = parser.parse_args()
    store_dir, out = Path(args.store), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.table:
        print(write_table(out))
        return 0
    selected = {name: way for name, way in ways().items() if args.ways is None or name in args.ways.split(",")}
    if not (store_dir / "manifest.json").is_file():
        from importlib import resources

        corpus = resources.files("pced") / "data" / "demo_corpus.jsonl"
        subprocess.run([sys.executable, "-m", "pced.cli", "index", str(corpus), "--out", str(store_dir)], check=True,
                       env={**os.environ})
    from pced.options import AskOptions
    from pced.pipeline import ask
    from pced.store import DocumentStore

    store = DocumentStore.open(store_dir)
    options = AskOptions()  # what `pced chat STORE` asks with
    builder = store.generator_for(options.backend, options.backend_settings).builder
    cache = out / "firsts.json"
    firsts = json.loads(cache.read_text()) if cache.is_file() else {}
    for first, _, _ in PAIRS:
        if first not in firsts:
            firsts[first] = ask(store, first, options).answer().text.strip()
            cache.write_text(json.dumps(firsts, indent=1) + "\n")
        print(f"Q: {first}\nA: {firsts[first]}\n", flush=True)
    for name, way in selected.items():
        rows = []
        for first, question, expected in PAIRS:
            turns = [(first, firsts[first])]
            asked, prompt = way(store, options, question, turns)
            answer = asked.answer()
            text = answer.text.strip()
            rows.append({"first": first, "previous": firsts[first], "question": question, "expected": expected,
                         "answer": text, "found": expected.lower() in text.lower(),
                         "repeats_previous": bool(firsts[first]) and firsts[first].lower()[:40] in text.lower(),
                         "retrieved": [c.document.id for c in asked.candidates],
                         "suffix_tokens": len(builder.suffix_ids(prompt, with_context=True)),
                         "ttft_s": answer.timings["ttft_s"], "total_s": answer.timings["total_s"]})
            print(f"[{name}] Q: {question}\n  A: {text}\n  ({'found' if rows[-1]['found'] else 'missed'} {expected}; "
                  f"{rows[-1]['suffix_tokens']} suffix tokens a row; first token {answer.timings['ttft_s']:.2f} s)",
                  flush=True)
        (out / f"followups-{slug(name)}.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(write_table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
