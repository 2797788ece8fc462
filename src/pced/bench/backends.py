"""``pced bench --backend llamacpp``: PCED on llama.cpp beside transformers (and vLLM when it is
installed), in one run, one question at a time.

On the bench's secret-code documents (``bench.run.secret_code_documents``) at the first
``--doc-tokens``, for each k of ``--ks``: time to first token (document caches read from their
files: transformers' KV tensors, llama.cpp's sequence states; vLLM's prefix cache, prefilled
before timing), decode milliseconds per step and the step's memory-bandwidth floor (the weights as
the backend holds them plus every row's keys and values, over the measured copy bandwidth),
medians of ``--repeats``; and the stored bytes per document token of each backend's caches.

Saved as bench_backends.json, .md in ``--out``.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from ..documents import Candidate
from ..fs import atomic_write_json, atomic_write_text
from ..llm import LoadedModel
from ..options import AskOptions, LlamaSettings
from ..pipeline import ask_candidates
from ..sampling import SamplingConfig
from .config import BenchConfig
from .floor import copy_bandwidth, decode_floor_s
from .run import _run, bench_generator, row_tokens, secret_code_documents

TIMES = ("ttft_s", "decode_per_token_s", "total_s", "new_tokens")


def run_backends_bench(llm: LoadedModel, cfg: BenchConfig, llama: LlamaSettings = LlamaSettings(),
                       backends: tuple[str, ...] = ("transformers", "llamacpp", "vllm"), gguf=None) -> dict:
    """``gguf``: the ``LlamaModel`` to time on llama.cpp (default: the embedded model's GGUF, as it
    ships); a GGUF of another family is timed alone (``backends=("llamacpp",)``, ``llm`` that model)."""
    from ..generator import LlamaGenerator
    from ..backends.llamacpp.model import LlamaModel

    root = Path(cfg.out)
    root.mkdir(parents=True, exist_ok=True)
    doc_tokens = cfg.doc_tokens[0]
    docs, question, gold = secret_code_documents(llm, max(cfg.ks), doc_tokens, cfg.seed)
    docs.sort(key=lambda d: d.id not in gold)  # gold first, so every k includes the answer
    texts = [d.render() for d in docs]
    generators = {}
    if "vllm" in backends:
        try:
            from ..backends.vllm.engine import shared_engine

            engine = shared_engine(llm.path)
            generators["vllm"] = bench_generator(llm, root, doc_tokens, cfg.storage_dtype)
            engine.warm_up(generators["vllm"].builder, texts)
        except ValueError as exc:  # vLLM not installed: the other backends still run
            print(f"pced: bench: skipping vllm ({exc})")
    if "transformers" in backends:
        generators["transformers"] = bench_generator(llm, root, doc_tokens, cfg.storage_dtype)
    gguf = gguf if gguf is not None else LlamaModel(None, llama)  # the embedded model's GGUF, as it ships
    generators["llamacpp"] = LlamaGenerator(gguf, "rag", root / f"llamacpp-{gguf.name}-L{doc_tokens}-{llama.cache_type}", llama)
    store_bytes = {}
    for name, generator in generators.items():
        digests = generator.caches.add(texts, progress=False)
        if name == "vllm":
            continue
        lengths = [len(generator.builder.encode(generator.builder.context_text([t]))) for t in texts]
        files = [generator.caches.path_for(d) for d in digests]
        store_bytes[name] = sum(f.stat().st_size for f in files) / sum(lengths)
    bandwidth = copy_bandwidth(torch.device("cpu"))
    weights = {"transformers": None, "vllm": None, "llamacpp": os.path.getsize(gguf.path)}
    kv_token = {"llamacpp": generators["llamacpp"].caches.prefix().nbytes / generators["llamacpp"].caches.prefix().n_tokens}
    candidates = [Candidate(d, 0.8 if d.id in gold else 0.5) for d in docs]
    sampling = SamplingConfig(max_new_tokens=cfg.new_tokens, ignore_eos=True)
    results = {"config": asdict(cfg), "llamacpp": asdict(llama), "model": llm.name, "gguf": gguf.path,
               "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "doc_tokens": doc_tokens,
               "bandwidth_gb_s": bandwidth / 1e9, "store_bytes_per_token": store_bytes, "latency": []}
    order = [b for b in ("transformers", "llamacpp", "vllm") if b in generators]
    with tqdm(total=len(cfg.ks) * len(order) * cfg.repeats, desc="bench backends", unit="answer") as bar:
        for k in cfg.ks:
            row = {"k": k}
            for name in order:
                generator = generators[name]
                options = AskOptions(backend=name, sampling=sampling, llamacpp=llama)
                runs = []
                for _ in range(cfg.repeats):
                    runs.append(_run(ask_candidates(generator, candidates[:k], question, options).generation))
                    bar.update(1)
                row[name] = {key: float(statistics.median(r[key] for r in runs)) for key in TIMES}
                rows = row_tokens(generator, "pced", [doc_tokens] * k, question)
                if name == "llamacpp":
                    floor = (weights["llamacpp"] + kv_token["llamacpp"] * sum(rows)) / bandwidth
                else:
                    floor = decode_floor_s(llm.model, rows, bandwidth)
                row[name]["floor_s"] = floor
            results["latency"].append(row)
    atomic_write_json(root / "bench_backends.json", results)
    atomic_write_text(root / "bench_backends.md", markdown_report(results))
    return results


def markdown_report(results: dict) -> str:
    cfg = results["config"]
    names = [b for b in ("transformers", "llamacpp", "vllm") if b in results["latency"][0]]
    lines = [f"# pced bench --backend llamacpp: {results['model']}", "",
             f"{results['cpu_count']} CPUs, {results['threads']} threads; documents of {results['doc_tokens']} tokens; "
             f"{cfg['new_tokens']} new tokens per answer (EOS ignored); medians of {cfg['repeats']}; llama.cpp KV cache "
             f"{results['llamacpp']['cache_type']} ({Path(results['gguf']).name}); copy bandwidth "
             f"{results['bandwidth_gb_s']:.1f} GB/s.", "",
             "| k | " + " | ".join(f"{n} TTFT s | {n} ms/step (floor)" for n in names) + " |",
             "|---|" + "---|---|" * len(names)]
    for row in results["latency"]:
        cells = [f"{row[n]['ttft_s']:.3f} | {row[n]['decode_per_token_s'] * 1000:.1f} ({row[n]['floor_s'] * 1000:.1f})"
                 for n in names]
        lines.append(f"| {row['k']} | " + " | ".join(cells) + " |")
    lines += ["", "Stored bytes per document token: " + ", ".join(
        f"{n} {b:,.0f}" for n, b in results["store_bytes_per_token"].items()) + ".", ""]
    return "\n".join(lines)
