"""transformers on the CPU against this machine's floor: the plain path and the fast path in one run.

    python experiments/cpu_kernels.py --ks 4,8,16,32 --loads 7 --attention --bf16 --out docs/bench/cpu-kernels

The fast path is what ``load_model`` picks on an x86 CPU: oneDNN-packed linear layers and output
layer (``pced.llm.pack_linear_layers``), the batch buffer of the previous question written again
instead of fresh pages (``pced.kv.buffer.SpareBuffer``), and the decode step's attention by each
row's own length where padding is heavy (``pced.kv.attention.row_spans``; --attention measures it).
The plain path is ``nn.Linear`` (MKL), a fresh buffer per question and one masked attention call,
as before. On the embedded model (float32, the thread count pced uses by
default), per k: PCED's rows over k secret-code documents of --doc-tokens tokens (a real store,
float16 caches read from the page cache), the time to the first logits (cache load + the question
suffix's forward for the k + 1 rows) and the median decode step, plain and fast alternated repeat by
repeat. Times are CPU seconds of this process (single-threaded torch: other processes on the machine
barely move them), wall seconds beside.

The floor, measured in the same run with torch: decode step = max(bytes a step reads / memory
bandwidth, FLOPs / the best float32 GEMM rate at the model's shapes with k + 1 rows); first logits =
the caches' bytes / the page-cache read rate + the suffix forward's FLOPs / the best rate at its rows.
Bandwidth is the larger of a copy (read + write counted) and a read; the page-cache rate the larger of
``readinto`` and a copy out of a mapping of the store's files; the GEMM rate the best of the plain and
the packed product over the model's linear shapes. bfloat16 GEMM rates are measured beside (reported,
not used), and with --bf16 one decode step of the model loaded in bfloat16 at the largest k.

Exactness: the fast path's logits against the plain path's at the first step and the last (max abs
difference) and both paths' greedy tokens. Writes ``cpu_kernels.json`` and ``cpu_kernels.md``.
"""

from __future__ import annotations

import argparse
import mmap
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from pced.backends.rows import ExpertRows
from pced.backends.transformers.bench import kv_bytes_per_token, weight_bytes
from pced.bench.machine import memory_bandwidth as copy_bandwidth
from pced.bench.run import secret_code_documents
from pced.kv import attention
from pced.kv.buffer import SpareBuffer
from pced.kv.store import KVStore
from pced.llm import load_model
from pced.text.prompts import RAG_TEMPLATE, PromptBuilder
from results_files import save


def cpu_and_wall():
    return time.process_time(), time.perf_counter()


def median_cpu(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.process_time()
        fn()
        times.append(time.process_time() - started)
    return statistics.median(times)


def memory_bandwidth(megabytes: int = 256) -> dict:
    source = torch.ones(megabytes * 2**20 // 4)
    read = source.numel() * 4 / median_cpu(source.sum, 5)
    return {"copy_bytes_per_s": copy_bandwidth(torch.device("cpu"), megabytes), "read_bytes_per_s": read}


def page_cache_rate(files: list[Path]) -> dict:
    """Bytes per second out of the page cache (the files were just read, so they are there)."""
    total = sum(f.stat().st_size for f in files)
    buffer = bytearray(max(f.stat().st_size for f in files))

    def read_all():
        for f in files:
            with open(f, "rb", buffering=0) as handle:
                handle.readinto(memoryview(buffer)[: f.stat().st_size])

    def map_all():
        for f in files:
            with open(f, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                torch.frombuffer(mapped, dtype=torch.uint8).clone()

    read_all()
    return {"bytes": total, "read_bytes_per_s": total / median_cpu(read_all, 5),
            "mmap_bytes_per_s": total / median_cpu(map_all, 5)}


def linear_shapes(model: torch.nn.Module) -> dict[tuple[int, int], int]:
    """(in, out) of every linear layer and how many there are (the output layer is the largest out)."""
    shapes: dict[tuple[int, int], int] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            key = (module.in_features, module.out_features)
            shapes[key] = shapes.get(key, 0) + 1
    return shapes


def gemm_rates(shapes, rows: int, dtype: torch.dtype) -> dict:
    """FLOP/s of the plain and the oneDNN-packed product per shape at ``rows`` rows (CPU-time medians)."""
    out = {}
    for (k, n) in shapes:
        weight, x = torch.randn(n, k).to(dtype) * 0.02, torch.randn(rows, k).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        flops = 2 * rows * k * n
        repeats = max(3, min(50, int(2e9 / flops)))
        with torch.inference_mode():
            plain = median_cpu(lambda: torch.nn.functional.linear(x, weight), repeats)
            onednn = median_cpu(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), repeats)
        out[f"{k}x{n}"] = {"plain": flops / plain, "onednn": flops / onednn}
    return out


def best_rate(rates: dict) -> float:
    return max(max(r.values()) for r in rates.values())


def attention_flops(model, row_tokens) -> float:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 4.0 * config.num_attention_heads * head_dim * config.num_hidden_layers * sum(row_tokens)


def run_rows(llm, prefix, loaders, suffix, amateur_suffix, steps: int) -> dict:
    """One question's rows: first logits, then ``steps`` decode steps feeding the first expert's greedy token."""
    rows = ExpertRows(llm, prefix, loaders, suffix, amateur_suffix, steps + 1)
    forward, marks = rows.forward, {}

    def timed_forward(ids, positions):  # the suffix forward starts here: the rest of prefill is the load
        marks.setdefault("suffix", cpu_and_wall())
        return forward(ids, positions)

    rows.forward = timed_forward
    started = cpu_and_wall()
    logits = rows.prefill()
    del rows.forward  # no reference cycle: the rows' buffer is freed (and kept for the next question) on return
    token = int(torch.argmax(logits[-1]))
    first = cpu_and_wall()
    first_logits, tokens, cpu, wall = logits.clone(), [token], [], []
    for _ in range(steps):
        step = cpu_and_wall()
        logits = rows.advance(token)
        token = int(torch.argmax(logits[-1]))
        done = cpu_and_wall()
        cpu.append(done[0] - step[0])
        wall.append(done[1] - step[1])
        tokens.append(token)
    return {"ttft_cpu_s": first[0] - started[0], "ttft_wall_s": first[1] - started[1],
            "load_cpu_s": marks["suffix"][0] - started[0], "suffix_cpu_s": first[0] - marks["suffix"][0],
            "step_cpu_s": statistics.median(cpu), "step_wall_s": statistics.median(wall),
            "tokens": tokens, "first_logits": first_logits, "last_logits": logits.clone()}


DEFAULT_SKIPPED_SHARE = attention.SEGMENTED_MIN_SKIPPED_SHARE


def use_path(models: dict, path: str):
    """The model of ``path`` ready to run it. Two loaded models (plain and packed) rather than one
    switched back and forth: freeing the packed weights would leave already-faulted memory that the
    plain path's next buffer would land in, hiding the page faults it pays in a process of its own."""
    # before: one masked attention call whatever the padding, a fresh buffer for every question
    attention.SEGMENTED_MIN_SKIPPED_SHARE = DEFAULT_SKIPPED_SHARE if path == "fast" else 2.0
    if path == "plain":
        SpareBuffer.of(models[path].model).drop()
    return models[path]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", default="4,8,16,32")
    parser.add_argument("--doc-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: what pced uses, half the cores)")
    parser.add_argument("--store", default="runs/cpu-kernels-store")
    parser.add_argument("--bf16", action="store_true", help="also time the model loaded in bfloat16 at the largest k")
    parser.add_argument("--loads", type=int, default=0,
                        help="also time this many cache loads per k into a fresh and into the reused buffer, alternated")
    parser.add_argument("--attention", action="store_true",
                        help="also time the decode step's attention by each row's own length against one masked "
                             "call, with documents of equal and of mixed lengths (16 each)")
    parser.add_argument("--out", default="docs/bench/cpu-kernels")
    args = parser.parse_args(argv)
    from pced.cli.threads import default_threads

    torch.set_num_threads(args.threads or default_threads())
    ks = [int(k) for k in args.ks.split(",")]
    models = {"plain": load_model(None, device="cpu", dtype="float32", linear_kernel="plain"),
              "fast": load_model(None, device="cpu", dtype="float32", linear_kernel="onednn")}
    llm = models["plain"]
    docs, question, _ = secret_code_documents(llm, max(ks), args.doc_tokens, 0)
    builder = PromptBuilder(llm.tokenizer, RAG_TEMPLATE)
    store = KVStore(Path(args.store), llm, builder, "float16")
    digests = store.add([d.render() for d in docs], progress=False)
    prefix, suffix, amateur = store.prefix(), builder.suffix_ids(question), builder.suffix_ids(question, False)
    lengths = [store.load(h).n_tokens for h in digests]
    files = [store.root / "prefix.safetensors"] + [store.path_for(h) for h in digests]

    print("measuring the machine...", flush=True)
    shapes = linear_shapes(llm.model)
    layer_shapes = [s for s in shapes if s != max(shapes, key=lambda s: s[1])]
    machine = {"cpu": platform.processor() or platform.machine(), "capability": torch.backends.cpu.get_cpu_capability(),
               "threads": torch.get_num_threads(), "torch": torch.__version__, "memory": memory_bandwidth(),
               "page_cache": page_cache_rate(files), "gemm": {}, "gemm_bf16": {}}
    bandwidth = max(machine["memory"].values())
    page_rate = max(machine["page_cache"]["read_bytes_per_s"], machine["page_cache"]["mmap_bytes_per_s"])
    P, S, layers_numel = prefix.n_tokens, len(suffix), sum(n * k * c for (k, n), c in shapes.items())
    layer_numel = sum(n * k * c for (k, n), c in shapes.items() if (k, n) in layer_shapes)
    results = {"model": llm.name, "doc_tokens": args.doc_tokens, "prefix_tokens": P, "suffix_tokens": S,
               "steps": args.steps, "repeats": args.repeats, "machine": machine, "ks": {}}
    for k in ks:
        machine["gemm"][str(k + 1)] = gemm_rates(shapes, k + 1, torch.float32)
        machine["gemm"][str((k + 1) * S)] = gemm_rates(layer_shapes, (k + 1) * S, torch.float32)
        machine["gemm_bf16"][str(k + 1)] = gemm_rates(shapes, k + 1, torch.bfloat16)

    for k in ks:
        loaders = [lambda h=h: store.load(h) for h in digests[:k]]
        runs = {"plain": [], "fast": []}
        for repeat in range(args.repeats):
            for path in ("plain", "fast") if repeat % 2 == 0 else ("fast", "plain"):
                runs[path].append(run_rows(use_path(models, path), prefix, loaders, suffix, amateur, args.steps))
                print(f"k={k} {path}: first logits {runs[path][-1]['ttft_cpu_s']:.3f} s, "
                      f"step {runs[path][-1]['step_cpu_s'] * 1000:.1f} ms (CPU)", flush=True)
        # the floor: rows attend to P + L_k + S (+ the amateur's P + its suffix) tokens at the first step
        row_tokens = [P + len(amateur)] + [P + n + S for n in lengths[:k]]
        step_bytes = weight_bytes(llm.model) + kv_bytes_per_token(llm.model) * sum(row_tokens)
        step_flops = 2.0 * (k + 1) * layers_numel + attention_flops(llm.model, row_tokens)
        decode_floor = max(step_bytes / bandwidth, step_flops / best_rate(machine["gemm"][str(k + 1)]))
        cache_bytes = sum(f.stat().st_size for f in files[: k + 1])
        suffix_tokens = [P + len(amateur) - i for i in range(S)] + [P + n + S - i for n in lengths[:k] for i in range(S)]
        suffix_flops = (2.0 * (k + 1) * S * layer_numel + 2.0 * (k + 1) * (layers_numel - layer_numel)
                        + attention_flops(llm.model, suffix_tokens))
        ttft_floor = cache_bytes / page_rate + suffix_flops / best_rate(machine["gemm"][str((k + 1) * S)])
        row = {"decode_floor_s": decode_floor, "step_bytes": step_bytes, "step_flops": step_flops,
               "ttft_floor_s": ttft_floor, "cache_bytes": cache_bytes, "suffix_flops": suffix_flops}
        for path, measured in runs.items():
            row[path] = {key: statistics.median(r[key] for r in measured) for key in measured[0]
                         if key.endswith("_s")}
            row[path]["load_cpu_s_each"] = [r["load_cpu_s"] for r in measured]
            row[path]["step_over_floor"] = row[path]["step_cpu_s"] / decode_floor
            row[path]["ttft_over_floor"] = row[path]["ttft_cpu_s"] / ttft_floor
        plain, fast = runs["plain"][0], runs["fast"][0]
        row["exactness"] = {
            "first_step_max_abs_diff": float((plain["first_logits"] - fast["first_logits"]).abs().max()),
            "last_step_max_abs_diff": float((plain["last_logits"] - fast["last_logits"]).abs().max()),
            "same_greedy_tokens": plain["tokens"] == fast["tokens"]}
        results["ks"][str(k)] = row
    if args.loads:
        results["loads"] = buffer_loads(models, store, digests, prefix, suffix, amateur, ks, args.loads)
    if args.attention:
        results["attention"] = attention_plans(models, store, digests, prefix, suffix, amateur, args)
    if args.bf16:
        results["bf16"] = bf16_step(models, store, digests[: max(ks)], prefix, suffix, amateur, args.steps)
    save(args.out, "cpu_kernels", results, markdown(results))
    return results


def buffer_loads(models, store, digests, prefix, suffix, amateur, ks, repeats) -> dict:
    """CPU seconds from the start of the rows' prefill to their suffix forward (the caches read and
    written into the batch buffer), into fresh memory and into the previous load's, alternated."""
    llm = use_path(models, "fast")
    out = {}
    for k in ks:
        loaders = [lambda h=h: store.load(h) for h in digests[:k]]
        times = {"fresh": [], "reused": []}
        for repeat in range(repeats):
            for kind in ("fresh", "reused") if repeat % 2 == 0 else ("reused", "fresh"):
                if kind == "fresh":
                    SpareBuffer.of(llm.model).drop()
                times[kind].append(run_rows(llm, prefix, loaders, suffix, amateur, 1)["load_cpu_s"])
        out[str(k)] = times
        print(f"k={k} cache loads, fresh / reused buffer (CPU ms): {[round(t * 1e3) for t in times['fresh']]} / "
              f"{[round(t * 1e3) for t in times['reused']]}", flush=True)
    return out


def attention_plans(models, store, digests, prefix, suffix, amateur, args) -> list[dict]:
    """The decode step (fast path) with attention by each row's own length forced on and off:
    16 documents of the run's length, then 16 of mixed lengths (32 to 480 tokens)."""
    llm, mixed = use_path(models, "fast"), []
    for i, tokens in enumerate(range(32, 481, 28)):
        docs, _, _ = secret_code_documents(llm, 1, tokens, 100 + i)
        mixed += store.add([d.render() for d in docs], progress=False)
    out = []
    for name, chosen in (("equal", digests[:16]), ("mixed", mixed)):
        lengths = [store.load(h).n_tokens for h in chosen]
        slots = (len(chosen) + 1) * (prefix.n_tokens + max(lengths) + len(suffix))
        skipped = max(lengths) + sum(max(lengths) - n for n in lengths)  # the amateur's document slots too
        loaders = [lambda h=h: store.load(h) for h in chosen]
        runs = {"one_call": [], "by_row": []}
        try:
            for repeat in range(args.repeats):
                for plan in ("one_call", "by_row") if repeat % 2 == 0 else ("by_row", "one_call"):
                    attention.SEGMENTED_MIN_SKIPPED_SHARE = 2.0 if plan == "one_call" else 0.0
                    runs[plan].append(run_rows(llm, prefix, loaders, suffix, amateur, args.steps))
        finally:
            attention.SEGMENTED_MIN_SKIPPED_SHARE = DEFAULT_SKIPPED_SHARE
        out.append({"documents": name, "lengths": lengths, "skipped_share": skipped / slots,
                    **{f"step_{plan}_cpu_s": statistics.median(r["step_cpu_s"] for r in measured)
                       for plan, measured in runs.items()},
                    "max_abs_diff": float((runs["one_call"][0]["last_logits"] - runs["by_row"][0]["last_logits"]).abs().max()),
                    "same_greedy_tokens": runs["one_call"][0]["tokens"] == runs["by_row"][0]["tokens"]})
        print(out[-1], flush=True)
    return out


def bf16_step(models, store, digests, prefix, suffix, amateur, steps) -> dict:
    """The model in bfloat16 (oneDNN picks its AVX512-BF16 kernels where the CPU has them) beside float32."""
    llm16 = load_model(None, device="cpu", dtype="bfloat16", linear_kernel="onednn")
    loaders = [lambda h=h: store.load(h) for h in digests]
    ref = run_rows(use_path(models, "fast"), prefix, loaders, suffix, amateur, steps)
    runs = [run_rows(llm16, prefix, loaders, suffix, amateur, steps) for _ in range(2)]
    return {"k": len(digests), "step_cpu_s": statistics.median(r["step_cpu_s"] for r in runs),
            "ttft_cpu_s": statistics.median(r["ttft_cpu_s"] for r in runs),
            "float32_step_cpu_s": ref["step_cpu_s"], "float32_ttft_cpu_s": ref["ttft_cpu_s"],
            "first_step_max_abs_diff_vs_float32": float((runs[0]["first_logits"].float() - ref["first_logits"]).abs().max()),
            "same_greedy_tokens_as_float32": runs[0]["tokens"] == ref["tokens"]}


def markdown(results: dict) -> str:
    m = results["machine"]
    gb = 1e9
    lines = [f"# transformers on the CPU: plain and fast path against the floor",
             "",
             f"{results['model']}, float32, {m['threads']} thread(s), {m['cpu']} ({m['capability']}), torch {m['torch']}; "
             f"k documents of {results['doc_tokens']} tokens, prefix {results['prefix_tokens']} and question suffix "
             f"{results['suffix_tokens']} tokens; medians of {results['repeats']} alternated repeats, decode step = "
             f"median of {results['steps']} steps; CPU seconds of the process.",
             "",
             f"Machine: memory {m['memory']['copy_bytes_per_s'] / gb:.1f} GB/s (copy, read + write) / "
             f"{m['memory']['read_bytes_per_s'] / gb:.1f} GB/s (read); page cache "
             f"{m['page_cache']['read_bytes_per_s'] / gb:.2f} GB/s (readinto) / {m['page_cache']['mmap_bytes_per_s'] / gb:.2f} GB/s (mmap copy).",
             "",
             "| k | first logits plain / fast (s) | of which cache load plain / fast (s) | floor (s) | fast / floor "
             "| decode step plain / fast (ms) | floor (ms) | fast / floor | max abs logit diff | same tokens |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for k, row in results["ks"].items():
        p, f, e = row["plain"], row["fast"], row["exactness"]
        lines.append(f"| {k} | {p['ttft_cpu_s']:.3f} / {f['ttft_cpu_s']:.3f} | {p['load_cpu_s']:.3f} / {f['load_cpu_s']:.3f} "
                     f"| {row['ttft_floor_s']:.3f} | {f['ttft_over_floor']:.2f}x | {p['step_cpu_s'] * 1e3:.1f} / "
                     f"{f['step_cpu_s'] * 1e3:.1f} | {row['decode_floor_s'] * 1e3:.1f} | {f['step_over_floor']:.2f}x "
                     f"| {max(e['first_step_max_abs_diff'], e['last_step_max_abs_diff']):.1e} | {e['same_greedy_tokens']} |")
    lines += ["", "Best float32 GEMM rate at the model's shapes (GFLOP/s, plain MKL / oneDNN packed; bfloat16 beside):", "",
              "| rows | " + " | ".join(next(iter(m["gemm"].values())).keys()) + " |",
              "|---|" + "---|" * len(next(iter(m["gemm"].values())))]
    for rows, rates in m["gemm"].items():
        bf16 = m["gemm_bf16"].get(rows, {})
        cells = []
        for shape in next(iter(m["gemm"].values())):
            r = rates.get(shape)
            cell = "–" if r is None else f"{r['plain'] / gb:.0f} / {r['onednn'] / gb:.0f}"
            if shape in bf16:
                cell += f" (bf16 {bf16[shape]['plain'] / gb:.0f} / {bf16[shape]['onednn'] / gb:.0f})"
            cells.append(cell)
        lines.append(f"| {rows} | " + " | ".join(cells) + " |")
    if "loads" in results:
        lines += ["", "Cache load (CPU ms from the start of the prefill to the suffix forward), into a fresh buffer "
                  "and into the previous question's, alternated:", "", "| k | fresh | reused |", "|---|---|---|"]
        for k, times in results["loads"].items():
            lines.append(f"| {k} | {' '.join(str(round(t * 1e3)) for t in times['fresh'])} "
                         f"| {' '.join(str(round(t * 1e3)) for t in times['reused'])} |")
    if "attention" in results:
        lines += ["", "Decode step (fast path), attention in one masked call against one call per run of rows over "
                  "its own keys (k = 16):", "", "| documents | skipped (masked) share of the slots | one call (ms) "
                  "| by row (ms) | max abs logit diff | same tokens |", "|---|---|---|---|---|---|"]
        for a in results["attention"]:
            lines.append(f"| {a['documents']} ({min(a['lengths'])}-{max(a['lengths'])} tokens) | {a['skipped_share']:.0%} "
                         f"| {a['step_one_call_cpu_s'] * 1e3:.1f} | {a['step_by_row_cpu_s'] * 1e3:.1f} "
                         f"| {a['max_abs_diff']:.1e} | {a['same_greedy_tokens']} |")
    if "bf16" in results:
        b = results["bf16"]
        lines += ["", f"bfloat16 model at k = {b['k']}: decode step {b['step_cpu_s'] * 1e3:.1f} ms (float32 fast "
                  f"{b['float32_step_cpu_s'] * 1e3:.1f}), first logits {b['ttft_cpu_s']:.3f} s (float32 "
                  f"{b['float32_ttft_cpu_s']:.3f}); first-step logits differ from float32 by up to "
                  f"{b['first_step_max_abs_diff_vs_float32']:.2f}; same greedy tokens: {b['same_greedy_tokens_as_float32']}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
