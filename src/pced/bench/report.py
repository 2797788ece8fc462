"""The tables and the plot of ``pced bench`` (bench.json -> bench.md, bench.png)."""

from __future__ import annotations

from pathlib import Path

from .run_floors import with_floor

FLOORS_NOTE = ("[floor, measured / floor] beside each time: a decode step's floor is max(bytes it reads / memory "
               "bandwidth, its FLOPs / GEMM peak); a first token's is the caches' stored bytes / page-cache rate + "
               "max(the prefill's bytes / bandwidth, its FLOPs / peak) (pced.bench.floors).")


def _fmt(value, digits=3) -> str:
    return "n/a" if value is None or value != value else f"{value:.{digits}f}"


def _nan(value) -> float:
    return float("nan") if value is None else value


def _decode(summary: dict) -> str:
    """Decode ms per token with its floor and the ratio: "41.2 [6.1, 6.8x]"."""
    summary = summary or {}
    return with_floor(summary.get("decode_per_token_s"), summary.get("decode_floor_s"), 1000, 1)


def _ttft(summary: dict, kind: str = "") -> str:
    summary = summary or {}
    return with_floor(summary.get(f"ttft{kind}_s"), summary.get(f"ttft{kind}_floor_s"))


def floor_terms(rows: list[dict], method: str = "pced") -> list[str]:
    """The terms of ``method``'s floors at each k: what binds, and by how much."""
    lines = ["| k | decode GB read | decode GFLOP | bytes / bandwidth (ms) | FLOPs / peak (ms) | bound | caches read (MB) | "
             "read (s) | prefill GFLOP | prefill FLOPs / peak (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        floors = (row.get(method) or {}).get("floors")
        if not floors:
            continue
        d, t = floors["decode"], floors["ttft"]
        lines.append(f"| {row['k']} | {d['bytes'] / 1e9:.3f} | {d['flops'] / 1e9:.2f} | {d['memory_s'] * 1000:.1f} | "
                     f"{d['compute_s'] * 1000:.1f} | {d['bound']} | {t['read_bytes'] / 1e6:.1f} | {t['read_s']:.3f} | "
                     f"{t['flops'] / 1e9:.1f} | {t['compute_s']:.3f} |")
    return lines


def markdown_report(results: dict) -> str:
    lines = [f"Model {results['model']} on {results['device']} ({results['dtype']}, {results['threads']} threads); medians. "
             f"Machine: {results['machine']}. Work: {results['work_shape']['described_as']}.", "", FLOORS_NOTE]
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
            "| k | context tokens | PCED TTFT resident (s) | PCED TTFT warm (s) | PCED TTFT cold (s) | PCED suffix forward (s) | all TTFT (s) | all / PCED TTFT | APE TTFT (s) | PCED decode (ms/token) | all decode (ms/token) | APE decode (ms/token) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in length["rows"]:
            p, a, e = row.get("pced") or {}, row.get("all") or {}, row.get("ape") or {}
            ratio = a.get("ttft_s") / p["ttft_s"] if a and p else None
            lines.append(
                f"| {row['k']} | {row['context_tokens']} | {_ttft(p, '_resident')} | {_ttft(p)} | "
                f"{_fmt(p.get('ttft_cold_s'))} | {_fmt(p.get('suffix_forward_s'))} | {_ttft(a)} | {_fmt(ratio, 1)} | "
                f"{_ttft(e)} | {_decode(p)} | {_decode(a)} | {_decode(e)} |"
            )
        lines += ["", "PCED's floors, term by term (resident: the same without the read; cold: no floor, the disk "
                      "is not measured):", ""] + floor_terms(length["rows"])
    storage = results.get("storage", [])
    if storage:
        lines += ["", f"### Storage per dtype ({storage[0]['documents']} documents of {results['config']['doc_tokens'][0]} "
                      "tokens; PCED over all of them, page cache warm)", "",
                  "| dtype | bytes per document token | indexing tokens/s | PCED TTFT (s) [floor, x] | of which cache load (s) |",
                  "|---|---|---|---|---|"]
    for row in storage:
        lines.append(f"| {row['dtype']} | {row['bytes_per_token']:.0f} | {row['tokens_per_s']:.0f} | "
                     f"{with_floor(row.get('pced_ttft_s'), row.get('pced_ttft_floor_s'))} | "
                     f"{_fmt(row.get('pced_cache_load_s'))} |")
    e2e = results.get("end_to_end")
    if e2e:
        lines += ["", f"### End to end: k={e2e['k']}, L={e2e['doc_tokens']}, {e2e['new_tokens']} new tokens", "",
                  "| method | TTFT (s) [floor, x] | total (s) | decode (ms/token) [floor, x] |", "|---|---|---|---|"]
        for method in ("pced", "all"):
            if e2e.get(method):
                m = e2e[method]
                lines.append(f"| {method} | {_ttft(m)} | {m['total_s']:.3f} | {_decode(m)} |")
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


class FloorFigure:
    """Three panels against k: time to first token, decode time (each with its floor, faint) and
    measured / floor; ``None`` from ``open`` where matplotlib is not installed (a GPU machine may
    carry only the bench's own dependencies: the tables are the results, the plot a view of them)."""

    @classmethod
    def open(cls, name: str) -> "FloorFigure | None":
        try:
            import matplotlib
        except ImportError:
            print(f"pced: matplotlib is not installed: no {name} (the tables hold every number)")
            return None
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return cls(plt)

    def __init__(self, plt) -> None:
        self.plt = plt
        self.fig, self.axes = plt.subplots(1, 3, figsize=(16, 4))

    def add(self, ks: list, runs: list[dict], style: str, label: str) -> None:
        """One series: ``runs[i]`` is the run at ``ks[i]`` (ttft_s, decode_per_token_s and their floors)."""
        ttft, decode, ratio = self.axes
        line, = ttft.plot(ks, [m["ttft_s"] for m in runs], style, label=label)
        ttft.plot(ks, [_nan(m.get("ttft_floor_s")) for m in runs], style[:-1], color=line.get_color(), alpha=0.35)
        line, = decode.plot(ks, [m["decode_per_token_s"] * 1000 for m in runs], style, label=label)
        decode.plot(ks, [_nan(m.get("decode_floor_s")) * 1000 for m in runs], style[:-1], color=line.get_color(),
                    alpha=0.35)
        ratio.plot(ks, [_nan(m.get("ttft_vs_floor")) for m in runs], "-" + style[-1], color=line.get_color(),
                   label=f"{label} TTFT")
        ratio.plot(ks, [_nan(m.get("decode_vs_floor")) for m in runs], ":" + style[-1], color=line.get_color(),
                   mfc="none", label=f"{label} decode")

    def save(self, path: Path, title: str, log_ttft: bool = False) -> None:
        ttft, decode, ratio = self.axes
        ratio.axhline(1.0, color="black", lw=0.8)
        for ax, name, unit in ((ttft, "time to first token (faint: floor)", "s"),
                               (decode, "decode time per token (faint: floor)", "ms"), (ratio, "measured / floor", "x")):
            ax.set(xlabel="documents k", ylabel=unit, title=name)
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        if log_ttft:
            ttft.set_yscale("log")
        else:
            for ax in self.axes:
                ax.set_ylim(bottom=0)
        self.fig.suptitle(title, fontsize=9)
        self.fig.tight_layout()
        self.fig.savefig(path, dpi=120)
        self.plt.close(self.fig)


def plot(results: dict, root: Path) -> None:
    """bench.png beside the tables."""
    figure = FloorFigure.open("bench.png")
    if figure is None:
        return
    for length in results["lengths"]:
        L = length["doc_tokens"]
        for method, style in (("pced", "-o"), ("all", "--s"), ("ape", ":^")):
            points = [(r["k"], r[method]) for r in length["rows"] if r.get(method)]
            if points:
                figure.add([k for k, _ in points], [m for _, m in points], style, f"{method} L={L}")
    figure.save(root / "bench.png", f"{results['model']} on {results['device']}: {results['machine_name']}", log_ttft=True)
