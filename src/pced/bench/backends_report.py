"""The table and the plot of ``pced bench`` with backends side by side (bench_backends.json -> .md, .png)."""

from __future__ import annotations

from pathlib import Path

from .report import FLOORS_NOTE
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
                  "the floor): " + ", ".join(f"R = {r}: {v / 1e9:.1f} GFLOP/s" for r, v in rates.items()) + ".", ""]
    lines += [FLOORS_NOTE + " A backend whose engine holds the documents before the clock starts (vLLM's prefix "
              "cache) reads nothing for its first token; as the bench asks one question again at every repeat, such an "
              "engine may find the question's suffix cached too and prefill less than the floor counts (a TTFT "
              "below 1x its floor).", "",
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
    try:
        import matplotlib
    except ImportError:
        print("pced: matplotlib is not installed: no bench_backends.png (the table holds every number)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_decode, ax_ratio) = plt.subplots(1, 3, figsize=(16, 4))
    ks = [row["k"] for row in results["latency"]]
    nan = float("nan")
    for name, style in zip(results["backends"], ("-o", "--s", ":^", "-.v", "-D")):
        series = [row[name] for row in results["latency"]]
        line, = ax_ttft.plot(ks, [r["ttft_s"] for r in series], style, label=name)
        ax_ttft.plot(ks, [r.get("ttft_floor_s") or nan for r in series], style[:-1], color=line.get_color(), alpha=0.35)
        line, = ax_decode.plot(ks, [r["decode_per_token_s"] * 1000 for r in series], style, label=name)
        ax_decode.plot(ks, [(r.get("decode_floor_s") or nan) * 1000 for r in series], style[:-1], color=line.get_color(),
                       alpha=0.35)
        ax_ratio.plot(ks, [r.get("ttft_vs_floor") or nan for r in series], "-" + style[-1], color=line.get_color(),
                      label=f"{name} TTFT")
        ax_ratio.plot(ks, [r.get("decode_vs_floor") or nan for r in series], ":" + style[-1], color=line.get_color(),
                      mfc="none", label=f"{name} decode")
    ax_ratio.axhline(1.0, color="black", lw=0.8)
    for ax, title, unit in ((ax_ttft, "time to first token (faint: floor)", "s"),
                            (ax_decode, "decode step (faint: floor)", "ms"), (ax_ratio, "measured / floor", "x")):
        ax.set(xlabel="documents k", ylabel=unit, title=title)
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"PCED per backend: {results['model']}; {results.get('machine_name', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(root / "bench_backends.png", dpi=120)
    plt.close(fig)
