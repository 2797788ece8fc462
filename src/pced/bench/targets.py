"""The GPU targets, read off one ``pced bench`` run: met, not met, or not run (``scripts/gpu_check.sh``).

The targets are the GPU performance goals (docs/gpu.md), for an 8B-shaped model in bf16 with
documents of 2048 tokens, at k = 8, 32 and 64. A run with other k (a dry run on a CPU) reads the
same targets at its own smallest, middle and largest k, and says which k it used; the thresholds
do not move.

    python -m pced.bench.targets RUN/bench.json [--int8 RUN-int8/bench.json] [--tests tests.txt]
        [--seconds S] --out DIR      # prints the table, writes DIR/targets.md and DIR/targets.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from ..fs import atomic_write_json, atomic_write_text

CHECK_SECONDS = 9 * 60  # the whole check on one H100


def _rows(results: dict) -> dict[int, dict]:
    return {row["k"]: row for row in results["lengths"][0]["rows"]} if results and results.get("lengths") else {}


def _get(row: dict | None, method: str, key: str) -> float | None:
    value = ((row or {}).get(method) or {}).get(key)
    return None if value is None or value != value else float(value)  # NaN: not measured


def _bandwidth_floor(row: dict | None, method: str) -> float | None:
    """The decode step's bytes / bandwidth term (runs before the compute term: the whole floor was that term)."""
    term = _get(row, method, "decode_bandwidth_floor_s")
    return term if term is not None else _get(row, method, "decode_floor_s")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets(results: dict, int8: dict | None = None, tests: str | None = None, seconds: float | None = None) -> list[dict]:
    """One row per target: what, the k it was read at, the measured value, the threshold, status."""
    rows = _rows(results)
    ks = sorted(rows)
    small, middle, large = (ks[0], ks[len(ks) // 2], ks[-1]) if ks else (None, None, None)
    at = rows.get
    out = []

    def add(name: str, k: int | None, value: float | None, threshold: float, unit: str, at_most: bool) -> None:
        met = None if value is None else (value <= threshold if at_most else value >= threshold)
        out.append({"target": name, "k": k, "value": value, "unit": unit,
                    "threshold": f"{'≤' if at_most else '≥'} {threshold:g}{unit}",
                    "status": "not run" if met is None else "met" if met else "not met"})

    add("PCED TTFT, caches resident on the device", large, _get(at(large), "pced", "ttft_resident_s"), 0.10, " s", True)
    add("PCED TTFT, caches from the host page cache", large, _get(at(large), "pced", "ttft_s"), 0.6, " s", True)
    int8_rows = _rows(int8) if int8 else {}
    int8_k = max(int8_rows) if int8_rows else None
    add("PCED TTFT, page cache, int8 caches", int8_k, _get(int8_rows.get(int8_k), "pced", "ttft_s"), 0.35, " s", True)
    add("All / PCED TTFT, resident", middle,
        _ratio(_get(at(middle), "all", "ttft_s"), _get(at(middle), "pced", "ttft_resident_s")), 150, "x", False)
    add("All / PCED TTFT, page cache", middle,
        _ratio(_get(at(middle), "all", "ttft_s"), _get(at(middle), "pced", "ttft_s")), 30, "x", False)
    for method, k in (("pced", small), ("pced", middle), ("all", small), ("all", middle)):
        add(f"{'PCED' if method == 'pced' else 'All'} decode per token / its bandwidth floor", k,
            _ratio(_get(at(k), method, "decode_per_token_s"), _bandwidth_floor(at(k), method)), 2, "x", True)
    e2e = results.get("end_to_end") or {}
    add(f"End to end, {e2e.get('new_tokens', '?')} new tokens: All / PCED total time", e2e.get("k"),
        _ratio(_get(e2e, "all", "total_s"), _get(e2e, "pced", "total_s")), 2, "x", False)
    if tests is not None:
        passed = re.search(r"(\d+) passed", tests)
        failed = re.search(r"(\d+) (failed|error)", tests)
        out.append({"target": "Device test lane (PCED_TEST_DEVICE)", "k": None, "value": float(passed.group(1)) if passed else None,
                    "unit": " passed", "threshold": "0 failed",
                    "status": "not run" if passed is None and failed is None else "not met" if failed else "met"})
    if seconds is not None:
        add("The whole check (tests + benches)", None, seconds, CHECK_SECONDS, " s", True)
    out.append({"target": "Ahead of langchain-pced 0.2.0 on TTFT and decode", "k": None, "value": None, "unit": "",
                "threshold": "at every k", "status": "not run (scripts/peer_langchain_pced.py, its own environment)"})
    return out


def markdown(rows: list[dict], results: dict) -> str:
    lines = [f"## GPU targets: {results.get('model', '?')} on {results.get('device', '?')} ({results.get('dtype', '?')})", "",
             "| target | k | measured | target | status |", "|---|---|---|---|---|"]
    for row in rows:
        value = "–" if row["value"] is None else f"{row['value']:.3g}{row['unit']}"
        lines.append(f"| {row['target']} | {row['k'] if row['k'] is not None else '–'} | {value} | {row['threshold']} | "
                     f"{row['status']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pced.bench.targets", description=__doc__.splitlines()[0])
    parser.add_argument("bench", type=Path, help="bench.json of the run")
    parser.add_argument("--int8", type=Path, default=None, help="bench.json of the int8 run, if any")
    parser.add_argument("--tests", type=Path, default=None, help="the CUDA test lane's output")
    parser.add_argument("--seconds", type=float, default=None, help="wall time of the whole check")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    results = json.loads(args.bench.read_text())
    int8 = json.loads(args.int8.read_text()) if args.int8 is not None and args.int8.is_file() else None
    tests = args.tests.read_text() if args.tests is not None and args.tests.is_file() else None
    rows = targets(results, int8, tests, args.seconds)
    text = markdown(rows, results)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "targets.json", {"model": results.get("model"), "device": results.get("device"),
                                                  "targets": rows})
    atomic_write_text(args.out / "targets.md", text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
