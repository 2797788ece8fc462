"""Resident memory of ``pced serve --backend vllm``, per process: pced's own, vLLM's engine core, and
each rank's worker (VmRSS from /proc), after the server is ready and after a question, for each
tensor-parallel size and KV cache setting of ``--grid``; then, with ``--pair``, two servers at once
on their defaults (one rank beside three), as replicas on one machine run.

    python experiments/vllm_memory.py STORE --out runs/vllm-memory [--grid 1:0.5,1:2,3:0.5,3:2] [--pair 1,3]

``--grid``: ``ranks:GiB`` pairs (GiB: ``--kv-cache-gb``, the whole engine's KV cache; ``default``: the
memory share). Saves memory.json and memory.md under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

GIB = 2**30
TITLE = re.compile(r"^VLLM::(EngineCore|Worker(?:_TP(\d+))?)")


def vmrss(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE).group(1)) * 1024


def tree(pid: int) -> dict[str, int]:
    """VmRSS of the server's processes by role: pced, engine core, rank r (others summed as other)."""
    import psutil

    out = {"pced": vmrss(pid)}
    for child in psutil.Process(pid).children(recursive=True):
        try:
            match = TITLE.match(" ".join(child.cmdline()))
            role = ("engine core" if match.group(1) == "EngineCore" else f"rank {int(match.group(2) or 0)}") if match \
                else "other"
            out[role] = out.get(role, 0) + vmrss(child.pid)
        except (psutil.Error, OSError, AttributeError):
            continue
    return out


def start(store: str, port: int, ranks: int, kv: str, log: Path) -> subprocess.Popen:
    flags = [] if kv == "default" else ["--kv-cache-gb", kv]
    process = subprocess.Popen([sys.executable, "-m", "pced.cli", "serve", store, "--backend", "vllm", "--port", str(port),
                                "--tensor-parallel-size", str(ranks), "--log-level", "warning", *flags],
                               stdout=open(log, "w"), stderr=subprocess.STDOUT, env={**os.environ, "PCED_API_KEY": ""})
    return process


def wait_ready(process: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + 1200
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"pced serve exited {process.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("pced serve did not start in 20 minutes")


def question(port: int) -> None:
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/pced/answer", timeout=600,
                       json={"question": "What is the secret code?", "top_k": 8, "top_n": 8, "rerank": False,
                             "max_tokens": 16})
    reply.raise_for_status()


def measure(store: str, servers: list[tuple[int, str]], out: Path, port: int) -> list[dict]:
    """Start ``servers`` ((ranks, kv) each) together, then read each one's memory, ask, read again."""
    running = []
    try:
        for index, (ranks, kv) in enumerate(servers):
            log = out / f"server-tp{ranks}-kv{kv}-{len(servers)}.log"
            running.append((ranks, kv, port + index, start(store, port + index, ranks, kv, log), log))
            wait_ready(running[-1][3], port + index, log)  # one after another: two starts at once share 2 cores
        rows = []
        for ranks, kv, at, process, log in running:
            ready = tree(process.pid)
            question(at)
            rows.append({"ranks": ranks, "kv_cache_gb": kv, "ready": ready, "after_question": tree(process.pid),
                         "ready_line": next((line for line in log.read_text().splitlines()
                                             if "vLLM engine ready" in line), "")})
        return rows
    finally:
        for *_, process, _ in running:
            process.terminate()
        for *_, process, _ in running:
            process.wait(timeout=120)


def table(rows: list[dict], title: str) -> list[str]:
    lines = [f"## {title}", "", "| ranks | KV cache GiB | when | pced | engine core | each rank | replica total |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        for when in ("ready", "after_question"):
            got = row[when]
            ranks = [got[k] for k in sorted(got) if k.startswith("rank")]
            lines.append(f"| {row['ranks']} | {row['kv_cache_gb']} | {when.replace('_', ' ')} | {got['pced'] / GIB:.2f} | "
                         f"{got.get('engine core', 0) / GIB:.2f} | {' / '.join(f'{r / GIB:.2f}' for r in ranks)} | "
                         f"{sum(got.values()) / GIB:.2f} |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store")
    parser.add_argument("--out", default="runs/vllm-memory")
    parser.add_argument("--grid", default="1:0.5,1:2,3:0.5,3:2")
    parser.add_argument("--pair", default="1,3", help="ranks of two servers run at once on their defaults ('' : none)")
    parser.add_argument("--port", type=int, default=8431)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import psutil

    from pced.store import DocumentStore

    documents = len(DocumentStore.open(args.store).documents)
    results = {"machine_gib": psutil.virtual_memory().total / GIB, "cpu_count": os.cpu_count(),
               "store_documents": documents, "grid": [], "pair": []}
    for item in filter(None, args.grid.split(",")):
        ranks, kv = item.split(":")
        results["grid"] += measure(args.store, [(int(ranks), kv)], out, args.port)
        print(json.dumps(results["grid"][-1]), flush=True)
    if args.pair:
        results["pair"] = measure(args.store, [(int(r), "default") for r in args.pair.split(",")], out, args.port)
        print(json.dumps(results["pair"]), flush=True)
    (out / "memory.json").write_text(json.dumps(results, indent=1))
    lines = ["# Resident memory of `pced serve --backend vllm` (GiB, VmRSS)", "",
             f"{results['machine_gib']:.1f} GiB machine, {os.cpu_count()} CPUs; a store of {documents} documents; "
             "each question reads 8 of them.", ""]
    lines += table(results["grid"], "One server at a time")
    if results["pair"]:
        lines += table(results["pair"], "Two servers at once, default memory share")
    (out / "memory.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
