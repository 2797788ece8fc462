"""``pced bench --backend vllm``: PCED inside a vLLM engine beside PCED on transformers, in one run.

On the bench's secret-code documents (``bench.secret_code_documents``), for each k of ``--ks`` at
the first ``--doc-tokens``:

- **latency**, one question at a time: time to first token and decode time per token, medians of
  ``--repeats``. Transformers reads the documents' KV files; vLLM finds them in its prefix cache
  (prefilled once before timing, as ``pced serve --backend vllm`` does at start).
- **throughput**, C questions at once for each C of ``--concurrency``: questions/s and tokens/s.
  vLLM decodes them together (continuous batching); transformers answers them one after another,
  as its server does. The C questions are the same question over the same documents: with every
  prompt already cached this measures decoding, which is what batching changes.

Saved as bench_vllm.json, .md and .png in ``--out``.
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
from ..options import AskOptions, VLLMSettings
from ..pipeline import ask_candidates


def _options(cfg: BenchConfig, backend: str, settings: VLLMSettings) -> AskOptions:
    return AskOptions(backend=backend, vllm=settings, sampling=SamplingConfig(max_new_tokens=cfg.new_tokens, ignore_eos=True))


def run_vllm_bench(llm: LoadedModel, cfg: BenchConfig, settings: VLLMSettings = VLLMSettings()) -> dict:
    from ..backends.vllm.engine import shared_engine

    root = Path(cfg.out)
    root.mkdir(parents=True, exist_ok=True)
    vllm = shared_engine(llm.path, settings)
    doc_tokens = cfg.doc_tokens[0]
    docs, question, gold = secret_code_documents(llm, max(cfg.ks), doc_tokens, cfg.seed)
    docs.sort(key=lambda d: d.id not in gold)  # gold first, so every k includes the answer
    generator = bench_generator(llm, root, doc_tokens, cfg.storage_dtype)
    generator.caches.add([d.render() for d in docs], progress=False)
    vllm.warm_up(generator.builder, [d.render() for d in docs])
    candidates = [Candidate(d, 0.8 if d.id in gold else 0.5) for d in docs]
    results = {"config": asdict(cfg), "vllm": asdict(settings), "model": llm.name, "device": str(llm.device),
               "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "doc_tokens": doc_tokens,
               "engine_start_s": vllm.start_s, "warm_up_s": vllm.warm_up_s, "latency": [], "throughput": []}

    def answer(backend: str, k: int) -> dict:
        return _run(ask_candidates(generator, candidates[:k], question, _options(cfg, backend, settings)).generation)

    total = len(cfg.ks) * 2 * cfg.repeats + sum(c * 2 for c in cfg.concurrency)
    with tqdm(total=total, desc="bench vllm", unit="answer") as bar:
        for k in cfg.ks:
            row = {"k": k}
            for backend in ("transformers", "vllm"):
                runs = []
                for _ in range(cfg.repeats):
                    runs.append(answer(backend, k))
                    bar.update(1)
                row[backend] = {key: float(statistics.median(r[key] for r in runs))
                                for key in ("ttft_s", "decode_per_token_s", "total_s", "new_tokens")}
            results["latency"].append(row)
        k = max(cfg.ks)
        for concurrency in cfg.concurrency:
            row = {"k": k, "questions": concurrency}
            started = time.perf_counter()
            runs = []
            for _ in range(concurrency):  # transformers: one after another, as its server lane does
                runs.append(answer("transformers", k))
                bar.update(1)
            row["transformers"] = _throughput(runs, time.perf_counter() - started)
            started = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                futures = [pool.submit(answer, "vllm", k) for _ in range(concurrency)]
                runs = []
                for future in futures:
                    runs.append(future.result())
                    bar.update(1)
            row["vllm"] = _throughput(runs, time.perf_counter() - started)
            row["speedup"] = row["vllm"]["questions_per_s"] / row["transformers"]["questions_per_s"]
            results["throughput"].append(row)
    results["engine_counters"] = dict(vllm.counters)
    atomic_write_json(root / "bench_vllm.json", results)
    atomic_write_text(root / "bench_vllm.md", markdown_report(results))
    plot(results, root)
    return results


def _throughput(runs: list[dict], wall: float) -> dict:
    tokens = sum(r["new_tokens"] for r in runs)
    return {"wall_s": wall, "questions_per_s": len(runs) / wall, "tokens_per_s": tokens / wall,
            "median_ttft_s": float(statistics.median(r["ttft_s"] for r in runs))}


def markdown_report(results: dict) -> str:
    cfg = results["config"]
    lines = [f"# pced bench --backend vllm: {results['model']} on {results['device']}", "",
             f"{results['cpu_count']} CPUs; documents of {results['doc_tokens']} tokens; {cfg['new_tokens']} new tokens "
             f"per answer (EOS ignored); medians of {cfg['repeats']}. vLLM engine start {results['engine_start_s']:.1f} s, "
             f"warm-up (every document into its prefix cache) {results['warm_up_s']:.1f} s.", "",
             "## One question at a time", "",
             "| k | transformers TTFT s | vLLM TTFT s | transformers decode ms/token | vLLM decode ms/token |",
             "|---|---|---|---|---|"]
    for row in results["latency"]:
        t, v = row["transformers"], row["vllm"]
        lines.append(f"| {row['k']} | {t['ttft_s']:.3f} | {v['ttft_s']:.3f} | {t['decode_per_token_s'] * 1000:.1f} | "
                     f"{v['decode_per_token_s'] * 1000:.1f} |")
    lines += ["", "## Questions at once (vLLM batches them; transformers answers them in turn)", "",
              "| k | questions | transformers questions/s | vLLM questions/s | speed-up | vLLM tokens/s |",
              "|---|---|---|---|---|---|"]
    for row in results["throughput"]:
        lines.append(f"| {row['k']} | {row['questions']} | {row['transformers']['questions_per_s']:.2f} | "
                     f"{row['vllm']['questions_per_s']:.2f} | {row['speedup']:.2f}x | {row['vllm']['tokens_per_s']:.1f} |")
    counters = results.get("engine_counters", {})
    lines += ["", f"vLLM prefix cache: {counters.get('cached_tokens', 0)} of {counters.get('prompt_tokens', 0)} group prompt "
              f"tokens found cached; {counters.get('degraded_steps', 0)} degraded (incomplete-group) steps.", ""]
    return "\n".join(lines)


def plot(results: dict, root: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_latency, ax_rate) = plt.subplots(1, 2, figsize=(11, 4))
    ks = [row["k"] for row in results["latency"]]
    for backend, style in (("transformers", "--s"), ("vllm", "-o")):
        ax_latency.plot(ks, [row[backend]["decode_per_token_s"] * 1000 for row in results["latency"]], style, label=backend)
        counts = [row["questions"] for row in results["throughput"]]
        ax_rate.plot(counts, [row[backend]["questions_per_s"] for row in results["throughput"]], style, label=backend)
    ax_latency.set(xlabel="documents k", ylabel="ms", title="decode time per token, one question")
    ax_rate.set(xlabel="questions at once", ylabel="questions/s", title=f"throughput at k={max(ks)}")
    for ax in (ax_latency, ax_rate):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"PCED on vLLM vs transformers: {results['model']} on {results['device']}")
    fig.tight_layout()
    fig.savefig(root / "bench_vllm.png", dpi=120)
    plt.close(fig)

