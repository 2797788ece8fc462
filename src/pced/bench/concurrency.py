"""``pced bench --backend B`` for a backend whose engine batches questions (``Capabilities.concurrent_questions``):
PCED on it beside PCED on the default backend, in one run, every question fresh.

On the bench's secret-code documents at the first ``--doc-tokens``, for each k of ``--ks`` and each
of ``--repeats`` a set of k documents no question has read yet (each from its own secret-code
instance), and on it:

- **cold**: a question never asked, the engine's memory of earlier questions forgotten
  (``Backend.bench_forget``) and the documents' cache files dropped from the page cache: the engine
  reads them from the store (vLLM: pced's connector) and computes the question;
- **warm**: another question never asked, over the same documents, now in the engine's prefix cache;
- **recompute**: the cold question again, the engine's memory forgotten and its requests naming no
  stored KV (an empty store), so the engine prefills prefix, documents and question itself;
- the **default backend** on the cold question, its cache files dropped from the page cache too.

Times to first token and per decode step (medians over the repeats, each beside its floor:
``pced.bench.run_floors``), and what the engine counts per question (vLLM: prompt tokens computed
over the question's passes and read from the store, ``EngineRows.stats``). Throughput: C new
questions at once over documents in the engine's prefix cache (the smallest k, so that they fit its
KV cache together); the default backend answers them one after another, as its server lane does.

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

from ..backend import DEFAULT_BACKEND, get_backend
from ..documents import Candidate, Document
from ..fs import atomic_write_json, atomic_write_text
from ..generator import Generator
from ..kv.format import VERIFIED
from ..llm import LoadedModel
from ..options import AskOptions
from ..pipeline import ask_candidates
from ..decoding.sampling import SamplingConfig
from .config import BenchConfig
from .floors import RowSpan
from .report import FLOORS_NOTE
from .run import _run, bench_generator, evict_from_page_cache, fresh_question
from .run_floors import RunFloors, method_spans, with_floor

MODES = ("cold", "warm", "recompute")
TIMES = ("ttft_s", "decode_per_token_s", "total_s", "new_tokens")
COUNTS = ("context_tokens", "prefilled_tokens", "store_tokens", "cached_tokens", "degraded_steps")


def document_sets(llm: LoadedModel, cfg: BenchConfig, doc_tokens: int) -> list[tuple[list[Document], list[str], str]]:
    """One set of documents per (k, repeat), each from its own secret-code instance (gold first)."""
    from ..evaluation.secret_code import make_secret_code

    dataset = make_secret_code(llm.tokenizer, n_docs=max(cfg.ks), doc_tokens=doc_tokens, seed=cfg.seed,
                               n_examples=len(cfg.ks) * cfg.repeats)
    sets = []
    for index, example in enumerate(dataset.examples):
        docs = sorted(example.documents, key=lambda d: d.id not in example.gold_doc_ids)[:cfg.ks[index // cfg.repeats]]
        sets.append((docs, list(example.gold_doc_ids), example.question))
    return sets


def recompute_spans(builder, doc_lengths: list[int], question: str) -> list[RowSpan]:
    """PCED's rows with nothing stored: every row prefills its whole prompt."""
    return [RowSpan(0, span.start + span.prefill) for span in method_spans(builder, "pced", doc_lengths, question)]


def run_concurrency_bench(llm: LoadedModel, cfg: BenchConfig, backend, settings=None) -> dict:
    """``backend`` (one whose engine batches questions) beside the default backend; ``llm`` the torch
    model both read their prompts and caches with."""
    backend, default = get_backend(backend), get_backend(DEFAULT_BACKEND)
    settings = backend.settings(settings)
    root = Path(cfg.out)
    root.mkdir(parents=True, exist_ok=True)
    doc_tokens = cfg.doc_tokens[0]
    reference = bench_generator(llm, root, doc_tokens, cfg.storage_dtype)
    engine = Generator(llm, reference.template, reference.caches.root, cfg.storage_dtype, backend=backend, settings=settings)
    # the same engine, its requests naming a store that holds nothing: it prefills everything
    bare = Generator(llm, reference.template, root / f"empty-L{doc_tokens}-{cfg.storage_dtype}", cfg.storage_dtype,
                     backend=backend, settings=settings)
    sets = document_sets(llm, cfg, doc_tokens)
    reference.caches.add([d.render() for docs, _, _ in sets for d in docs], progress=True)
    store_bytes = sum(p.stat().st_size for p in reference.caches.root.glob("kv/*/*.safetensors"))
    shapes = {default.name: default.work_shape(reference), backend.name: backend.work_shape(engine)}
    lengths = len(reference.builder.context_ids([sets[0][0][0].render()]))  # every document: doc_tokens exactly
    spans = {k: method_spans(reference.builder, "pced", [lengths] * k, fresh_question(sets[0][2], 1)) for k in cfg.ks}
    floors = RunFloors.measure([(s, sp) for s in shapes.values() if s is not None for sp in spans.values()],
                               llm.device, cfg.remeasure, threads=backend.bench_threads(settings))  # both columns'
    prepared = backend.bench_prepare(engine, [])  # after the machine's limits: an engine's processes may share its cores
    sampling = SamplingConfig(max_new_tokens=cfg.new_tokens, ignore_eos=True)
    numbers = iter(range(1, 1_000_000))

    def answer(generator, docs, gold, question) -> dict:
        options = AskOptions(backend=generator.backend.name, backend_settings=generator.settings, sampling=sampling)
        candidates = [Candidate(d, 0.8 if d.id in gold else 0.5) for d in docs]
        generation = ask_candidates(generator, candidates, question, options).generation
        run = _run(generation)
        run.update({key: generation.stats.get(key, 0) for key in COUNTS})
        return run

    results = {"config": asdict(cfg), "backend": backend.name, "default": default.name, backend.name: asdict(settings),
               "model": llm.name, "device": str(llm.device), "threads": torch.get_num_threads(),
               "cpu_count": os.cpu_count(), "doc_tokens": doc_tokens, **prepared,
               "store_bytes": store_bytes, "store_documents": sum(len(s[0]) for s in sets),
               "machine": floors.header(), "floors": floors.to_json(),
               "work_shapes": {n: s.to_json() for n, s in shapes.items() if s is not None}, "latency": [], "throughput": []}
    total = len(sets) * 4 + 2 + sum(c * 2 for c in cfg.concurrency)
    with tqdm(total=total, desc=f"bench {backend.name}", unit="answer") as bar:
        # the engine's first question (after its warm start, where on), cold: reported apart, never in a median
        docs, gold, question = sets[0]
        backend.bench_forget(engine)
        evict_from_page_cache([reference.caches.path_for(h) for h in reference.caches.digests([d.render() for d in docs])])
        VERIFIED.forget()
        results["first_question"] = {"k": len(docs), **answer(engine, docs, gold, fresh_question(question, next(numbers)))}
        bar.update(1)
        for k in cfg.ks:
            runs: dict[str, list[dict]] = {mode: [] for mode in (*MODES, default.name)}
            for docs, gold, question in [s for s in sets if len(s[0]) == k]:
                files = [reference.caches.path_for(h) for h in reference.caches.digests([d.render() for d in docs])]
                cold = fresh_question(question, next(numbers))
                backend.bench_forget(engine)
                evict_from_page_cache(files)
                VERIFIED.forget()  # a reader's first load of a file checks its bytes (written by this process here)
                runs["cold"].append(answer(engine, docs, gold, cold))
                runs["warm"].append(answer(engine, docs, gold, fresh_question(question, next(numbers))))
                backend.bench_forget(bare)
                runs["recompute"].append(answer(bare, docs, gold, cold))
                evict_from_page_cache(files)
                VERIFIED.forget()
                runs[default.name].append(answer(reference, docs, gold, cold))
                bar.update(4)
            row = {"k": k, "runs": runs}
            for mode, done in runs.items():
                row[mode] = {key: float(statistics.median(r[key] for r in done)) for key in TIMES + COUNTS}
            row["recompute_over_cold"] = row["recompute"]["ttft_s"] / row["cold"]["ttft_s"]
            cache = sum(f.stat().st_size for f in files)
            for mode, shape, rows, cache_bytes in ((default.name, shapes[default.name], spans[k], cache),
                                                   ("cold", shapes[backend.name], spans[k],
                                                    backend.bench_cache_bytes(engine, files)),
                                                   ("warm", shapes[backend.name], spans[k], 0),
                                                   ("recompute", shapes[backend.name],
                                                    recompute_spans(reference.builder, [lengths] * k, cold), 0)):
                if shape is not None:
                    floors.annotate(row[mode], shape, rows, cfg.new_tokens, cache_bytes)
            results["latency"].append(row)
        docs, gold, question = sets[0]  # the smallest k: questions at once must fit the KV cache together
        answer(engine, docs, gold, fresh_question(question, next(numbers)))  # into the prefix cache
        bar.update(1)
        for concurrency in cfg.concurrency:
            questions = [fresh_question(question, next(numbers)) for _ in range(concurrency)]
            row = {"k": len(docs), "questions": concurrency}
            started = time.perf_counter()
            done = []
            for q in questions:  # the default backend: one after another, as its server lane does
                done.append(answer(reference, docs, gold, q))
                bar.update(1)
            row[default.name] = _throughput(done, time.perf_counter() - started)
            started = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                done = list(pool.map(lambda q: answer(engine, docs, gold, q), questions))
            bar.update(concurrency)
            row[backend.name] = _throughput(done, time.perf_counter() - started)
            row[backend.name]["degraded_steps"] = sum(r["degraded_steps"] for r in done)
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
    cfg, b, d = results["config"], results["backend"], results["default"]
    settings = results.get(b, {})
    kv = settings.get("kv_cache_gb")
    store = f"the store holds {results['store_documents']} documents' caches, {results['store_bytes'] / 1e9:.2f} GB"
    if kv:
        store += f" ({results['store_bytes'] / (kv * 2**30):.1f}x the engine's {kv:g} GiB KV cache)"
    lines = [f"# pced bench --backend {b}: {results['model']} on {results['device']}", "",
             f"{results['cpu_count']} CPUs; documents of {results['doc_tokens']} tokens; {cfg['new_tokens']} new tokens "
             f"per answer (EOS ignored); medians of {cfg['repeats']}, every question asked once; engine start "
             f"{results.get('engine_start_s', 0):.1f} s; {store}.", "", f"Machine: {results['machine']}.", "",
             FLOORS_NOTE, "", "## One question at a time", "",
             f"Cold: documents {b} has not read, from the store's files (dropped from the page cache). Warm: a new "
             f"question over them, now in {b}'s prefix cache. Recompute: the cold question again with {b}'s prefix "
             "cache emptied and no stored KV named, so it prefills everything. Prompt tokens: all rows of the "
             f"question; computed: what {b} prefilled over the question's passes (its own counts).", "",
             f"| k | {d} TTFT s | {b} cold TTFT s | warm | recompute | recompute / cold | prompt tokens | "
             "computed cold / warm / recompute | from the store (cold) | degraded steps |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    first = results.get("first_question")
    cold = next((row["cold"]["ttft_s"] for row in results["latency"] if first and row["k"] == first["k"]), None)
    if cold:
        lines[-2:-2] = [f"The engine's first question, cold, k = {first['k']} (after its warm start: "
                        f"{'on' if settings.get('warm_start') else 'off'}; not in the medians): TTFT "
                        f"{first['ttft_s']:.3f} s, {first['ttft_s'] / cold:.2f}x the cold median.", ""]
    for row in results["latency"]:
        t, c, w, r = row[d], row["cold"], row["warm"], row["recompute"]
        degraded = sum(run["degraded_steps"] for mode in MODES for run in row["runs"][mode])
        lines.append(f"| {row['k']} | {with_floor(t['ttft_s'], t.get('ttft_floor_s'))} | "
                     f"{with_floor(c['ttft_s'], c.get('ttft_floor_s'))} | {with_floor(w['ttft_s'], w.get('ttft_floor_s'))} | "
                     f"{with_floor(r['ttft_s'], r.get('ttft_floor_s'))} | {row['recompute_over_cold']:.1f}x | "
                     f"{c['context_tokens']:.0f} | {c['prefilled_tokens']:.0f} / {w['prefilled_tokens']:.0f} / "
                     f"{r['prefilled_tokens']:.0f} | {c['store_tokens']:.0f} | {degraded} |")
    lines += ["", f"| k | {d} decode ms/token | {b} decode ms/token (cold) |", "|---|---|---|"]
    for row in results["latency"]:
        t, c = row[d], row["cold"]
        lines.append(f"| {row['k']} | {with_floor(t['decode_per_token_s'], t.get('decode_floor_s'), 1000, 1)} | "
                     f"{with_floor(c['decode_per_token_s'], c.get('decode_floor_s'), 1000, 1)} |")
    lines += ["", f"## Questions at once (new questions over documents in {b}'s prefix cache; {d} answers them in turn)",
              "", f"| k | questions | {d} questions/s | {b} questions/s | speed-up | {b} tokens/s | degraded steps |",
              "|---|---|---|---|---|---|---|"]
    for row in results["throughput"]:
        lines.append(f"| {row['k']} | {row['questions']} | {row[d]['questions_per_s']:.2f} | {row[b]['questions_per_s']:.2f} | "
                     f"{row['speedup']:.2f}x | {row[b]['tokens_per_s']:.1f} | {row[b]['degraded_steps']} |")
    counters = results.get("engine_counters", {})
    if counters:
        lines += ["", f"{b} over the run: {counters.get('prefilled_tokens', 0)} prompt tokens computed, "
                  f"{counters.get('store_tokens', 0)} read from the store; {counters.get('degraded_steps', 0)} degraded "
                  "(incomplete-group) steps."]
    lines.append("")
    return "\n".join(lines)


def plot(results: dict, root: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b, d = results["backend"], results["default"]
    fig, (ax_ttft, ax_rate) = plt.subplots(1, 2, figsize=(11, 4))
    ks = [row["k"] for row in results["latency"]]
    for mode, style in ((d, "--s"), ("cold", "-o"), ("warm", "-^"), ("recompute", ":x")):
        ax_ttft.plot(ks, [row[mode]["ttft_s"] for row in results["latency"]], style,
                     label=mode if mode == d else f"{b} {mode}")
    counts = [row["questions"] for row in results["throughput"]]
    for name, style in ((d, "--s"), (b, "-o")):
        ax_rate.plot(counts, [row[name]["questions_per_s"] for row in results["throughput"]], style, label=name)
    ax_ttft.set(xlabel="documents k", ylabel="s", title="time to first token, new questions")
    ax_rate.set(xlabel="questions at once", ylabel="questions/s", title="throughput, new questions")
    for ax in (ax_ttft, ax_rate):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"PCED on {b} vs {d}: {results['model']} on {results['device']}")
    fig.tight_layout()
    fig.savefig(root / f"bench_{b}.png", dpi=120)
    plt.close(fig)
