"""Greedy agreement between an answer read from stored caches and one from a fresh prefill, with
transformers alone (scripts/gpu_check.sh runs it on a GPU in bfloat16; docs/gpu.md, "Numerics").

    python scripts/gpu_agreement.py --random-model llama-3.1-8b --tokenizer TOK --device cuda --dtype bfloat16 \
        --docs 8 --doc-tokens 512 --new-tokens 32 --out OUT/agreement

For each of ``--docs`` documents: the store's caches of the prefix and the document (computed by one
forward over prefix + document, saved in the model's dtype, read back), the question's suffix
computed on top of them, and ``--new-tokens`` greedy tokens; against the same prompt prefilled in one
forward. Per document: whether the answers are identical, their common prefix, the largest difference
of the first step's logits, and at the first different token the fresh prefill's top-2 margin there
(a flip is a near-tie decided by rounding, not a wrong cache). ``--model PATH`` reads a local model
instead of a random one. Writes agreement.json and agreement.md under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

WORDS = ("harbor lighthouse island copper river market winter founder painter council archive bridge "
         "northern shore festival merchant ledger orchard quarry mill chapel garrison beacon tide").split()
QUESTION = "What does the document say about the harbor, and who is named in it?"


def document(tokenizer, tokens: int, rng: random.Random) -> str:
    words = []
    while len(tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]) < tokens:
        words += [rng.choice(WORDS) for _ in range(8)] + ["."]
    return " ".join(words)


def fresh_logits(llm, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return llm.model(torch.tensor([ids], device=llm.device)).logits[0, -1].float()


def compare(llm, store, builder, text: str, new_tokens: int) -> dict:
    from pced.decoding.rule import RuleConfig
    from pced.decoding.sampling import SamplingConfig
    from pced.methods.concat import PlainGeneration
    from pced.methods.pced import Expert, PCEDGeneration

    sampling = SamplingConfig(max_new_tokens=new_tokens, ignore_eos=True)
    stored_kv = store.load(store.digests([text])[0])
    stored = PCEDGeneration(llm, store.prefix(), [Expert("d", 0.8, lambda: stored_kv)], builder.suffix_ids(QUESTION),
                            builder.suffix_ids(QUESTION, False), RuleConfig(beta=0.0, gamma=0.0), sampling)
    first_stored = None
    for _ in stored:
        if first_stored is None:
            first_stored = stored.last_logits[-1].float()  # the expert's row
    prompt = builder.prompt_ids([text], QUESTION)
    fresh = PlainGeneration(llm, prompt, sampling)
    first_fresh = None
    for _ in fresh:
        if first_fresh is None:
            first_fresh = fresh.last_logits[-1].float()
    a, b = stored.answer().token_ids, fresh.answer().token_ids
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    row = {"identical": a == b, "common_prefix": common, "new_tokens": len(b),
           "first_logits_max_diff": float((first_stored - first_fresh).abs().max()),
           "first_token_agrees": bool(a[:1] == b[:1]), "margin_at_divergence": None}
    if common < min(len(a), len(b)):
        top2 = torch.topk(fresh_logits(llm, prompt + b[:common]), 2).values
        row["margin_at_divergence"] = float(top2[0] - top2[1])
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a local model folder")
    source.add_argument("--random-model", help="a random-weight shape (pced bench's: llama-3.1-8b, tiny, ...)")
    parser.add_argument("--tokenizer", help="the random model's tokenizer folder")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--doc-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    from pced.kv.store import KVStore
    from pced.text.prompts import RAG_TEMPLATE, PromptBuilder

    if args.model:
        from pced.llm import load_model

        llm = load_model(args.model, device=args.device, dtype=args.dtype)
    else:
        from pced.bench.random_model import random_model

        llm = random_model(args.random_model, device=args.device, dtype=args.dtype, tokenizer=args.tokenizer)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    builder = PromptBuilder(llm.tokenizer, RAG_TEMPLATE)
    rng = random.Random(0)
    texts = [document(llm.tokenizer, args.doc_tokens, rng) for _ in range(args.docs)]
    store = KVStore(out / "store", llm, builder, storage_dtype=args.dtype)
    store.add(texts, progress=False)
    rows = [compare(llm, store, builder, text, args.new_tokens) for text in texts]
    summary = {"model": llm.name, "device": str(llm.device), "dtype": args.dtype, "docs": args.docs,
               "doc_tokens": args.doc_tokens, "new_tokens": args.new_tokens,
               "identical_answers": sum(r["identical"] for r in rows),
               "first_tokens_agree": sum(r["first_token_agrees"] for r in rows),
               "mean_common_prefix": sum(r["common_prefix"] for r in rows) / len(rows),
               "max_first_logits_diff": max(r["first_logits_max_diff"] for r in rows), "rows": rows}
    lines = [f"# Stored caches against a fresh prefill: {llm.name}, {args.dtype} on {llm.device}", "",
             f"{args.docs} documents of {args.doc_tokens} tokens, {args.new_tokens} greedy tokens each.", "",
             f"- identical answers: {summary['identical_answers']} of {args.docs}",
             f"- first tokens equal: {summary['first_tokens_agree']} of {args.docs}",
             f"- mean common prefix: {summary['mean_common_prefix']:.1f} of {args.new_tokens} tokens",
             f"- largest first-step logit difference: {summary['max_first_logits_diff']:.3g}", "",
             "| doc | identical | common prefix | first-step max diff | fresh top-2 margin at the first difference |",
             "|---|---|---|---|---|"]
    for i, r in enumerate(rows):
        margin = "" if r["margin_at_divergence"] is None else f"{r['margin_at_divergence']:.3g}"
        lines.append(f"| {i} | {r['identical']} | {r['common_prefix']} | {r['first_logits_max_diff']:.3g} | {margin} |")
    (out / "agreement.json").write_text(json.dumps(summary, indent=2))
    (out / "agreement.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return summary


if __name__ == "__main__":
    main()
