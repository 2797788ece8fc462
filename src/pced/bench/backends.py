"""``pced bench --backend B``: PCED on several backends side by side (B and those of ``--beside``),
in one run, one question at a time.

On the bench's secret-code documents (``bench.run.secret_code_documents``) at the first
``--doc-tokens``, for each k of ``--ks``, every repeat a question not asked before (after
``Backend.bench_forget``: an engine's prefix cache emptied): time to first token (document caches
read from their files, each backend's of its own kind; a backend that reads another's caches gets
them as its ``Backend.bench_prepare`` says) and decode milliseconds per step, medians of ``--repeats``, each
beside its floor (``pced.bench.floors``: the bytes and FLOPs of each backend's
``Backend.work_shape`` over this machine's limits, measured once and cached by
``pced.bench.machine``) and measured / floor; the rate of a backend's own kernels where it has them
(``Backend.bench_kernel_step``), reported beside; and the stored bytes per document token of each
backend's caches.

Saved as bench_backends.json, .md and .png in ``--out``.
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
from ..decoding.sampling import SamplingConfig
from .backends_report import markdown_report, plot
from .config import BenchConfig
from .floors import decode_work
from .machine import machine_name
from .run import RAG_TEMPLATE, _run, fresh_question, secret_code_documents
from .run_floors import RunFloors, method_spans

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
    generators, store_bytes, prepared, files, lengths = {}, {}, {}, {}, {}
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
        files[label] = [generator.caches.path_for(d) for d in digests]
        lengths[label] = [len(generator.builder.encode(generator.builder.context_text([t]))) for t in texts]
        if backend.capabilities.own_caches:
            store_bytes[label] = sum(f.stat().st_size for f in files[label]) / sum(lengths[label])
    floors, shapes, spans, kernels = _floors(generators, lengths, question, cfg)
    candidates = [Candidate(d, 0.8 if d.id in gold else 0.5) for d in docs]
    sampling = SamplingConfig(max_new_tokens=cfg.new_tokens, ignore_eos=True)
    results = {"config": asdict(cfg), "backends": {label: {"backend": g.backend.name, "settings": asdict(g.settings),
                                                           "model": g.llm.path, **prepared[label]}
                                                   for label, g in generators.items()},
               "model": llm.name, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
               "doc_tokens": doc_tokens, "bandwidth_gb_s": floors.limits.memory_bandwidth / 1e9,
               "store_bytes_per_token": store_bytes, "machine": floors.header(),
               "machine_name": machine_name(floors.limits.key), "floors": floors.to_json(),
               "work_shapes": {label: shape.to_json() for label, shape in shapes.items() if shape is not None},
               "kernel_flop_s": kernels, "latency": []}
    numbers = iter(range(1, 1_000_000))
    with tqdm(total=len(cfg.ks) * len(generators) * cfg.repeats, desc="bench backends", unit="answer") as bar:
        for k in cfg.ks:
            row = {"k": k}
            for label, generator in generators.items():
                backend = generator.backend
                options = AskOptions(backend=backend.name, backend_settings=generator.settings, sampling=sampling)
                runs = []
                for _ in range(cfg.repeats):
                    backend.bench_forget(generator)
                    asked = fresh_question(question, next(numbers))
                    runs.append(_run(ask_candidates(generator, candidates[:k], asked, options).generation))
                    bar.update(1)
                row[label] = {key: float(statistics.median(r[key] for r in runs)) for key in TIMES}
                if shapes[label] is not None:
                    floors.annotate(row[label], shapes[label], spans[label, k], cfg.new_tokens,
                                    backend.bench_cache_bytes(generator, files[label][:k]))
            results["latency"].append(row)
    atomic_write_json(root / "bench_backends.json", results)
    atomic_write_text(root / "bench_backends.md", markdown_report(results))
    plot(results, root)
    return results


def _floors(generators: dict, lengths: dict, question: str, cfg: BenchConfig):
    """Each backend's work and rows at every k, this machine's limits for them (measured once,
    cached), and the rate of each backend's own kernels at k + 1 rows where it has its own."""
    shapes = {label: g.backend.work_shape(g) for label, g in generators.items()}
    spans = {(label, k): method_spans(g.builder, "pced", lengths[label][:k], question)
             for label, g in generators.items() for k in cfg.ks}
    threads = max((g.backend.bench_threads(g.settings) or 0 for g in generators.values()), default=0)
    floors = RunFloors.measure([(shapes[label], s) for (label, _), s in spans.items() if shapes[label] is not None],
                               "cpu", cfg.remeasure, threads=max(threads, torch.get_num_threads()))
    kernels = {}
    for label, generator in generators.items():
        for rows in sorted({1, *(k + 1 for k in cfg.ks)}):
            step = generator.backend.bench_kernel_step(generator, rows) if shapes[label] is not None else None
            if step is not None:
                seconds, cells = step
                kernels.setdefault(label, {})[str(rows)] = decode_work(shapes[label], [cells] * rows)[1] / seconds
    return floors, shapes, spans, kernels
