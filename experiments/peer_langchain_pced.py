"""The authors' implementation beside ours: PyPI ``langchain-pced`` on exactly a ``pced bench`` run's
model, documents and question.

``langchain-pced`` 0.2.0 runs PCED on transformers' continuous-batching internals: a paged KV cache
and, per question, a prefill of every document (shared prefix forked once, then all documents in
one packed forward); the question is fed to every row at the first decode step. It needs
transformers 5.0-5.2 (5.3 renamed ``PagedAttentionCache``'s arguments), so it runs in its own
environment and imports nothing of pced; the bench leaves what it needs in ``peer_inputs.json``:

    pced bench ... --out runs/bench                               # ours; writes bench.json + peer_inputs.json
    python -m venv /tmp/peer && /tmp/peer/bin/pip install torch==2.13.0 \\
        transformers==5.2.0 tokenizers==0.22.2 langchain-pced==0.2.0
    /tmp/peer/bin/python experiments/peer_langchain_pced.py runs/bench [--attn paged|sdpa]

For each k of the bench (first k documents, the gold one first, relevance 0.8 for gold and 0.5
for the others, as in the bench) it times the peer's ``prefill_cb_with_fork`` and
``decode_from_cache_cb_streaming`` as its own ``PCEDLLM`` calls them: TTFT = prefill + the step
that consumes the question and yields the first token; decode per token over the remaining
``new_tokens - 1`` tokens (an end-of-sequence id the model cannot emit keeps the length fixed);
medians of the bench's repeats after one untimed warm-up. Writes ``peer.json`` and ``peer.md`` (a
side-by-side table with the bench's own PCED numbers) into the run folder.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

BLOCK = 32  # transformers' default paged-cache block size


@torch.no_grad()
def build_model(spec: dict, attn: str, device: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    dtype = getattr(torch, spec["dtype"])
    if spec["dir"]:
        model = AutoModelForCausalLM.from_pretrained(spec["dir"], dtype=dtype, attn_implementation=attn,
                                                     local_files_only=True).to(device)
        return model.eval()
    fields = {k: v for k, v in spec["random_config"].items() if k not in ("architectures", "transformers_version")}
    config = LlamaConfig(**fields)
    config._attn_implementation = attn
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    generator = torch.Generator(device=device).manual_seed(spec["seed"])
    for param in model.parameters():  # the bench's random weights: normal, std 0.02 (speed ignores values)
        param.normal_(0.0, 0.02, generator=generator)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RotaryEmbedding"):
                setattr(parent, name, type(child)(config).to(device))
    return model.eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def one_answer(model, tokenizer, length: dict, k: int, new_tokens: int, device: str) -> dict:
    from langchain_pced.core import prefill_cb_with_fork
    from langchain_pced.core.decode_cb import decode_from_cache_cb_streaming
    from transformers import GenerationConfig

    never = model.config.vocab_size + 7  # an end-of-sequence id no step can produce: fixed-length answers
    suffixes = [[]] + [list(ids) for ids in length["doc_ids"][:k]]  # row 0: the amateur (no document)
    # The paged cache is allocated per question; left alone it takes up to 4096 blocks (80% of free
    # memory), which on a CPU costs seconds of page faults. Sized to exactly what the question needs
    # (each row's prompt + question + answer, rounded up to blocks, as ensure_capacity reserves), the
    # peer pays the least it can: its best case.
    rows = [len(length["prefix_ids"]) + len(s) + len(length["question_ids"]) + new_tokens for s in suffixes]
    blocks = sum(math.ceil(n / BLOCK) + 2 for n in rows) + math.ceil(len(length["prefix_ids"]) / BLOCK) + 4
    config = GenerationConfig(max_new_tokens=new_tokens, eos_token_id=never, do_sample=False, num_blocks=blocks,
                              block_size=BLOCK, max_batch_tokens=max(rows) * len(rows))
    scores = torch.tensor(length["scores"][:k], device=device, dtype=torch.float32)
    sync(device)
    started = time.perf_counter()
    cache, past_lens, states = prefill_cb_with_fork(model, config, length["prefix_ids"], suffixes,
                                                    len(length["question_ids"]))
    sync(device)
    prefilled = time.perf_counter()
    stream = decode_from_cache_cb_streaming(model, tokenizer, cache, config, length["question_ids"], past_lens,
                                            states, beta=None, retrieval_scores=scores, gamma=2.5)
    tokens = 0
    first = None
    for _ in stream:
        tokens += 1
        if first is None:
            first = time.perf_counter()
    ended = time.perf_counter()
    del cache
    return {"ttft_s": first - started, "prefill_s": prefilled - started, "total_s": ended - started,
            "new_tokens": tokens, "decode_per_token_s": (ended - first) / (tokens - 1) if tokens > 1 else float("nan")}


def ours(bench: dict, doc_tokens: int, k: int) -> dict:
    for length in bench.get("lengths", []):
        if length["doc_tokens"] != doc_tokens:
            continue
        for row in length["rows"]:
            if row["k"] == k and row.get("pced"):
                return row["pced"]
    return {}


def fmt(value, digits: int = 3) -> str:
    return "–" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a pced bench output folder (with peer_inputs.json)")
    parser.add_argument("--attn", default="paged|sdpa",
                        help="attention implementation (default paged|sdpa; the package's own default "
                             "paged|flash_attention_2 needs flash-attn)")
    parser.add_argument("--device", default=None, help="default: the bench's device")
    parser.add_argument("--repeats", type=int, default=None, help="default: the bench's")
    args = parser.parse_args(argv)
    path = args.run / "peer_inputs.json"
    if not path.is_file():
        print(f"peer: {path} not found; run `pced bench --out {args.run}` first", file=sys.stderr)
        return 2
    try:
        import langchain_pced
        import transformers
    except ImportError as exc:
        print(f"peer: {exc}; install langchain-pced==0.2.0 with transformers==5.2.0 (see this script's docstring)",
              file=sys.stderr)
        return 2
    inputs = json.loads(path.read_text())
    bench = json.loads((args.run / "bench.json").read_text()) if (args.run / "bench.json").is_file() else {}
    spec = inputs["model"]
    device = args.device or spec["device"]
    repeats = args.repeats or inputs["repeats"]
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    tokenizer = AutoTokenizer.from_pretrained(spec["dir"] or spec["tokenizer_dir"], local_files_only=True)
    if device == "cpu" and bench.get("threads"):
        torch.set_num_threads(int(bench["threads"]))  # the bench's own thread count: a fair CPU comparison
    model = build_model(spec, args.attn, device)
    results = {"package": f"langchain-pced {getattr(langchain_pced, '__version__', '0.2.0')}",
               "transformers": transformers.__version__, "torch": torch.__version__, "attn": args.attn,
               "device": device, "model": spec["name"], "dtype": spec["dtype"], "repeats": repeats, "rows": []}
    for length in inputs["lengths"]:
        for k in inputs["ks"]:
            row = {"doc_tokens": length["doc_tokens"], "k": k}
            try:
                one_answer(model, tokenizer, length, k, inputs["new_tokens"], device)  # warm-up, untimed
                runs = [one_answer(model, tokenizer, length, k, inputs["new_tokens"], device) for _ in range(repeats)]
            except Exception as exc:  # noqa: BLE001 -- report what the peer could not run (memory, API) and go on
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                results["rows"].append(row)
                print(f"peer: L={length['doc_tokens']} k={k}: {row['error']}", file=sys.stderr)
                continue
            row.update({key: statistics.median(r[key] for r in runs) for key in runs[0]})
            results["rows"].append(row)
            print(f"peer: L={length['doc_tokens']} k={k}: TTFT {row['ttft_s']:.3f} s, "
                  f"decode {row['decode_per_token_s'] * 1000:.1f} ms/token", file=sys.stderr)
    (args.run / "peer.json").write_text(json.dumps(results, indent=2))
    lines = [f"# PCED: pced against the authors' langchain-pced ({results['model']}, {results['dtype']}, {device})", "",
             (f"{results['package']} on transformers {results['transformers']}, attention `{args.attn}`; "
              f"medians of {repeats}. pced's numbers come from the same folder's bench.json (its own run)."), "",
             ("| L | k | langchain-pced TTFT (s) | of which prefill (s) | pced TTFT, page cache (s) | pced TTFT, resident (s) "
              "| langchain-pced decode (ms/token) | pced decode (ms/token) |"),
             "|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        mine = ours(bench, row["doc_tokens"], row["k"])
        if "error" in row:
            lines.append(f"| {row['doc_tokens']} | {row['k']} | {row['error']} | | {fmt(mine.get('ttft_s'))} "
                         f"| {fmt(mine.get('ttft_resident_s'))} | | {fmt(mine.get('decode_per_token_s', float('nan')) * 1000, 1)} |")
            continue
        lines.append(f"| {row['doc_tokens']} | {row['k']} | {fmt(row['ttft_s'])} | {fmt(row['prefill_s'])} "
                     f"| {fmt(mine.get('ttft_s'))} | {fmt(mine.get('ttft_resident_s'))} "
                     f"| {fmt(row['decode_per_token_s'] * 1000, 1)} "
                     f"| {fmt(mine.get('decode_per_token_s', float('nan')) * 1000, 1)} |")
    (args.run / "peer.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
