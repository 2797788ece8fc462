"""Decode-step timings: the eager, static and compiled steps of PCED's rows, same run, same model.

``python -m pced.bench.step --experts 8 --steps 64 --out runs/step`` prints a Markdown table and
saves ``step.json`` and ``step.md``: median ms per decode step (one token for all k + 1 rows) of
each step kind, the compiled step's dynamo recompilations over the measured steps (after a
warm-up of 2 steps), and the one-time compile cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ..kv.buffer import BufferCache
from ..kv.segment import DocKV
from ..llm import DECODE_STEPS, load_model
from ..backends.rows import ExpertRows


def synthetic_caches(llm, experts: int, doc_tokens: int, prefix_tokens: int, seed: int = 0):
    """Random keys/values of the model's cache shape: decode cost does not depend on their values."""
    generator = torch.Generator().manual_seed(seed)
    probe = BufferCache.allocate(llm.model, 1, 1)
    layers, _, heads, _, dim = probe.key_buffer.shape

    def kv(tokens):
        shape = (layers, heads, tokens, dim)
        return DocKV(torch.randn(shape, generator=generator).to(llm.dtype) * 0.5,
                     torch.randn(shape, generator=generator).to(llm.dtype) * 0.5)

    return kv(prefix_tokens), [kv(doc_tokens - 7 * i) for i in range(experts)]


def time_steps(llm, prefix, docs, suffix, steps: int, warmup: int) -> dict:
    rows = ExpertRows(llm, prefix, [lambda kv=kv: kv for kv in docs], suffix, None, steps + warmup + 1)
    logits = rows.prefill()
    token = int(torch.argmax(logits[0]))
    times, tokens = [], []
    from torch._dynamo.utils import counters

    for index in range(warmup + steps):
        if index == warmup:
            recompiles_before = counters["stats"]["unique_graphs"]
        started = time.perf_counter()
        logits = rows.advance(token)
        token = int(torch.argmax(logits[0]))  # the step's read
        if index >= warmup:
            times.append((time.perf_counter() - started) * 1000)
        tokens.append(token)
    return {"ms_per_step_median": statistics.median(times), "ms_per_step_min": min(times),
            "graphs_compiled_after_warmup": counters["stats"]["unique_graphs"] - recompiles_before, "tokens": tokens}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local model directory (default: the embedded model)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--doc-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--kinds", default=",".join(DECODE_STEPS))
    parser.add_argument("--out", default="runs/step")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    llm = load_model(args.model, device="cpu" if not torch.cuda.is_available() else None)
    prefix, docs = synthetic_caches(llm, args.experts, args.doc_tokens, 24)
    suffix = llm.tokenizer("Question: which town was the founder born in? Answer:", add_special_tokens=False)["input_ids"]
    results = {"model": llm.name, "device": str(llm.device), "dtype": str(llm.dtype), "experts": args.experts,
               "doc_tokens": args.doc_tokens, "steps": args.steps, "warmup": args.warmup, "threads": torch.get_num_threads(),
               "torch": torch.__version__, "kinds": {}}
    for kind in args.kinds.split(","):
        llm.decode_step, llm.compiled_step = kind, None
        started = time.perf_counter()
        results["kinds"][kind] = time_steps(llm, prefix, docs, suffix, args.steps, args.warmup)
        results["kinds"][kind]["wall_s_with_warmup"] = time.perf_counter() - started
    first = next(iter(results["kinds"].values()))["tokens"]
    for kind, row in results["kinds"].items():
        row["same_tokens_as_first"] = row.pop("tokens") == first
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step.json").write_text(json.dumps(results, indent=2))
    lines = [f"Decode step, {results['model']} on {results['device']} ({results['dtype']}, {results['threads']} threads), "
             f"k = {args.experts} experts of ~{args.doc_tokens} tokens, {args.steps} steps after {args.warmup} warm-up",
             "", "| step | median ms/step | min ms/step | graphs compiled after warm-up | wall s (incl. warm-up, compile) | same tokens |",
             "|---|---|---|---|---|---|"]
    for kind, row in results["kinds"].items():
        lines.append(f"| {kind} | {row['ms_per_step_median']:.1f} | {row['ms_per_step_min']:.1f} | "
                     f"{row['graphs_compiled_after_warmup']} | {row['wall_s_with_warmup']:.1f} | {row['same_tokens_as_first']} |")
    (out / "step.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
