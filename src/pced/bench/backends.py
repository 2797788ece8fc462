"""``pced bench --backend B``: PCED on several backends side by side (B and those of ``--beside``),
in one run, one question at a time.

On the bench's secret-code documents (``bench.run.secret_code_documents``) at the first
``--doc-tokens``, for each k of ``--ks``: time to first token (document caches read from their
files, each backend's of its own kind; a backend that reads another's caches gets them as its
``Backend.bench_prepare`` says),
decode milliseconds per step and the step's memory-bandwidth floor (the weights as the backend
holds them plus every row's keys and values, over the measured copy bandwidth), medians of
``--repeats``; and the stored bytes per document token of each backend's caches.

Saved as bench_backends.json, .md in ``--out``.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from ..backend import DEFAULT_BACKEND, get_backend
from ..documents import Candidate
from ..errors import UserError
from ..fs import atomic_write_json, atomic_write_text
from ..generator import Generator
from ..llm import LoadedModel
from ..options import AskOptions
from ..pipeline import ask_candidates
from ..sampling import SamplingConfig
from .config import BenchConfig
from .floor import copy_bandwidth, decode_floor_s
from .run import RAG_TEMPLATE, _run, row_tokens, secret_code_documents

TIMES = ("ttft_s", "decode_per_token_s", "total_s", "new_tokens")


def run_backends_bench(llm: LoadedModel, cfg: BenchConfig, entries: list[tuple], model: str | None = None) -> dict:
    """Time each (backend, settings) of ``entries`` in turn at every k. ``llm`` is the torch model the
    documents and question are made with, and the model of every backend that loads models the same
    way (``Backend.model_key``); the others load ``model`` (None: the embedded one), e.g. a file of
    another kind, which is then timed alone (``entries`` that one backend)."""
    root = Path(cfg.out)
    root.mkdir(parents=True, exist_ok=True)
    doc_tokens = cfg.doc_tokens[0]
    docs, question, gold = secret_code_documents(llm, max(cfg.ks), doc_tokens, cfg.seed)
    docs.sort(key=lambda d: d.id not in gold)  # gold first, so every k includes the answer
    texts = [d.render() for d in docs]
    default = get_backend(DEFAULT_BACKEND)
    models = {default.model_key(default.settings()): llm}
    generators, labels, store_bytes, prepared = {}, {}, {}, {}
    for number, (backend, settings) in enumerate(entries, start=1):
        backend = get_backend(backend)
        settings = backend.settings(settings)
        key = backend.model_key(settings)
        if key not in models:
            try:
                models[key] = backend.load_model(model, settings)
            except UserError as exc:  # one beside that is not installed: the others still run
                if number == len(entries):
                    raise
                print(f"pced: bench: {backend.name} skipped ({exc})")
                continue
        timed = models[key]
        label = backend.run_label(settings)
        directory = root / f"{backend.cache_name(settings)}-{timed.name}-L{doc_tokens}-{cfg.storage_dtype}"
        generator = Generator(timed, RAG_TEMPLATE, directory, cfg.storage_dtype, backend=backend, settings=settings)
        digests = generator.caches.add(texts, progress=False)
        prepared[label] = backend.bench_prepare(generator, texts)
        generators[label] = generator
        if backend.capabilities.own_caches:
            lengths = [len(generator.builder.encode(generator.builder.context_text([t]))) for t in texts]
            files = [generator.caches.path_for(d) for d in digests]
            store_bytes[label] = sum(f.stat().st_size for f in files) / sum(lengths)
    bandwidth = copy_bandwidth(torch.device("cpu"))
    candidates = [Candidate(d, 0.8 if d.id in gold else 0.5) for d in docs]
    sampling = SamplingConfig(max_new_tokens=cfg.new_tokens, ignore_eos=True)
    results = {"config": asdict(cfg), "backends": {label: {"backend": g.backend.name, "settings": asdict(g.settings),
                                                           "model": g.llm.path, **prepared[label]}
                                                   for label, g in generators.items()},
               "model": llm.name, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
               "doc_tokens": doc_tokens, "bandwidth_gb_s": bandwidth / 1e9, "store_bytes_per_token": store_bytes,
               "latency": []}
    with tqdm(total=len(cfg.ks) * len(generators) * cfg.repeats, desc="bench backends", unit="answer") as bar:
        for k in cfg.ks:
            row = {"k": k}
            for label, generator in generators.items():
                backend = generator.backend
                options = AskOptions(backend=backend.name, backend_settings=generator.settings, sampling=sampling)
                runs = []
                for _ in range(cfg.repeats):
                    runs.append(_run(ask_candidates(generator, candidates[:k], question, options).generation))
                    bar.update(1)
                row[label] = {key: float(statistics.median(r[key] for r in runs)) for key in TIMES}
                rows = row_tokens(generator, "pced", [doc_tokens] * k, question)
                weights = backend.weights_bytes(generator.llm)
                if weights is None:  # a torch model: its parameters and KV in its own dtype
                    row[label]["floor_s"] = decode_floor_s(generator.llm.model, rows, bandwidth)
                else:
                    row[label]["floor_s"] = (weights + backend.kv_bytes_per_token(generator) * sum(rows)) / bandwidth
            results["latency"].append(row)
    atomic_write_json(root / "bench_backends.json", results)
    atomic_write_text(root / "bench_backends.md", markdown_report(results))
    return results


def markdown_report(results: dict) -> str:
    cfg = results["config"]
    names = list(results["backends"])
    models = "; ".join(f"{label}: {Path(b['model']).name}" for label, b in results["backends"].items())
    lines = [f"# pced bench, backends side by side: {results['model']}", "",
             f"{results['cpu_count']} CPUs, {results['threads']} threads; documents of {results['doc_tokens']} tokens; "
             f"{cfg['new_tokens']} new tokens per answer (EOS ignored); medians of {cfg['repeats']}; models ({models}); "
             f"copy bandwidth {results['bandwidth_gb_s']:.1f} GB/s.", "",
             "| k | " + " | ".join(f"{n} TTFT s | {n} ms/step (floor)" for n in names) + " |",
             "|---|" + "---|---|" * len(names)]
    for row in results["latency"]:
        cells = [f"{row[n]['ttft_s']:.3f} | {row[n]['decode_per_token_s'] * 1000:.1f} ({row[n]['floor_s'] * 1000:.1f})"
                 for n in names]
        lines.append(f"| {row['k']} | " + " | ".join(cells) + " |")
    lines += ["", "Stored bytes per document token: " + ", ".join(
        f"{n} {b:,.0f}" for n, b in results["store_bytes_per_token"].items()) + ".", ""]
    return "\n".join(lines)
