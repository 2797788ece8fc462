"""How long pced's metadata commands take from a cold process, and whether they load torch.

Times ``pced --version``, ``pced store list``, ``pced store stats`` and ``pced verify --help`` on a
store of ``--documents`` documents (built once with ``--lazy-kv`` from a synthetic corpus, so that
building it is quick; the store's bytes are the same kind either way), each in a fresh process,
``--repeats`` times: wall seconds and CPU seconds (user + system of the child, which a busy machine
inflates less than wall time), medians, and whether ``torch`` was imported. ``--source DIR`` runs
another checkout's ``src`` (e.g. ``git worktree add /tmp/before <commit>``) for a before/after
table in one run; the rows alternate between sources so that both see the same machine.

    python experiments/startup_times.py --source /tmp/before/src --source src --out docs/bench/startup
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = {"--version": ["--version"], "store list": ["store", "list", "{store}"],
            "store stats": ["store", "stats", "{store}"], "verify --help": ["verify", "--help"]}
PROBE = "import sys, runpy; sys.argv = ['pced'] + sys.argv[1:]; code = 0\n" \
        "try:\n    from pced.cli import main; code = main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code or 0\n" \
        "sys.stderr.write('\\nTORCH=%d\\n' % ('torch' in sys.modules)); sys.exit(code)"


def run(source: Path, args: list[str]) -> tuple[float, float, bool]:
    env = {**os.environ, "PYTHONPATH": str(source)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{args} failed with {source}: {done.stderr[-500:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, "TORCH=1" in done.stderr


def build_store(root: Path, documents: int, source: Path) -> Path:
    store = root / f"store-{documents}"
    if (store / "manifest.json").is_file():
        return store
    root.mkdir(parents=True, exist_ok=True)
    corpus = root / f"corpus-{documents}.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "title": f"Passage {i}",
                                          "text": f"Passage {i} tells of harbour {i % 97}, bell {i % 13} and the "
                                                  f"town of Oskvale in the year {1800 + i}."}) + "\n"
                              for i in range(documents)))
    env = {**os.environ, "PYTHONPATH": str(source)}
    subprocess.run([sys.executable, "-m", "pced.cli", "index", str(corpus), "--out", str(store), "--lazy-kv"],
                   check=True, env=env)
    return store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", action="append", default=None, help="a checkout's src folder (repeatable; default src)")
    parser.add_argument("--documents", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work", default="runs/startup", help="where the store is built (once)")
    parser.add_argument("--out", default="runs/startup")
    args = parser.parse_args()
    sources = [Path(s).resolve() for s in (args.source or ["src"])]
    store = build_store(Path(args.work), args.documents, sources[-1])
    results = {"documents": args.documents, "repeats": args.repeats, "cpu": os.cpu_count(),
               "load_average": os.getloadavg(), "sources": [str(s) for s in sources], "rows": []}
    for name, template in COMMANDS.items():
        command = [part.format(store=store) for part in template]
        samples = {str(s): [] for s in sources}
        for _ in range(args.repeats):  # alternate: both sources see the same moments of the machine
            for source in sources:
                samples[str(source)].append(run(source, command))
        for source, runs in samples.items():
            results["rows"].append({"command": name, "source": source,
                                    "wall_s": statistics.median(r[0] for r in runs),
                                    "cpu_s": statistics.median(r[1] for r in runs), "torch": any(r[2] for r in runs)})
            print(f"{name:14} {Path(source).parent.name:>12}: wall {results['rows'][-1]['wall_s']:.2f} s, "
                  f"CPU {results['rows'][-1]['cpu_s']:.2f} s, torch {'yes' if results['rows'][-1]['torch'] else 'no'}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "startup.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [f"# Start-up of metadata commands ({args.documents}-document store, medians of {args.repeats}, "
             f"load average {results['load_average'][0]:.1f} on {results['cpu']} CPUs)", "",
             "| command | source | wall s | CPU s | imports torch |", "|---|---|---|---|---|"]
    lines += [f"| `pced {r['command']}` | {Path(r['source']).parent.name} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | "
              f"{'yes' if r['torch'] else 'no'} |" for r in results["rows"]]
    (out / "startup.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}/startup.json and startup.md")


if __name__ == "__main__":
    main()
