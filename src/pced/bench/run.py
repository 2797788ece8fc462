"""``pced bench``: time to first token, decode cost and storage of PCED against concatenation.

Everything runs in one process and one run so that ratios are fair on a noisy machine; every
number is the median over ``repeats``. Documents come from the synthetic secret-code set (exactly
L tokens each, one gold document), as in the paper's latency benchmark.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..decoding.sampling import SamplingConfig
from .config import BenchConfig
from .report import markdown_report, plot
from ..documents import Candidate, Document
from ..generator import Generator
from ..backends.transformers.bench import weight_bytes
from .machine import machine_name
from .run_floors import RunFloors, method_spans
from ..fs import atomic_write_json, atomic_write_text
from ..kv.tiers import CacheTiers
from ..llm import LoadedModel
from ..options import AskOptions
from ..pipeline import ask_candidates
from ..text.prompts import RAG_TEMPLATE


RESIDENT_GB = 1024.0  # "keep everything": the bench's documents always fit a device that can run them
PAGE_CACHE = CacheTiers(gpu_cache_gb=0)  # no device pool: every answer reads its caches from the host


def evict_from_page_cache(paths: list[Path]) -> None:
    """Drop the files' pages so the next read comes from disk (POSIX_FADV_DONTNEED, no root needed)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _run(generation) -> dict:
    steps = list(generation)
    t = dict(generation.timings)
    n = len(steps)
    t["new_tokens"] = n
    t["decode_per_token_s"] = (t["total_s"] - t["ttft_s"]) / (n - 1) if n > 1 else float("nan")
    return t


def bench_generator(llm: LoadedModel, root: Path, doc_tokens: int, storage_dtype: str,
                    tiers: CacheTiers = PAGE_CACHE) -> Generator:
    """The generator over the bench's KV store for documents of ``doc_tokens`` tokens (RAG template)."""
    return Generator(llm, RAG_TEMPLATE, root / f"kv-L{doc_tokens}-{storage_dtype}", storage_dtype, tiers)


def start(generator: Generator, method: str, docs: list[Document], gold: list[str], question: str, sampling: SamplingConfig):
    """One answer through the question pipeline: the gold document gets relevance 0.8, the others 0.5."""
    candidates = [Candidate(d, 0.8 if d.id in gold else 0.5) for d in docs]
    return ask_candidates(generator, candidates, question, AskOptions(method=method, sampling=sampling)).generation


def fresh_question(question: str, number: int) -> str:
    """A question no earlier one shares a block with: the number leads, so an engine's cached
    blocks of earlier questions end where the question starts."""
    return f"({number}) {question}"


def secret_code_documents(llm: LoadedModel, n_docs: int, doc_tokens: int, seed: int) -> tuple[list[Document], str, list[str]]:
    from ..evaluation.secret_code import make_secret_code

    dataset = make_secret_code(llm.tokenizer, n_docs=n_docs, doc_tokens=doc_tokens, seed=seed)
    example = dataset.examples[0]
    return list(example.documents), example.question, list(example.gold_doc_ids)


def bench_length(llm: LoadedModel, cfg: BenchConfig, doc_tokens: int, root: Path, bar,
                 floors: RunFloors) -> tuple[dict, dict]:
    """The timings of one document length, and its prompt as token ids for ``peer_inputs``."""
    docs, question, gold = secret_code_documents(llm, max(cfg.ks), doc_tokens, cfg.seed)
    # gold first, so every k includes the document that holds the answer
    docs.sort(key=lambda d: d.id not in gold)
    generator = bench_generator(llm, root, doc_tokens, cfg.storage_dtype)
    # the same store with every cache kept on the model's device (pced.kv.tiers): PCED's TTFT with
    # resident caches, the floor of what --gpu-cache-gb buys
    resident = bench_generator(llm, root, doc_tokens, cfg.storage_dtype, CacheTiers(gpu_cache_gb=RESIDENT_GB)) \
        if cfg.resident else None
    store, builder = generator.caches, generator.builder
    started = time.perf_counter()
    digests = store.add([d.render() for d in docs], progress=False)
    index_s = time.perf_counter() - started
    files = [store.path_for(h) for h in digests]
    doc_lengths = [store.load(h).n_tokens for h in digests]  # ranked order, as the rows below take them
    stored_tokens = sum(doc_lengths)
    storage = {
        "index_s": index_s,
        "documents": len(docs),
        "tokens": stored_tokens,
        "bytes": sum(f.stat().st_size for f in files),
    }
    storage["bytes_per_token"] = storage["bytes"] / max(1, stored_tokens)
    sampling = SamplingConfig(max_new_tokens=cfg.new_tokens, ignore_eos=True)
    shape = generator.backend.work_shape(generator)
    rows = []
    for k in cfg.ks:
        chosen, chosen_files = docs[:k], files[:k]
        context_tokens = len(builder.prompt_ids([d.render() for d in chosen], question))
        row = {"k": k, "doc_tokens": doc_tokens, "context_tokens": context_tokens}
        for method in cfg.methods:
            runs, cold_runs, resident_runs = [], [], []
            if method == "pced" and resident is not None:  # fill the pool with this k's documents (not timed)
                list(start(resident, method, chosen, gold, question, sampling))
            for _ in range(cfg.repeats):
                if method == "all" and llm.max_context and context_tokens + cfg.new_tokens > llm.max_context:
                    break
                runs.append(_run(start(generator, method, chosen, gold, question, sampling)))
                if method == "pced" and resident is not None:
                    resident_runs.append(_run(start(resident, method, chosen, gold, question, sampling)))
                if method == "pced" and cfg.cold:
                    evict_from_page_cache(chosen_files)
                    cold_runs.append(_run(start(generator, method, chosen, gold, question, sampling)))
                bar.update(1)
            if not runs:
                row[method] = None  # does not fit the model's window
                bar.update(cfg.repeats)
                continue
            summary = {key: _median([r[key] for r in runs]) for key in runs[0] if isinstance(runs[0][key], (int, float))}
            for name, extra in (("resident", resident_runs), ("cold", cold_runs)):
                if extra:
                    summary[f"ttft_{name}_s"] = _median([r["ttft_s"] for r in extra])
                    summary[f"cache_load_{name}_s"] = _median([r["cache_load_s"] for r in extra])
            # the floors: the caches' stored bytes come from the page cache (all reads none)
            read = 0 if method == "all" else sum(f.stat().st_size for f in chosen_files)
            floors.annotate(summary, shape, method_spans(builder, method, doc_lengths[:k], question), cfg.new_tokens,
                            read, resident=bool(resident_runs))
            row[method] = summary
        rows.append(row)
    peer = {"doc_tokens": doc_tokens, "prefix_ids": list(builder.prefix_ids),
            "doc_ids": [list(builder.context_ids([d.render()])) for d in docs],
            "question_ids": list(builder.suffix_ids(question)),
            "scores": [0.8 if d.id in gold else 0.5 for d in docs]}
    return {"doc_tokens": doc_tokens, "storage": storage, "rows": rows}, peer


def peer_inputs(llm: LoadedModel, cfg: BenchConfig, prompts: list[dict]) -> dict:
    """What ``experiments/peer_langchain_pced.py`` needs to time the authors' implementation on exactly
    this run's model, documents and question, in its own environment (it imports nothing of pced)."""
    folder = Path(llm.path)
    return {
        "model": {"name": llm.name, "dir": str(folder) if folder.is_dir() else None,
                  "random_config": None if folder.is_dir() else llm.model.config.to_dict(),
                  "tokenizer_dir": str(getattr(llm.tokenizer, "name_or_path", "")),
                  "device": str(llm.device), "dtype": str(llm.dtype).removeprefix("torch."), "seed": cfg.seed},
        "ks": list(cfg.ks), "new_tokens": cfg.new_tokens, "repeats": cfg.repeats,
        "lengths": prompts,
    }


def run_bench(llm: LoadedModel, cfg: BenchConfig) -> dict:
    root = Path(cfg.out)
    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    total = len(cfg.doc_tokens) * len(cfg.ks) * len(cfg.methods) * cfg.repeats
    results = {
        "config": asdict(cfg),
        "model": llm.name,
        "device": str(llm.device),
        "dtype": str(llm.dtype),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "lengths": [],
    }
    floors = RunFloors.measure(_floor_runs(llm, cfg, root), llm.device, cfg.remeasure)
    results["floors"] = floors.to_json()
    results["machine"] = floors.header()
    results["machine_name"] = machine_name(floors.limits.key)
    results["work_shape"] = floors.shapes[0].to_json()
    results["copy_bandwidth_gbs"] = floors.limits.memory_bandwidth / 1e9
    results["weight_bytes"] = weight_bytes(llm.model)
    prompts = []
    with tqdm(total=total, desc="bench", unit="run") as bar:
        for doc_tokens in cfg.doc_tokens:
            length, prompt = bench_length(llm, cfg, doc_tokens, root, bar, floors)
            results["lengths"].append(length)
            prompts.append(prompt)
    atomic_write_json(root / "peer_inputs.json", peer_inputs(llm, cfg, prompts))
    results["storage"] = bench_storage(llm, cfg, root, floors) if cfg.storage_dtypes else []
    results["end_to_end"] = bench_end_to_end(llm, cfg, root, floors) if cfg.long_new_tokens else None
    if cfg.memory:
        results["memory"] = bench_memory(cfg, root)
    atomic_write_json(root / "bench.json", results)
    atomic_write_text(root / "bench.md", markdown_report(results))
    plot(results, root)
    return results


def _floor_runs(llm: LoadedModel, cfg: BenchConfig, root: Path) -> list:
    """PCED's rows at every (L, k) of the run: the shapes whose GEMM rates give the floors' peak."""
    runs = []
    for doc_tokens in cfg.doc_tokens:
        _, question, _ = secret_code_documents(llm, max(cfg.ks), doc_tokens, cfg.seed)
        generator = bench_generator(llm, root, doc_tokens, cfg.storage_dtype)
        shape = generator.backend.work_shape(generator)
        runs += [(shape, method_spans(generator.builder, "pced", [doc_tokens] * k, question)) for k in cfg.ks]
    return runs


def bench_storage(llm: LoadedModel, cfg: BenchConfig, root: Path, floors: RunFloors, n_docs: int = 16) -> list[dict]:
    """Per storage dtype (fresh stores): bytes per document token on disk, indexing time, and PCED's
    TTFT and cache load over all ``n_docs`` documents from the page cache, in one run so that the
    dtypes compare fairly."""
    docs, question, gold = secret_code_documents(llm, n_docs, cfg.doc_tokens[0], cfg.seed + 1)
    sampling = SamplingConfig(max_new_tokens=2, ignore_eos=True)
    rows = []
    for dtype in cfg.storage_dtypes:
        folder = root / f"storage-{dtype}"
        if folder.exists():
            import shutil

            shutil.rmtree(folder)
        generator = Generator(llm, RAG_TEMPLATE, folder, dtype, PAGE_CACHE)
        store = generator.caches
        store.prefix()
        started = time.perf_counter()
        digests = store.add([d.render() for d in docs], progress=False)
        seconds = time.perf_counter() - started
        tokens = sum(store.load(h).n_tokens for h in digests)
        size = sum(store.path_for(h).stat().st_size for h in digests)
        runs = [_run(start(generator, "pced", docs, gold, question, sampling)) for _ in range(cfg.repeats + 1)][1:]
        ttft_s = _median([r["ttft_s"] for r in runs])
        spans = method_spans(generator.builder, "pced", [store.load(h).n_tokens for h in digests], question)
        floor = floors.ttft(generator.backend.work_shape(generator), spans, size).floor_s
        rows.append({"dtype": dtype, "documents": n_docs, "tokens": tokens, "bytes": size, "bytes_per_token": size / tokens,
                     "index_s": seconds, "tokens_per_s": tokens / seconds, "pced_ttft_s": ttft_s,
                     "pced_ttft_floor_s": floor, "pced_ttft_vs_floor": ttft_s / floor,
                     "pced_cache_load_s": _median([r["cache_load_s"] for r in runs])})
    return rows


def bench_end_to_end(llm: LoadedModel, cfg: BenchConfig, root: Path, floors: RunFloors) -> dict:
    """A long answer (long_new_tokens) at the largest k where `all` still fits the window."""
    L = cfg.doc_tokens[0]
    docs, question, gold = secret_code_documents(llm, max(cfg.ks), L, cfg.seed)
    docs.sort(key=lambda d: d.id not in gold)
    generator = bench_generator(llm, root, L, cfg.storage_dtype)
    builder = generator.builder
    sampling = SamplingConfig(max_new_tokens=cfg.long_new_tokens, ignore_eos=True)
    fitting = [k for k in cfg.ks if not llm.max_context or
               len(builder.prompt_ids([d.render() for d in docs[:k]], question)) + cfg.long_new_tokens <= llm.max_context]
    k = max(fitting) if fitting else min(cfg.ks)
    chosen = docs[:k]
    out = {"k": k, "doc_tokens": L, "new_tokens": cfg.long_new_tokens}
    out["pced"] = _run(start(generator, "pced", chosen, gold, question, sampling))
    if fitting:
        out["all"] = _run(start(generator, "all", chosen, gold, question, sampling))
    lengths = [len(builder.context_ids([d.render()])) for d in chosen]
    read = sum(generator.caches.path_for(h).stat().st_size for h in generator.caches.digests([d.render() for d in chosen]))
    for method in ("pced", "all"):
        if out.get(method):
            floors.annotate(out[method], generator.backend.work_shape(generator), method_spans(builder, method, lengths, question),
                            cfg.long_new_tokens, 0 if method == "all" else read)
    return out


def bench_memory(cfg: BenchConfig, root: Path) -> list[dict]:
    """Peak RSS of one answer per method, each in a fresh interpreter (ru_maxrss of the child)."""
    import subprocess
    import sys

    L = cfg.doc_tokens[-1]
    rows = []
    for method in cfg.methods:
        for k in sorted(set([min(cfg.ks), 16 if 16 in cfg.ks else max(cfg.ks)])):
            code = (
                "import json,resource,sys;from pced.bench.run import memory_probe;"
                f"r=memory_probe({method!r},{k},{L},{str(root)!r},{cfg.storage_dtype!r},{cfg.seed});"
                "r['peak_rss_mb']=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1024;print(json.dumps(r))"
            )
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            if done.returncode != 0:
                rows.append({"method": method, "k": k, "doc_tokens": L, "error": done.stderr.strip().splitlines()[-1:]})
                continue
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return rows


def memory_probe(method: str, k: int, doc_tokens: int, root: str, storage_dtype: str, seed: int) -> dict:
    """Load the model, answer once with ``method`` (caches already on disk), report the baseline RSS too."""
    import resource

    from ..llm import load_model

    llm = load_model(device="cpu", dtype="float32")
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    docs, question, gold = secret_code_documents(llm, k, doc_tokens, seed)
    generator = bench_generator(llm, Path(root), doc_tokens, storage_dtype)
    generation = start(generator, method, docs, [], question, SamplingConfig(max_new_tokens=8, ignore_eos=True))
    with torch.inference_mode():  # fault in the (memory-mapped) weights before measuring
        llm.model(torch.tensor([[1, 2, 3]], device=llm.device))
    idle = _rss_mb()
    peak = [idle]
    done = threading.Event()

    def sample() -> None:  # ru_maxrss cannot be reset, so poll the resident size during the answer
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mb())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    list(generation)
    done.set()
    sampler.join()
    return {"method": method, "k": k, "doc_tokens": doc_tokens, "model_loaded_rss_mb": baseline,
            "before_answer_rss_mb": idle, "answer_peak_rss_mb": peak[0], "answer_extra_mb": peak[0] - idle}


def _rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
