"""The embedded model on llama.cpp against transformers: the same answers? the same accuracy?

    python experiments/llamacpp_agreement.py --out docs/bench/llamacpp-agreement \
        [--hotpotqa runs/eval/hq20-transformers runs/eval/hq20-llamacpp-f16 runs/eval/hq20-llamacpp-q8_0]

1. The ``pced demo`` questions, with the demo's settings, on one store that holds transformers
   caches and llama.cpp sequence states of both KV cache types (``f16``, ``q8_0``) for the same
   documents: each backend's answer, whether the expected answer is in it, and whether it equals
   transformers' answer token for token. Also each cache type's stored bytes per document token.
2. With ``--hotpotqa``: three ``pced eval`` runs of the same questions (transformers, llama.cpp f16,
   llama.cpp q8_0; made with ``pced eval --dataset hotpotqa --limit 20 --backend ...``), compared
   paired against transformers: identical answers, subspan EM, the paired difference and its 95%
   bootstrap interval.

Transformers runs the GGUF's Q4_1 weights dequantized to float32; llama.cpp multiplies the Q4_1
blocks directly (activations quantized to 8 bits on the way) and keeps keys and values in its
cache type. So the two are close, not equal: an answer may change where two tokens were nearly
tied. Writes agreement.json and agreement.md under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from importlib import resources
from pathlib import Path

from pced.cli.store import DEMO_OPTIONS
from pced.corpus.reader import read_corpus
from pced.evaluation.compare import format_comparison, paired_comparison
from pced.fs import atomic_write_json, atomic_write_text
from pced.backends.llamacpp.settings import LLAMA_CACHE_TYPES, LlamaSettings
from pced.pipeline import ask
from pced.store import DocumentStore, IndexSettings, index_store

DEMO_CORPUS = "demo_corpus.jsonl"


def demo_answers(store_root: Path) -> dict:
    data = resources.files("pced") / "data"
    with resources.as_file(data / DEMO_CORPUS) as corpus_path:
        corpus = read_corpus(corpus_path)
    index_store(corpus, store_root, IndexSettings(), progress=False)
    for cache_type in LLAMA_CACHE_TYPES:
        index_store(corpus, store_root, IndexSettings(), progress=False, backend="llamacpp",
                    backend_settings=LlamaSettings(cache_type=cache_type))
    store = DocumentStore.open(store_root)
    backends = {"transformers": DEMO_OPTIONS}
    for cache_type in LLAMA_CACHE_TYPES:
        backends[f"llamacpp-{cache_type}"] = replace(DEMO_OPTIONS, backend="llamacpp",
                                                     backend_settings=LlamaSettings(cache_type=cache_type))
    rows = []
    for item in json.loads((data / "demo_questions.json").read_text()):
        row = {"question": item["question"], "expected": item["answer"]}
        for name, options in backends.items():
            answer = ask(store, item["question"], options).generation.answer()
            row[name] = {"text": answer.text, "tokens": list(answer.token_ids),
                         "found": item["answer"].lower() in answer.text.lower()}
        for name in backends:
            row[name]["identical"] = row[name]["tokens"] == row["transformers"]["tokens"]
        rows.append(row)
    sizes = {}
    for cache_type in LLAMA_CACHE_TYPES:
        generator = store.generator_for("llamacpp", LlamaSettings(cache_type=cache_type))
        prefix = generator.caches.prefix()
        sizes[f"llamacpp-{cache_type}"] = prefix.nbytes / prefix.n_tokens
    kv = store.generator.caches.prefix()  # float16 keys and values, the store's default
    sizes["transformers"] = kv.nbytes / kv.n_tokens
    return {"questions": rows, "bytes_per_token": sizes}


def eval_records(run: Path) -> dict[str, dict]:
    records = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines() if line.strip()]
    pced = [r for r in records if r["method"] == "pced"]
    if not pced:
        raise SystemExit(f"{run}: no PCED answers in results.jsonl")
    return {str(r["example_id"]): r for r in pced}


def hotpotqa(runs: list[Path]) -> dict:
    labels = ["transformers", *(f"llamacpp-{t}" for t in LLAMA_CACHE_TYPES)][: len(runs)]
    by_label = {label: eval_records(run) for label, run in zip(labels, runs)}
    common = sorted(set.intersection(*(set(r) for r in by_label.values())))
    comparison = paired_comparison([{"config": label, "method": label, "example_id": e, "score": recs[e]["score"]}
                                    for label, recs in by_label.items() for e in common], reference="transformers")
    base = by_label["transformers"]
    identical = {label: sum(recs[e]["prediction"] == base[e]["prediction"] for e in common)
                 for label, recs in by_label.items()}
    return {"runs": {label: str(run) for label, run in zip(labels, runs)}, "n": len(common),
            "identical": identical, "comparison": comparison}


def markdown(results: dict) -> str:
    demo = results["demo"]
    names = [k for k in demo["questions"][0] if k not in ("question", "expected")]
    lines = ["# The embedded model on llama.cpp against transformers", "",
             "## The demo questions (`pced demo`'s settings)", "",
             "| question | expected | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for row in demo["questions"]:
        cells = []
        for name in names:
            mark = "found" if row[name]["found"] else "not found"
            same = "" if name == "transformers" else (", identical" if row[name]["identical"] else ", differs")
            cells.append(f"{row[name]['text'].strip()[:80]!r} ({mark}{same})".replace("|", "\\|"))
        lines.append(f"| {row['question']} | {row['expected']} | " + " | ".join(cells) + " |")
    lines += ["", "Stored bytes per document token: " + ", ".join(
        f"{name} {value:,.0f}" for name, value in demo["bytes_per_token"].items()) + ".", ""]
    if "hotpotqa" in results:
        hq = results["hotpotqa"]
        lines += [f"## HotpotQA, {hq['n']} questions (`pced eval`, PCED's default rule)", "",
                  "Identical answers to transformers': " + ", ".join(
                      f"{label} {count}/{hq['n']}" for label, count in hq["identical"].items() if label != "transformers")
                  + ".", "", format_comparison(hq["comparison"], "")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/llamacpp-agreement"))
    parser.add_argument("--store", type=Path, default=None, help="where to build the demo store (default: a temporary folder)")
    parser.add_argument("--hotpotqa", type=Path, nargs="+", default=None, metavar="RUN",
                        help="pced eval runs: transformers, llama.cpp f16[, llama.cpp q8_0]")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        results = {"demo": demo_answers(args.store or Path(tmp) / "store")}
    if args.hotpotqa:
        results["hotpotqa"] = hotpotqa(args.hotpotqa)
    text = markdown(results)
    atomic_write_json(args.out / "agreement.json", results)
    atomic_write_text(args.out / "agreement.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
