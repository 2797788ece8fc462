"""The table and the plot of ``pced bench`` with backends side by side (bench_backends.json -> .md, .png)."""

from __future__ import annotations

from pathlib import Path

from .report import FLOORS_NOTE, FloorFigure
from .run_floors import with_floor


def markdown_report(results: dict) -> str:
    cfg = results["config"]
    names = list(results["backends"])
    models = "; ".join(f"{label}: {Path(b['model']).name}" for label, b in results["backends"].items())
    shapes = results.get("work_shapes", {})
    lines = [f"# pced bench, backends side by side: {results['model']}", "",
             f"{results['cpu_count']} CPUs, {results['threads']} threads; documents of {results['doc_tokens']} tokens; "
             f"{cfg['new_tokens']} new tokens per answer (EOS ignored); medians of {cfg['repeats']}; models ({models}).",
             "", f"Machine: {results['machine']}.", "",
             "Work as run: " + "; ".join(f"{label} {shape['described_as']}" for label, shape in shapes.items()) + ".", ""]
    for label, rates in (results.get("kernel_flop_s") or {}).items():
        lines += [f"{label}'s own kernels (one decode step of R rows of one or two cells each; reported beside, not "
                  "the floor): " + ", ".join(f"R = {r}: {v / 1e9:.1f} GFLOP/s"
                                             for r, v in sorted(rates.items(), key=lambda rv: int(rv[0]))) + ".", ""]
    lines += [FLOORS_NOTE + " Every repeat asks a question not asked before, an engine's prefix cache emptied "
              "first, so each backend reads its documents' caches from their files.", "",
              "| k | " + " | ".join(f"{n} TTFT (s) | {n} decode (ms/step)" for n in names) + " |",
              "|---|" + "---|---|" * len(names)]
    for row in results["latency"]:
        cells = [f"{with_floor(row[n]['ttft_s'], row[n].get('ttft_floor_s'))} | "
                 f"{with_floor(row[n]['decode_per_token_s'], row[n].get('decode_floor_s'), 1000, 1)}" for n in names]
        lines.append(f"| {row['k']} | " + " | ".join(cells) + " |")
    lines += ["", "The floors term by term:", "",
              "| backend | k | decode: bytes / bandwidth (ms) | FLOPs / peak (ms) | bound | TTFT: caches read (s) | "
              "prefill FLOPs / peak (s) | prefill bytes / bandwidth (s) |", "|---|---|---|---|---|---|---|---|"]
    for name in names:
        for row in results["latency"]:
            floors = row[name].get("floors")
            if floors:
                d, t = floors["decode"], floors["ttft"]
                lines.append(f"| {name} | {row['k']} | {d['memory_s'] * 1000:.1f} | {d['compute_s'] * 1000:.1f} | "
                             f"{d['bound']} | {t['read_s']:.3f} | {t['compute_s']:.3f} | {t['memory_s']:.3f} |")
    lines += ["", "Stored bytes per document token: " + ", ".join(
        f"{n} {b:,.0f}" for n, b in results["store_bytes_per_token"].items()) + ".", ""]
    return "\n".join(lines)


def plot(results: dict, root: Path) -> None:
    """bench_backends.png: TTFT and decode step against k (faint: their floors) and measured / floor."""
    figure = FloorFigure.open("bench_backends.png")
    if figure is None:
        return
    ks = [row["k"] for row in results["latency"]]
    for name, style in zip(results["backends"], ("-o", "--s", ":^", "-.v", "-D")):
        figure.add(ks, [row[name] for row in results["latency"]], style, name)
    figure.save(root / "bench_backends.png", f"PCED per backend: {results['model']}; {results.get('machine_name', '')}")
