"""Which --threads default holds up when the CPU is shared? Times `pced demo` (three questions on
the embedded model, the demo store already built) with each thread count, alone and beside a busy
neighbour (one process spinning on one core), in one run. Prints and saves docs/bench/threads.{json,md}.

    python experiments/threads_bench.py [--repeats 1] [--threads 1,2] [--out docs/bench]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def timed_demo(threads: int, env: dict) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pced.cli", "demo", "--threads", str(threads)], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", default=",".join(str(n) for n in sorted({1, os.cpu_count() or 1})))
    parser.add_argument("--out", default="docs/bench")
    args = parser.parse_args()
    counts = [int(n) for n in args.threads.split(",")]
    env = dict(os.environ)
    subprocess.run([sys.executable, "-m", "pced.cli", "demo"], env=env, check=True, stdout=subprocess.DEVNULL)  # warm
    rows = []
    for neighbour in (False, True):
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if neighbour else None
        try:
            for threads in counts:
                seconds = [timed_demo(threads, env) for _ in range(args.repeats)]
                rows.append({"threads": threads, "busy_neighbour": neighbour, "demo_s": statistics.median(seconds),
                             "runs": seconds})
                print(f"threads={threads} busy_neighbour={neighbour}: pced demo {rows[-1]['demo_s']:.1f} s", flush=True)
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "repeats": args.repeats, "rows": rows}
    (out / "threads.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"`pced demo` wall time, {os.cpu_count()} CPUs, median of {args.repeats}:", "",
             "| --threads | alone (s) | beside one busy core (s) |", "|---|---|---|"]
    for threads in counts:
        alone = next(r["demo_s"] for r in rows if r["threads"] == threads and not r["busy_neighbour"])
        busy = next(r["demo_s"] for r in rows if r["threads"] == threads and r["busy_neighbour"])
        lines.append(f"| {threads} | {alone:.1f} | {busy:.1f} |")
    (out / "threads.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
