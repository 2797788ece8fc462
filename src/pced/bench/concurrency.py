"""``pced bench --backend B`` for a backend whose engine batches questions (``Capabilities.concurrent_questions``):
PCED on it beside PCED on the default backend, in one run.

On the bench's secret-code documents (``bench.secret_code_documents``), for each k of ``--ks`` at
the first ``--doc-tokens``:

- **latency**, one question at a time: time to first token and decode time per token, medians of
  ``--repeats``. The default backend reads the documents' KV files; the engine gets them as its
  ``Backend.bench_prepare`` says (e.g. an engine's prefix cache, prefilled once before timing).
- **throughput**, C questions at once for each C of ``--concurrency``: questions/s and tokens/s.
  The engine decodes them together (continuous batching); the default backend answers them one
  after another, as its server lane does. The C questions are the same question over the same documents: with every
  prompt already cached this measures decoding, which is what batching changes.

Saved as bench_<backend>.json, .md and .png in ``--out``.
"""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from ..sampling import SamplingConfig
from .run import _run, bench_generator, secret_code_documents
from .config import BenchConfig
from ..documents import Candidate
from ..fs import atomic_write_json, atomic_write_text
from ..llm import LoadedModel
from ..backend import DEFAULT_BACKEND, get_backend
from ..generator import Generator
from ..options import AskOptions
from ..pipeline import ask_candidates
from .report import FLOORS_NOTE
from .run_floors import RunFloors, method_spans, with_floor


def run_concurrency_bench(llm: LoadedModel, cfg: BenchConfig, backend, settings=None) -> dict:
    """``backend`` (one whose engine batches questions) beside the default backend; ``llm`` the torch
    model both read their prompts and caches with."""
    backend, default = get_backend(backend), get_backend(DEFAULT_BACKEND)
    settings = backend.settings(settings)
    root = Path(cfg.out)
    root.mkdir(parents=True, exist_ok=True)
    doc_tokens = cfg.doc_tokens[0]
    docs, question, gold = secret_code_documents(llm, max(cfg.ks), doc_tokens, cfg.seed)
    docs.sort(key=lambda d: d.id not in gold)  # gold first, so every k includes the answer
    reference = bench_generator(llm, root, doc_tokens, cfg.storage_dtype)
    engine = Generator(llm, reference.template, reference.caches.root, cfg.storage_dtype, backend=backend, settings=settings)
    generators = {default.name: reference, backend.name: engine}
    digests = reference.caches.add([d.render() for d in docs], progress=False)
    prepared = backend.bench_prepare(engine, [d.render() for d in docs])
    candidates = [Candidate(d, 0.8 if d.id in gold else 0.5) for d in docs]
    # the floors (pced.bench.floors): each backend's work, this machine's limits (measured once, cached)
    files = [reference.caches.path_for(h) for h in digests]
    lengths = [reference.caches.load(h).n_tokens for h in digests]
    spans = {k: method_spans(reference.builder, "pced", lengths[:k], question) for k in cfg.ks}
    shapes = {name: g.backend.work_shape(g) for name, g in generators.items()}
    floors = RunFloors.measure([(shapes[n], s) for n in generators for s in spans.values() if shapes[n] is not None],
                               llm.device, cfg.remeasure)
    results = {"config": asdict(cfg), "backend": backend.name, "default": default.name, backend.name: asdict(settings),
               "model": llm.name, "device": str(llm.device), "threads": torch.get_num_threads(),
               "cpu_count": os.cpu_count(), "doc_tokens": doc_tokens, **prepared, "machine": floors.header(),
               "floors": floors.to_json(), "work_shapes": {n: s.to_json() for n, s in shapes.items() if s is not None},
               "latency": [], "throughput": []}
    sampling = SamplingConfig(max_new_tokens=cfg.new_tokens, ignore_eos=True)

    def answer(name: str, k: int) -> dict:
        generator = generators[name]
        options = AskOptions(backend=name, backend_settings=generator.settings, sampling=sampling)
        return _run(ask_candidates(generator, candidates[:k], question, options).generation)

    total = len(cfg.ks) * 2 * cfg.repeats + sum(c * 2 for c in cfg.concurrency)
    with tqdm(total=total, desc=f"bench {backend.name}", unit="answer") as bar:
        for k in cfg.ks:
            row = {"k": k}
            for name in generators:
                runs = []
                for _ in range(cfg.repeats):
                    runs.append(answer(name, k))
                    bar.update(1)
                row[name] = {key: float(statistics.median(r[key] for r in runs))
                                for key in ("ttft_s", "decode_per_token_s", "total_s", "new_tokens")}
                generator = generators[name]
                if shapes[name] is not None:
                    floors.annotate(row[name], shapes[name], spans[k], cfg.new_tokens,
                                    generator.backend.bench_cache_bytes(generator, files[:k]))
            results["latency"].append(row)
        k = max(cfg.ks)
        for concurrency in cfg.concurrency:
            row = {"k": k, "questions": concurrency}
            started = time.perf_counter()
            runs = []
            for _ in range(concurrency):  # the default backend: one after another, as its server lane does
                runs.append(answer(default.name, k))
                bar.update(1)
            row[default.name] = _throughput(runs, time.perf_counter() - started)
            started = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                futures = [pool.submit(answer, backend.name, k) for _ in range(concurrency)]
                runs = []
                for future in futures:
                    runs.append(future.result())
                    bar.update(1)
            row[backend.name] = _throughput(runs, time.perf_counter() - started)
            row["speedup"] = row[backend.name]["questions_per_s"] / row[default.name]["questions_per_s"]
            results["throughput"].append(row)
    results["engine_counters"] = backend.health(engine)
    atomic_write_json(root / f"bench_{backend.name}.json", results)
    atomic_write_text(root / f"bench_{backend.name}.md", markdown_report(results))
    plot(results, root)
    return results


def _throughput(runs: list[dict], wall: float) -> dict:
    tokens = sum(r["new_tokens"] for r in runs)
    return {"wall_s": wall, "questions_per_s": len(runs) / wall, "tokens_per_s": tokens / wall,
            "median_ttft_s": float(statistics.median(r["ttft_s"] for r in runs))}


def markdown_report(results: dict) -> str:
    cfg = results["config"]
    b, d = results["backend"], results["default"]
    prepared = (f" Engine start {results['engine_start_s']:.1f} s, warm-up (every document into its prefix cache) "
                f"{results['warm_up_s']:.1f} s." if "warm_up_s" in results else "")
    lines = [f"# pced bench --backend {b}: {results['model']} on {results['device']}", "",
             f"{results['cpu_count']} CPUs; documents of {results['doc_tokens']} tokens; {cfg['new_tokens']} new tokens "
             f"per answer (EOS ignored); medians of {cfg['repeats']}.{prepared}", "",
             f"Machine: {results['machine']}.", "",
             FLOORS_NOTE + f" {b}'s first token reads no cache file (its engine holds the documents), and from the "
             "second repeat on its prefix cache may hold the question's suffix too (the same question every repeat): "
             "it then prefills less than the floor counts.", "",
             "## One question at a time", "",
             f"| k | {d} TTFT s | {b} TTFT s | {d} decode ms/token | {b} decode ms/token |",
             "|---|---|---|---|---|"]
    for row in results["latency"]:
        t, v = row[d], row[b]
        lines.append(f"| {row['k']} | {with_floor(t['ttft_s'], t.get('ttft_floor_s'))} | "
                     f"{with_floor(v['ttft_s'], v.get('ttft_floor_s'))} | "
                     f"{with_floor(t['decode_per_token_s'], t.get('decode_floor_s'), 1000, 1)} | "
                     f"{with_floor(v['decode_per_token_s'], v.get('decode_floor_s'), 1000, 1)} |")
    lines += ["", f"## Questions at once ({b} batches them; {d} answers them in turn)", "",
              f"| k | questions | {d} questions/s | {b} questions/s | speed-up | {b} tokens/s |",
              "|---|---|---|---|---|---|"]
    for row in results["throughput"]:
        lines.append(f"| {row['k']} | {row['questions']} | {row[d]['questions_per_s']:.2f} | "
                     f"{row[b]['questions_per_s']:.2f} | {row['speedup']:.2f}x | {row[b]['tokens_per_s']:.1f} |")
    counters = results.get("engine_counters", {})
    if counters:
        lines += ["", f"{b} prefix cache: {counters.get('cached_tokens', 0)} of {counters.get('prompt_tokens', 0)} group "
                  f"prompt tokens found cached; {counters.get('degraded_steps', 0)} degraded (incomplete-group) steps."]
    lines.append("")
    return "\n".join(lines)


def plot(results: dict, root: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_latency, ax_rate) = plt.subplots(1, 2, figsize=(11, 4))
    ks = [row["k"] for row in results["latency"]]
    for backend, style in ((results["default"], "--s"), (results["backend"], "-o")):
        ax_latency.plot(ks, [row[backend]["decode_per_token_s"] * 1000 for row in results["latency"]], style, label=backend)
        counts = [row["questions"] for row in results["throughput"]]
        ax_rate.plot(counts, [row[backend]["questions_per_s"] for row in results["throughput"]], style, label=backend)
    ax_latency.set(xlabel="documents k", ylabel="ms", title="decode time per token, one question")
    ax_rate.set(xlabel="questions at once", ylabel="questions/s", title=f"throughput at k={max(ks)}")
    for ax in (ax_latency, ax_rate):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"PCED on {results['backend']} vs {results['default']}: {results['model']} on {results['device']}")
    fig.tight_layout()
    fig.savefig(root / f"bench_{results['backend']}.png", dpi=120)
    plt.close(fig)

