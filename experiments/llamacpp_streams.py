"""llama.cpp rows in one unified KV cache against a KV stream per row, and three weight formats.

On the embedded GGUF (SmolLM2-135M-Instruct, Q4_1 as pced ships it), the bench's secret-code
documents of ``--doc-tokens`` tokens (f16 states, stored and read back as pced does), the bench's
question suffix, for each k of ``--ks``:

- time to first token (``LlamaExpertRows.prefill``: the states read from their files in the page
  cache, checksummed, restored, and the question suffix run through every row) and the decode step
  (median of ``--steps`` steps of every row), one unified cache (``LlamaModel.split_streams = False``)
  against a stream per row ("split"), alternated in one run, medians of ``--repeats``;
- the floors: a decode step reads the weights and each row's own cells and computes each row's
  products (``max(bytes / read bandwidth, FLOPs / fp32 GEMM peak)``); the first token reads the
  states from the page cache and computes the suffix (``bytes / page-cache rate + FLOPs / peak``).
  Bandwidth, page-cache rate and the peak (torch fp32 GEMMs at the model's own shapes: the best
  of a whole layer's products at the decode and prefill row counts) are measured here, same threads;
- at ``--profile-k``: each layout's step and suffix forward by ggml op, timed between llama.cpp's
  eval callbacks (every node computed on its own), so attention's share (FLASH_ATTN_EXT); and the
  same rows with documents of a few tokens (what the step costs without attending to documents);
- at ``--quant-k``, split: the embedded weights requantized to Q8_0 and Q4_0 (``llama_model_quantize``,
  every block tensor in the one type, the tied embedding kept Q8_0 as shipped; written under
  ``--work``) against Q4_1, alternated, and whether a row's logits in a step of k + 1 rows equal the
  same row decoded alone (one row per step).

Times are CPU seconds of this process (``time.process_time``), wall seconds beside them in the
JSON: with one thread (``--threads 1``, the default) a CPU second is what a wall second would be
on an idle machine, and a machine shared with other work moves it little. Prints and saves
streams.json and streams.md in ``--out``. The GGUFs and state stores live in ``--work``.

    python experiments/llamacpp_streams.py --threads 1 --out docs/bench/llamacpp-streams
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from llamacpp_formats import requantize
from results_files import save

QUANTS = {"Q4_1": None, "Q8_0": 7, "Q4_0": 2}  # llama_ftype (LLAMA_FTYPE_MOSTLY_*); None: the GGUF as shipped
GGML_TYPE_Q8_0 = 8


# -- the machine -----------------------------------------------------------------------------------
def read_bandwidth(megabytes: int = 512, repeats: int = 7) -> float:
    """Bytes per CPU second a sum over a large float32 tensor reads (best of ``repeats``)."""
    x = torch.ones(megabytes * 2**20 // 4)
    x.sum()
    best = min(_cpu(x.sum) for _ in range(repeats))
    return x.numel() * 4 / best


def page_cache_rate(paths: list[Path], repeats: int = 5) -> float:
    """Bytes per second read from files already in the page cache (best of ``repeats``)."""
    total = sum(p.stat().st_size for p in paths)
    buffer = bytearray(max(p.stat().st_size for p in paths))

    def read_all():
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                f.readinto(buffer)

    read_all()
    return total / min(_cpu(read_all) for _ in range(repeats))


def gemm_rates(shapes: list[tuple[int, int]], rows: list[int], repeats: int = 5) -> dict[int, float]:
    """FLOP/s of torch fp32 ``x @ w.T`` over a whole layer's products (``shapes``: (out, in) of each),
    per row count: the best of ``repeats``."""
    weights = [torch.randn(n_out, n_in) for n_out, n_in in shapes]
    rates = {}
    for m in rows:
        inputs = [torch.randn(m, n_in) for _, n_in in shapes]
        flops = sum(2 * m * w.shape[0] * w.shape[1] for w in weights)

        def layer():
            for x, w in zip(inputs, weights):
                torch.nn.functional.linear(x, w)

        layer()
        rates[m] = flops / min(_cpu(layer) for _ in range(repeats))
    return rates


def _timed(fn) -> tuple[float, float]:
    """Wall and CPU seconds of ``fn()`` (CPU: this process's, every thread)."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def _cpu(fn) -> float:
    return _timed(fn)[1]


# -- the model's sizes -----------------------------------------------------------------------------
def model_sizes(path: str) -> dict:
    """Bytes of the weights as llama.cpp holds them, the block products' parameters, and the
    attention shape, read from the GGUF."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = str(reader.fields["general.architecture"].contents())
    field = lambda name: int(reader.fields[f"{arch}.{name}"].contents())  # noqa: E731
    products, embedding = 0, 0
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            embedding = int(np.prod([int(d) for d in t.shape]))
        elif t.name.endswith(".weight") and len(t.shape) == 2:
            products += int(np.prod([int(d) for d in t.shape]))
    n_head, n_embd = field("attention.head_count"), field("embedding_length")
    return {"weight_bytes": int(sum(int(t.n_bytes) for t in reader.tensors)), "block_params": products,
            "output_params": embedding,  # tied: the output layer is the embedding's matrix
            "n_layer": field("block_count"), "attn_dim": n_embd, "kv_dim": n_embd // n_head * field("attention.head_count_kv"),
            "types": sorted({t.tensor_type.name for t in reader.tensors})}


def layer_shapes(path: str) -> list[tuple[int, int]]:
    import gguf

    reader = gguf.GGUFReader(path)
    return [(int(t.shape[1]), int(t.shape[0])) for t in reader.tensors if t.name.startswith("blk.0.") and len(t.shape) == 2]


def step_flops(sizes: dict, contexts: list[int]) -> float:
    """One decode step: each row's block products, its logits, and attention over its own cells."""
    per_row = 2 * sizes["block_params"] + 2 * sizes["output_params"]
    attention = sum(4 * sizes["n_layer"] * sizes["attn_dim"] * c for c in contexts)
    return len(contexts) * per_row + attention


def prefill_flops(sizes: dict, starts: list[int], lengths: list[int]) -> float:
    """The question suffix through every row: its tokens' block products, attention over each row's
    cells so far, and the last token's logits."""
    flops = 0.0
    for start, n in zip(starts, lengths):
        flops += n * 2 * sizes["block_params"] + 2 * sizes["output_params"]
        flops += sum(4 * sizes["n_layer"] * sizes["attn_dim"] * (start + i + 1) for i in range(n))
    return flops


# -- llama.cpp ------------------------------------------------------------------------------------
DECODE_CPU: list[float] = []  # CPU seconds of each LlamaContext.decode call (see count_decode_cpu)


def count_decode_cpu() -> None:
    """Record each ``LlamaContext.decode`` call's CPU seconds: the prefill's suffix forward apart from its state loads."""
    from pced.backends.llamacpp.model import LlamaContext

    decode = LlamaContext.decode

    def timed(self, *args, **kwargs):
        started = time.process_time()
        try:
            return decode(self, *args, **kwargs)
        finally:
            DECODE_CPU.append(time.process_time() - started)

    LlamaContext.decode = timed


def quantized(source: str, name: str, ftype: int | None, work: Path) -> str:
    if ftype is None:
        return source
    # the tied embedding and output layer in Q8_0, as the shipped GGUF holds them
    return requantize(source, work / f"smollm2-135m-{name}.gguf", ftype, GGML_TYPE_Q8_0)


class Bench:
    """One GGUF: a split and a unified model (two contexts, so alternating never rebuilds one), its
    state store, the documents and the question."""

    def __init__(self, path: str, threads: int, work: Path, n_docs: int, doc_tokens: int, seed: int, n_store: int):
        from pced.backends.llamacpp.model import LlamaModel
        from pced.backends.llamacpp.states import StateStore
        from pced.evaluation.secret_code import make_secret_code
        from pced.backends.llamacpp.settings import LlamaSettings
        from pced.text.prompts import RAG_TEMPLATE, PromptBuilder

        settings = LlamaSettings(threads=threads)
        self.split = LlamaModel(path, settings)
        self.unified = LlamaModel(path, settings)
        self.unified.split_streams = False
        builder = PromptBuilder(self.split.tokenizer, RAG_TEMPLATE)
        example = make_secret_code(self.split.tokenizer, n_docs=n_docs, doc_tokens=doc_tokens, seed=seed).examples[0]
        self.store = StateStore(work / f"states-{self.split.fingerprint}", self.split, builder)
        self.digests = self.store.add([d.render() for d in example.documents[:n_store]])
        self.prefix = self.store.prefix()
        self.suffix = builder.suffix_ids(example.question)
        self.amateur = builder.suffix_ids(example.question, with_context=False)
        self.token = builder.encode(" The")[0]
        self.builder = builder

    def model(self, layout: str):
        return self.split if layout == "split" else self.unified

    def rows(self, layout: str, k: int, steps: int, digests=None):
        from pced.backends.llamacpp.rows import LlamaExpertRows

        digests = digests or self.digests[:k]
        return LlamaExpertRows(self.model(layout), self.prefix, [lambda d=d: self.store.load(d) for d in digests],
                               self.suffix, self.amateur, steps + 1)

    def answer(self, layout: str, k: int, steps: int, digests=None) -> dict:
        rows = self.rows(layout, k, steps, digests)
        try:
            DECODE_CPU.clear()
            ttft = _timed(rows.prefill)
            suffix = sum(DECODE_CPU)  # the prefill's one decode: the question suffix through every row
            times = [_timed(lambda: rows.advance(self.token)) for _ in range(steps)]
        finally:
            rows.close()
        return {"ttft_s": ttft[1], "step_s": statistics.median(t[1] for t in times), "suffix_forward_s": suffix,
                "cache_load_s": ttft[1] - suffix, "ttft_wall_s": ttft[0], "step_wall_s": statistics.median(t[0] for t in times),
                "cache_load_wall_s": rows.timings["cache_load_s"], "suffix_forward_wall_s": rows.timings["suffix_forward_s"]}

    def state_paths(self, k: int) -> list[Path]:
        return [self.store.root / "prefix.safetensors"] + [self.store.path_for(d) for d in self.digests[:k]]


def op_profile(bench: Bench, layout: str, k: int, steps: int) -> dict:
    """Shares of CPU seconds per ggml op, in the suffix forward and over ``steps`` decode steps, timed
    between eval callbacks (asked about every node, the scheduler computes one node at a time:
    ggml/src/ggml-backend.cpp:1819-1849), on a model of its own (its contexts made with the callback)."""
    import llama_cpp

    from pced.backends.llamacpp.model import LlamaModel

    ggml = ctypes.CDLL(str(next(Path(llama_cpp.__file__).parent.glob("lib/libggml-base.so*"))))
    ggml.ggml_op_desc.restype, ggml.ggml_op_desc.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    totals: dict[str, float] = {}
    state = {"last": 0.0, "on": False, "first": False}

    def observe(tensor, ask, _data):
        if ask:
            return True
        now = time.process_time()
        if state["on"]:  # the first node of a step also carries the graph's build and inputs
            op = "(set-up)" if state["first"] else ggml.ggml_op_desc(tensor).decode()
            totals[op] = totals.get(op, 0.0) + now - state["last"]
        state["last"], state["first"] = now, False
        return True

    callback = llama_cpp.ggml_backend_sched_eval_callback(observe)

    class WithCallback:
        def __getattr__(self, name):
            return getattr(llama_cpp, name)

        def llama_context_default_params(self):
            params = llama_cpp.llama_context_default_params()
            params.cb_eval, params.cb_eval_user_data = callback, None
            return params

    source = bench.model(layout)
    model = LlamaModel(source.path, source.settings)
    model.split_streams = source.split_streams
    model.lib = WithCallback()
    original = bench.split, bench.unified
    bench.split = bench.unified = model
    rows = bench.rows(layout, k, steps)

    def shares() -> dict:
        total = sum(totals.values())
        top = {op: t / total for op, t in sorted(totals.items(), key=lambda x: -x[1])[:10]}
        return {"cpu_s": total, "ops": top, "attention_share": totals.get("FLASH_ATTN_EXT", 0.0) / total}

    try:
        state["on"], state["last"], state["first"] = True, time.process_time(), True
        rows.prefill()  # "(set-up)": restoring the states and building the first graph
        state["on"] = False
        prefill = shares()
        totals.clear()
        rows.advance(bench.token)
        state["on"] = True
        for _ in range(steps):
            state["last"], state["first"] = time.process_time(), True
            rows.advance(bench.token)
        state["on"] = False
    finally:
        rows.close()
        bench.split, bench.unified = original
    step = shares()
    return {"step_s": step["cpu_s"] / steps, "ops": step["ops"], "attention_share": step["attention_share"],
            "prefill": prefill}


def row_alone_difference(bench: Bench, k: int) -> float:
    """Largest |logit| difference between expert 1's next logits in a step of k + 1 rows and the same
    row decoded alone (its own context, one row per step)."""
    from pced.backends.llamacpp.states import restore_expert

    rows = bench.rows("split", k, 2)
    try:
        rows.prefill()
        batched = rows.advance(bench.token)[1]
    finally:
        rows.close()
    llm, state = bench.split, bench.store.load(bench.digests[0])
    start = bench.prefix.n_tokens + state.n_tokens
    with llm.lock:
        ctx = llm.context(start + len(bench.suffix) + 2, 1)
        restore_expert(ctx, 0, bench.prefix, state)
        tail = bench.suffix
        ctx.decode(tail, range(start, start + len(tail)), [0] * len(tail), [False] * len(tail))
        alone = ctx.decode([bench.token], [start + len(tail)], [0], [True])[0]
    return float((batched - alone).abs().max())


# -- the run --------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ks", default="4,8,16,32")
    parser.add_argument("--doc-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile-k", type=int, default=16)
    parser.add_argument("--quant-k", type=int, default=16)
    parser.add_argument("--quants", default=",".join(QUANTS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", default="/tmp/pced-llamacpp-streams")
    parser.add_argument("--out", default="runs/llamacpp-streams")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",") if k.strip().isdigit()]
    quants = [q for q in args.quants.split(",") if q]
    if len(ks) != len(args.ks.split(",")) or min(ks) < 1 or any(q not in QUANTS for q in quants) or min(args.repeats, args.steps, args.threads,
                                                                              args.doc_tokens, args.quant_k, args.profile_k) < 1:
        raise SystemExit(f"llamacpp_streams: --ks must be positive integers and --quants among {','.join(QUANTS)}; "
                         "--repeats, --steps, --threads, --doc-tokens, --quant-k and --profile-k at least 1")
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    from pced.backends.llamacpp.model import resolve_gguf

    source = str(resolve_gguf(None))
    count_decode_cpu()
    n_docs = max(ks + [args.quant_k])
    main_bench = Bench(source, args.threads, work, n_docs, args.doc_tokens, args.seed, n_docs)
    sizes = model_sizes(source)
    kv_cell = main_bench.prefix.nbytes / main_bench.prefix.n_tokens  # bytes per cell, f16 (state metadata included)
    p, s, a = main_bench.prefix.n_tokens, len(main_bench.suffix), len(main_bench.amateur)
    print(f"prefix {p}, suffix {s} (amateur {a}) tokens; documents {args.doc_tokens}; {args.threads} threads")

    machine = {"read_bandwidth_gb_s": read_bandwidth() / 1e9,
               "page_cache_gb_s": page_cache_rate(main_bench.state_paths(max(ks))) / 1e9}
    decode_rows, prefill_rows = sorted({k + 1 for k in ks}), sorted({(k + 1) * s for k in ks})
    rates = gemm_rates(layer_shapes(source) + [(sizes["output_params"] // sizes["attn_dim"], sizes["attn_dim"])],
                       decode_rows + prefill_rows)
    machine["gemm_gflop_s"] = {str(m): r / 1e9 for m, r in rates.items()}
    peak = max(rates.values())
    machine["gemm_peak_gflop_s"] = peak / 1e9
    print(json.dumps(machine, indent=1))

    for layout in ("unified", "split"):  # contexts made and pages touched before any timing
        main_bench.answer(layout, max(ks), 2)
    results = {"machine": machine, "threads": args.threads, "cpu": platform.processor() or platform.machine(),
               "cpu_count": os.cpu_count(), "load_average": os.getloadavg(), "model": sizes, "prefix_tokens": p,
               "suffix_tokens": s, "amateur_suffix_tokens": a, "doc_tokens": args.doc_tokens, "steps": args.steps,
               "repeats": args.repeats, "layouts": [], "quants": []}
    for k in ks:
        runs = {"unified": [], "split": []}
        for r in range(args.repeats):
            for layout in (("unified", "split") if r % 2 == 0 else ("split", "unified")):
                runs[layout].append(main_bench.answer(layout, k, args.steps))
        contexts = [p + a] + [p + args.doc_tokens + s] * k
        floor_step = max((sizes["weight_bytes"] + kv_cell * sum(contexts)) / (machine["read_bandwidth_gb_s"] * 1e9),
                         step_flops(sizes, contexts) / peak)
        state_bytes = sum(f.stat().st_size for f in main_bench.state_paths(k))
        flops = prefill_flops(sizes, [p] + [p + args.doc_tokens] * k, [a] + [s] * k)
        floor_ttft = state_bytes / (machine["page_cache_gb_s"] * 1e9) + flops / peak
        row = {"k": k, "floor_step_s": floor_step, "floor_ttft_s": floor_ttft, "prefill_gflop": flops / 1e9}
        for layout, values in runs.items():
            med = {key: statistics.median(v[key] for v in values) for key in values[0]}
            med["runs"] = values
            med["step_over_floor"], med["ttft_over_floor"] = med["step_s"] / floor_step, med["ttft_s"] / floor_ttft
            med["prefill_gflop_s"] = flops / 1e9 / med["suffix_forward_s"]
            row[layout] = med
        results["layouts"].append(row)
        print(f"k={k}: step {row['unified']['step_s'] * 1e3:.1f} -> {row['split']['step_s'] * 1e3:.1f} ms "
              f"(floor {floor_step * 1e3:.1f}); TTFT {row['unified']['ttft_s']:.2f} -> {row['split']['ttft_s']:.2f} s "
              f"(floor {floor_ttft:.2f})", flush=True)

    k = args.profile_k
    short = main_bench.store.add(["Vantor."])[0]  # a document of a few tokens: the same rows, almost nothing to attend to
    profile = {"k": k, "short_document_tokens": main_bench.store.load(short).n_tokens}
    for layout in ("unified", "split"):
        profile[layout] = op_profile(main_bench, layout, k, max(4, args.steps // 2))
        without = [main_bench.answer(layout, k, args.steps, [short] * k)["step_s"] for _ in range(args.repeats)]
        profile[layout]["step_without_documents_s"] = statistics.median(without)
        print(f"profile k={k} {layout}: attention {profile[layout]['attention_share']:.0%} of the step; "
              f"step without documents {profile[layout]['step_without_documents_s'] * 1e3:.1f} ms", flush=True)
    results["profile"] = profile

    benches = {"Q4_1": main_bench}
    for name in quants:
        if name not in benches:
            benches[name] = Bench(quantized(source, name, QUANTS[name], work), args.threads, work, n_docs,
                                  args.doc_tokens, args.seed, args.quant_k)
    k = args.quant_k
    runs = {name: [] for name in quants}
    for name in quants:
        benches[name].answer("split", k, 2)
    for r in range(args.repeats):
        for name in (quants if r % 2 == 0 else quants[::-1]):
            runs[name].append(benches[name].answer("split", k, args.steps))
    for name in quants:
        qs = model_sizes(benches[name].split.path)
        row = {"quant": name, "k": k, "weight_bytes": qs["weight_bytes"], "types": qs["types"],
               "ttft_s": statistics.median(r["ttft_s"] for r in runs[name]),
               "step_s": statistics.median(r["step_s"] for r in runs[name]),
               "suffix_forward_s": statistics.median(r["suffix_forward_s"] for r in runs[name]),
               "row_alone_max_abs_diff": row_alone_difference(benches[name], k), "runs": runs[name]}
        results["quants"].append(row)
        print(f"{name}: TTFT {row['ttft_s']:.2f} s, step {row['step_s'] * 1e3:.1f} ms, "
              f"row alone differs by {row['row_alone_max_abs_diff']:.3g}", flush=True)

    save(args.out, "streams", results, markdown(results))


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [f"CPU seconds; {results['threads']} thread(s), {results['cpu_count']} cores, load average at start "
             f"{results['load_average'][0]:.1f} (the machine was shared); read bandwidth {m['read_bandwidth_gb_s']:.1f} GB/s, "
             f"page cache {m['page_cache_gb_s']:.1f} GB/s, torch fp32 GEMM peak at the model's shapes "
             f"{m['gemm_peak_gflop_s']:.1f} GFLOP/s; prefix {results['prefix_tokens']}, suffix {results['suffix_tokens']} "
             f"tokens, documents {results['doc_tokens']} tokens; medians of {results['repeats']} (decode: of "
             f"{results['steps']} steps each)", "",
             "| k | decode ms/step unified | split | floor | split / floor | TTFT s unified | split | floor | split / floor "
             "| suffix forward s unified | split | split GFLOP/s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["layouts"]:
        u, s = r["unified"], r["split"]
        lines.append(f"| {r['k']} | {u['step_s'] * 1e3:.1f} | {s['step_s'] * 1e3:.1f} | {r['floor_step_s'] * 1e3:.1f} | "
                     f"{s['step_over_floor']:.1f}x | {u['ttft_s']:.2f} | {s['ttft_s']:.2f} | {r['floor_ttft_s']:.2f} | "
                     f"{s['ttft_over_floor']:.1f}x | {u['suffix_forward_s']:.2f} | {s['suffix_forward_s']:.2f} | "
                     f"{s['prefill_gflop_s']:.1f} |")
    p = results.get("profile")
    if p:
        lines += ["", f"At k = {p['k']}, by ggml op (eval-callback timing, every node on its own):", "",
                  f"| layout | step ms (profiled) | attention (FLASH_ATTN_EXT) | step ms with {p['short_document_tokens']}-token documents | top ops | suffix forward: attention | its top ops |",
                  "|---|---|---|---|---|---|---|"]
        for layout in ("unified", "split"):
            q = p[layout]
            ops = ", ".join(f"{op} {share:.0%}" for op, share in list(q["ops"].items())[:3])
            prefill_ops = ", ".join(f"{op} {share:.0%}" for op, share in list(q["prefill"]["ops"].items())[:3])
            lines.append(f"| {layout} | {q['step_s'] * 1e3:.1f} | {q['attention_share']:.0%} | "
                         f"{q['step_without_documents_s'] * 1e3:.1f} | {ops} | {q['prefill']['attention_share']:.0%} | {prefill_ops} |")
    if results["quants"]:
        lines += ["", "Weights (split layout, f16 KV):", "",
                  "| weights | GGUF MB | TTFT s | suffix forward s | decode ms/step | row in a step of k+1 rows vs alone, max abs logit diff |",
                  "|---|---|---|---|---|---|"]
        for q in results["quants"]:
            lines.append(f"| {q['quant']} (k = {q['k']}) | {q['weight_bytes'] / 1e6:.1f} | {q['ttft_s']:.2f} | "
                         f"{q['suffix_forward_s']:.2f} | {q['step_s'] * 1e3:.1f} | {q['row_alone_max_abs_diff']:.3g} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
