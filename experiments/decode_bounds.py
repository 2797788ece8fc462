"""Where a transformers decode step's time goes, against the bench's floor and against the fastest
kernels torch has on this machine for the same work.

One PCED question on the embedded model (float32, the CPU fast path) over k secret-code documents,
as ``pced bench`` runs it; its floor is the bench's (``pced.bench.run_floors``, the same cached
machine limits). Then:

- the step, wall seconds, median of ``--steps``;
- the step split by the torch profiler: the linear layers and output layer, attention, every
  other op, and the rest of the step outside any op (Python, module calls);
- what the fastest kernels torch has here need for the step's two big parts, each timed on its own:
  the products at the best rate this machine measured for each of the step's shapes (oneDNN's packed
  product or the plain one, the weight hot in cache: ``pced.bench.machine.gemm_rate``), and the
  step's attention at its exact shapes (k + 1 rows, the grouped query heads packed onto their
  key/value head, keys in a buffer with room to grow like pced's, a mask) over every layer's own
  keys, cold, by SDPA (what pced calls), by two matmuls and a softmax, and by the same written as
  elementwise products compiled by ``torch.compile`` (inductor's C++ loops).

    python experiments/decode_bounds.py --threads 2 --k 16 --out docs/bench/decode-bounds
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pced.backends.rows import ExpertRows
from pced.backends.transformers.bench import torch_work_shape
from pced.bench.machine import gemm_name, gemm_rate
from pced.bench.run import secret_code_documents
from pced.bench.run_floors import RunFloors, method_spans
from pced.kv.store import KVStore
from pced.llm import load_model
from pced.text.prompts import RAG_TEMPLATE, PromptBuilder
from results_files import save

PRODUCTS = ("linear", "addmm", "aten::mm", "matmul")
ATTENTION = ("scaled_dot_product", "flash_attention")


def decode_steps(llm, prefix, loaders, suffix, amateur, steps: int, profiler=None) -> list[float]:
    rows = ExpertRows(llm, prefix, loaders, suffix, amateur, steps + 1)
    token, seconds = int(torch.argmax(rows.prefill()[-1])), []
    if profiler is not None:
        profiler.start()
    for _ in range(steps):
        started = time.perf_counter()
        token = int(torch.argmax(rows.advance(token)[-1]))
        seconds.append(time.perf_counter() - started)
    if profiler is not None:
        profiler.stop()
    return seconds


def profile_split(llm, prefix, loaders, suffix, amateur, steps: int) -> dict:
    """Seconds per step by kind of op (the ops' own time on the calling thread) and outside any op."""
    from torch.profiler import ProfilerActivity, profile

    profiler = profile(activities=[ProfilerActivity.CPU])
    wall = sum(decode_steps(llm, prefix, loaders, suffix, amateur, steps, profiler))
    split = {"products": 0.0, "attention": 0.0, "other ops": 0.0}
    for event in profiler.key_averages():
        kind = ("products" if any(p in event.key for p in PRODUCTS) else
                "attention" if any(a in event.key for a in ATTENTION) else "other ops")
        split[kind] += event.self_cpu_time_total / 1e6
    split["outside ops"] = max(0.0, wall - sum(split.values()))
    return {kind: seconds / steps for kind, seconds in split.items()}


def best_products_s(model, floors: RunFloors, rows: int, repeats: int) -> tuple[float, dict]:
    """The step's linear layers and output layer, each at the best rate measured at ``rows`` rows: the
    machine file's, or this run's own ``repeats`` (the best of more tries, as neighbours only lower a rate)."""
    rates, total = {}, 0.0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            inner, outer = module.in_features, module.out_features
            name = gemm_name(torch.float32, rows, inner, outer)
            if name not in rates:
                again = gemm_rate(rows, inner, outer, torch.float32, torch.device("cpu"), repeats, budget_s=3.0)
                rates[name] = max(floors.limits.gemm[name], again)
            total += 2 * rows * inner * outer / rates[name]
    return total, rates


def median_seconds(run, repeats: int) -> float:
    """Wall seconds of ``run()``, median of ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


class Products(torch.nn.Module):
    """A decode step's products alone: every linear layer of a model, in order, on a [rows, in] input."""

    def __init__(self, linears):
        super().__init__()
        self.linears = torch.nn.ModuleList(linears)

    def forward(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [linear(inputs[str(linear.in_features)]) for linear in self.linears]


def compiled_products(fast_model, rows: int, repeats: int = 9) -> dict:
    """Seconds for the step's products (weights cold: each read once per pass) on pced's packed path,
    on the plain one, and compiled by inductor with frozen weights (its default and max-autotune,
    which benchmarks its own C++ GEMM templates against the library's), each against the plain result."""
    import torch._inductor.config as inductor

    plain_model = load_model(None, device="cpu", dtype="float32", linear_kernel="plain").model
    linears = lambda m: [x for x in m.modules() if isinstance(x, torch.nn.Linear)]
    plain, fast = Products(linears(plain_model)).eval(), Products(linears(fast_model)).eval()
    inputs = {str(n): torch.randn(rows, n) for n in {x.in_features for x in plain.linears}}
    result = {}
    with torch.inference_mode():
        reference = plain(inputs)
        inductor.freezing = True
        variants = {"pced's packed products": fast, "plain products": plain}
        for mode in ("default", "max-autotune"):
            torch._dynamo.reset()
            started = time.perf_counter()
            compiled = torch.compile(Products(linears(plain_model)).eval(), mode=mode, dynamic=False)
            compiled(inputs)
            variants[f"torch.compile {mode}, frozen weights (compiled in {time.perf_counter() - started:.0f} s)"] = compiled
        for name, module in variants.items():
            difference = max(float((a - b).abs().max()) for a, b in zip(module(inputs), reference))
            result[name] = {"seconds": median_seconds(lambda: module(inputs), repeats), "max_abs_difference": difference}
    return result


def attention_kernels(config, rows: int, cells: list[int], repeats: int = 9) -> dict:
    """Seconds for one step's attention over every layer, cold (each layer's keys its own), per kernel."""
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    groups, length = config.num_attention_heads // kv_heads, max(cells)
    keys = [torch.randn(rows, kv_heads, length + 64, dim)[:, :, :length] for _ in range(layers)]
    values = [torch.randn(rows, kv_heads, length + 64, dim)[:, :, :length] for _ in range(layers)]
    query, scale = torch.randn(rows, kv_heads, groups, dim), dim ** -0.5
    mask = torch.zeros(rows, 1, 1, length)
    for row, n in enumerate(cells):
        mask[row, ..., n:] = float("-inf")

    def sdpa(k, v):
        return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale)

    def matmuls(k, v):
        return torch.matmul(torch.softmax(torch.matmul(query * scale, k.transpose(-1, -2)) + mask, -1), v)

    def elementwise(k, v):
        scores = (query.unsqueeze(-2) * scale * k.unsqueeze(2)).sum(-1) + mask
        return (scores.softmax(-1).unsqueeze(-1) * v.unsqueeze(2)).sum(-2)

    kernels = {"SDPA (pced's call)": sdpa, "two matmuls + softmax": matmuls,
               "elementwise, torch.compile": torch.compile(elementwise, dynamic=False)}
    reference, result = sdpa(keys[0], values[0]), {}
    for name, kernel in kernels.items():
        difference = float((kernel(keys[0], values[0]) - reference).abs().max())
        every_layer = lambda: [kernel(k, v) for k, v in zip(keys, values)]
        result[name] = {"seconds": median_seconds(every_layer, repeats), "max_abs_difference": difference}
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--doc-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: pced's, half the cores)")
    parser.add_argument("--gemm-repeats", type=int, default=20, help="tries per product shape for its best rate")
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="skip timing the products compiled by torch.compile (about a minute)")
    parser.add_argument("--remeasure", action="store_true", help="measure the machine's limits again")
    parser.add_argument("--out", default="runs/decode-bounds")
    args = parser.parse_args(argv)
    from pced.cli.threads import default_threads

    torch.set_num_threads(args.threads or default_threads())
    llm = load_model(None, device="cpu", dtype="float32")
    docs, question, _ = secret_code_documents(llm, args.k, args.doc_tokens, 0)
    builder = PromptBuilder(llm.tokenizer, RAG_TEMPLATE)
    with tempfile.TemporaryDirectory() as folder:
        store = KVStore(Path(folder), llm, builder, "float16")
        digests = store.add([d.render() for d in docs], progress=False)
        prefix, suffix, amateur = store.prefix(), builder.suffix_ids(question), builder.suffix_ids(question, False)
        loaders = [lambda h=h: store.load(h) for h in digests]
        lengths = [store.load(h).n_tokens for h in digests]
        shape, spans = torch_work_shape(llm.model), method_spans(builder, "pced", lengths, question)
        floors = RunFloors.measure([(shape, spans)], remeasure=args.remeasure)
        floor = floors.decode(shape, spans, args.steps + 1)
        decode_steps(llm, prefix, loaders, suffix, amateur, 3)  # warm: the buffer, the packed weights
        step = statistics.median(decode_steps(llm, prefix, loaders, suffix, amateur, args.steps))
        split = profile_split(llm, prefix, loaders, suffix, amateur, 6)
    rows = len(spans)
    cells = [round(a) for a in (s.start + s.prefill + args.steps // 2 for s in spans)]
    products, rates = best_products_s(llm.model, floors, rows, args.gemm_repeats)
    kv_read = shape.kv_bytes_per_cell * sum(cells) / floors.limits.memory_bandwidth
    kernels = attention_kernels(llm.model.config, rows, cells)
    product_kernels = compiled_products(llm.model, rows) if args.compile else {}
    best_attention = min(k["seconds"] for k in kernels.values())
    results = {
        "machine": floors.header(), "threads": torch.get_num_threads(), "k": args.k, "doc_tokens": args.doc_tokens,
        "rows": rows, "floor": floor.to_json(), "floor_s": floor.floor_s, "step_s": step,
        "step_vs_floor": step / floor.floor_s, "profile_per_step_s": split,
        "best_products_s": products, "best_rates_flop_s": rates, "attention_kv_read_s": kv_read, "attention_kernels": kernels,
        "product_kernels": product_kernels, "best_kernels_s": products + best_attention, "best_kernels_vs_floor": (products + best_attention) / floor.floor_s,
    }
    save(args.out, "decode_bounds", results, markdown(results))
    return results


def markdown(r: dict) -> str:
    ms, floor = (lambda s: f"{s * 1000:.1f}"), r["floor_s"]
    lines = [f"# A decode step against its floor and the fastest kernels (k = {r['k']}, {r['rows']} rows)", "",
             r["machine"], "", f"torch threads: {r['threads']}; documents of {r['doc_tokens']} tokens.", "",
             "| | ms | / floor |", "|---|---|---|",
             f"| floor (bytes {ms(r['floor']['memory_s'])} ms, FLOPs {ms(r['floor']['compute_s'])} ms) | {ms(floor)} | 1.0x |",
             f"| the step, measured | {ms(r['step_s'])} | {r['step_vs_floor']:.1f}x |"]
    lines += [f"| - {kind} (profiled) | {ms(s)} | {s / floor:.2f}x |" for kind, s in r["profile_per_step_s"].items()]
    rates = ", ".join(f"{n.split()[1]} {v / 1e9:.0f}" for n, v in r["best_rates_flop_s"].items())
    lines += [f"| products at the best measured rate per shape (GFLOP/s: {rates}) | {ms(r['best_products_s'])} | {r['best_products_s'] / floor:.2f}x |",
              f"| attention: keys and values / bandwidth | {ms(r['attention_kv_read_s'])} | {r['attention_kv_read_s'] / floor:.2f}x |"]
    lines += [f"| attention, {name} (cold; max abs difference to SDPA {k['max_abs_difference']:.1e}) | {ms(k['seconds'])} | "
              f"{k['seconds'] / floor:.2f}x |" for name, k in r["attention_kernels"].items()]
    lines += [f"| products, {name} (max abs difference to plain {k['max_abs_difference']:.1e}) | {ms(k['seconds'])} | "
              f"{k['seconds'] / floor:.2f}x |" for name, k in r.get("product_kernels", {}).items()]
    lines += [f"| **best products + best attention kernel** | **{ms(r['best_kernels_s'])}** | **{r['best_kernels_vs_floor']:.2f}x** |", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
