"""The tables and the plot of ``pced bench`` (bench.json -> bench.md, bench.png)."""

from __future__ import annotations

from pathlib import Path


def _fmt(value, digits=3) -> str:
    return "n/a" if value is None or value != value else f"{value:.{digits}f}"


def _decode(summary: dict) -> str:
    """Decode time per token with its bandwidth floor: "0.0412 [0.0061]"."""
    if not summary:
        return _fmt(None)
    floor = summary.get("decode_floor_s")
    return _fmt(summary.get("decode_per_token_s"), 4) + (f" [{floor:.4f}]" if floor is not None else "")


def markdown_report(results: dict) -> str:
    lines = [f"Model {results['model']} on {results['device']} ({results['dtype']}, {results['threads']} threads); medians. "
             f"Decode floors [in brackets]: bytes a step reads (weights {results['weight_bytes'] / 1e9:.2f} GB + each "
             f"row's KV) / measured copy bandwidth {results['copy_bandwidth_gbs']:.1f} GB/s."]
    for length in results["lengths"]:
        s = length["storage"]
        lines += [
            "",
            f"### L = {length['doc_tokens']} tokens per document",
            "",
            f"Indexing {s['documents']} documents ({s['tokens']} tokens): {s['index_s']:.1f} s; "
            f"{s['bytes_per_token']:.0f} bytes per document token on disk.",
            "",
            "TTFT of PCED with its caches resident on the model's device (pced.kv.tiers), in the host page cache "
            "(warm) and read from disk (cold).",
            "",
            "| k | context tokens | PCED TTFT resident (s) | PCED TTFT warm (s) | PCED TTFT cold (s) | suffix-forward floor (s) | TTFT / floor | all TTFT (s) | all / PCED TTFT | APE TTFT (s) | PCED decode/token (s) [floor] | all decode/token (s) [floor] | APE decode/token (s) [floor] |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in length["rows"]:
            p, a, e = row.get("pced") or {}, row.get("all") or {}, row.get("ape") or {}
            ratio = a.get("ttft_s") / p["ttft_s"] if a and p else None
            floor_ratio = p["ttft_s"] / p["suffix_forward_s"] if p else None
            lines.append(
                f"| {row['k']} | {row['context_tokens']} | {_fmt(p.get('ttft_resident_s'))} | {_fmt(p.get('ttft_s'))} | "
                f"{_fmt(p.get('ttft_cold_s'))} | "
                f"{_fmt(p.get('suffix_forward_s'))} | {_fmt(floor_ratio, 2)} | {_fmt(a.get('ttft_s'))} | {_fmt(ratio, 1)} | "
                f"{_fmt(e.get('ttft_s'))} | {_decode(p)} | {_decode(a)} | {_decode(e)} |"
            )
    storage = results.get("storage", [])
    if storage:
        lines += ["", f"### Storage per dtype ({storage[0]['documents']} documents of {results['config']['doc_tokens'][0]} "
                      "tokens; PCED over all of them, page cache warm)", "",
                  "| dtype | bytes per document token | indexing tokens/s | PCED TTFT (s) | of which cache load (s) |",
                  "|---|---|---|---|---|"]
    for row in storage:
        lines.append(f"| {row['dtype']} | {row['bytes_per_token']:.0f} | {row['tokens_per_s']:.0f} | "
                     f"{_fmt(row.get('pced_ttft_s'))} | {_fmt(row.get('pced_cache_load_s'))} |")
    e2e = results.get("end_to_end")
    if e2e:
        lines += ["", f"### End to end: k={e2e['k']}, L={e2e['doc_tokens']}, {e2e['new_tokens']} new tokens", "",
                  "| method | TTFT (s) | total (s) | decode/token (s) [floor] |", "|---|---|---|---|"]
        for method in ("pced", "all"):
            if e2e.get(method):
                m = e2e[method]
                lines.append(f"| {method} | {m['ttft_s']:.3f} | {m['total_s']:.3f} | {_decode(m)} |")
    if results.get("memory"):
        lines += ["", "### Resident memory (fresh process per run)", "",
                  "| method | k | L | RSS before answer (MB) | peak during answer (MB) | extra for the answer (MB) | process peak (MB) |",
                  "|---|---|---|---|---|---|---|"]
        for row in results["memory"]:
            if "error" in row:
                lines.append(f"| {row['method']} | {row['k']} | {row['doc_tokens']} | error | {row['error']} |")
            else:
                lines.append(f"| {row['method']} | {row['k']} | {row['doc_tokens']} | {row['before_answer_rss_mb']:.0f} | "
                             f"{row['answer_peak_rss_mb']:.0f} | {row['answer_extra_mb']:.0f} | {row['peak_rss_mb']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, root: Path) -> None:
    """bench.png beside the tables, where matplotlib is installed (a GPU machine may carry only the
    bench's own dependencies: the tables are the results, the plot a view of them)."""
    try:
        import matplotlib
    except ImportError:
        print("pced: matplotlib is not installed: no bench.png (the tables hold every number)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_decode) = plt.subplots(1, 2, figsize=(11, 4))
    for length in results["lengths"]:
        L = length["doc_tokens"]
        for method, style in (("pced", "-o"), ("all", "--s"), ("ape", ":^")):
            points = [(r["k"], r[method]) for r in length["rows"] if r.get(method)]
            if not points:
                continue
            ks = [k for k, _ in points]
            ax_ttft.plot(ks, [m["ttft_s"] for _, m in points], style, label=f"{method} L={L}")
            ax_decode.plot(ks, [m["decode_per_token_s"] * 1000 for _, m in points], style, label=f"{method} L={L}")
    for ax, title, unit in ((ax_ttft, "time to first token", "s"), (ax_decode, "decode time per token", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("documents k")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_ttft.set_yscale("log")
    fig.suptitle(f"{results['model']} on {results['device']}")
    fig.tight_layout()
    fig.savefig(root / "bench.png", dpi=120)
    plt.close(fig)
