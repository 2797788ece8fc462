"""The embedded model's weights in several GGUF formats, each timed by ``pced bench --backend
llamacpp`` against its floor, under one or more builds of llama-cpp-python.

Every format but Q4_1 (the GGUF as it ships) is the shipped file requantized with llama.cpp's own
``llama_model_quantize`` (every tensor in the one type, the tied embedding and output layer too), so
all of them hold the same model. A build is a folder put first on ``PYTHONPATH`` (a ``pip install
--target`` of another llama-cpp-python wheel, e.g. one built with ``GGML_NATIVE=ON``); the empty
path is the environment's own. The builds alternate within each format, so a neighbour's load
falls on both. Each run's floor is the bench's (this machine's limits, the same FLOPs for every
format: a format changes the bytes, and at k + 1 rows the arithmetic binds).

    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" pip wheel --no-deps -w /tmp/native llama-cpp-python==0.3.36
    pip install --no-deps --target /tmp/native/site /tmp/native/*.whl
    python experiments/llamacpp_formats.py --builds portable=,native=/tmp/native/site --out docs/bench/llamacpp-formats
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

from results_files import save

# llama_ftype and ggml_type of each format (llama.h, ggml.h of llama.cpp as vendored by 0.3.36)
FORMATS = {"Q4_1": None, "Q8_0": (7, 8), "Q4_0": (2, 2), "BF16": (32, 30), "F32": (0, 0)}


def requantize(source: str, target: Path, ftype: int, tensor_type: int) -> str:
    """``source`` requantized by llama.cpp into ``target`` (kept: made once): every block tensor in
    llama_ftype ``ftype``, the token embedding and the output layer in ggml type ``tensor_type``."""
    import llama_cpp

    if not target.is_file():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.pure, params.nthread = ftype, True, True, os.cpu_count() or 1
        params.token_embedding_type = params.output_tensor_type = tensor_type
        partial = target.with_suffix(".partial")
        if llama_cpp.llama_model_quantize(source.encode(), str(partial).encode(), ctypes.byref(params)) != 0:
            raise SystemExit(f"llama_model_quantize failed for {target.name}")
        partial.rename(target)
    return str(target)


def requantized(name: str, work: Path) -> str:
    """The embedded GGUF in format ``name`` (as shipped for Q4_1)."""
    from pced.llm import _embedded_gguf

    source = str(_embedded_gguf())
    if FORMATS[name] is None:
        return source
    return requantize(source, work / f"smollm2-135m-{name}.gguf", *FORMATS[name])


def system_info(site: str) -> str:
    code = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode().strip())"
    return subprocess.run([sys.executable, "-c", code], env=_env(site), capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]


def _env(site: str) -> dict:
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH", "")) if p)
    return env


def bench(model: str, site: str, args, out: Path) -> dict:
    command = [sys.executable, "-m", "pced", "--threads", str(args.threads), "bench", "--backend", "llamacpp",
               "--model", model, "--beside", "", "--ks", args.ks, "--doc-tokens", str(args.doc_tokens),
               "--repeats", str(args.repeats), "--out", str(out)]
    subprocess.run(command, env=_env(site), check=True, stdout=subprocess.DEVNULL)
    data = json.loads((out / "bench_backends.json").read_text())
    (label,) = data["backends"]
    rows = {}
    for entry in data["latency"]:
        r = entry[label]
        rows[str(entry["k"])] = {key: r[key] for key in ("ttft_s", "ttft_floor_s", "ttft_vs_floor", "decode_per_token_s",
                                                      "decode_floor_s", "decode_vs_floor")}
    return {"machine": data["machine"], "ks": rows,
            "kernel_flop_s": data["kernel_flop_s"][label], "weights": data["work_shapes"][label]["described_as"]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--builds", default="portable=", help="name=site folder, comma-separated (empty: this environment's)")
    parser.add_argument("--ks", default="16")
    parser.add_argument("--doc-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", default="/tmp/pced-llamacpp-formats")
    parser.add_argument("--out", default="runs/llamacpp-formats")
    args = parser.parse_args(argv)
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    builds = dict(item.split("=", 1) for item in args.builds.split(","))
    results = {"builds": {name: system_info(site) for name, site in builds.items()}, "runs": {}}
    formats = args.formats.split(",")
    for i, name in enumerate(formats):
        model = requantized(name, work)
        order = list(builds) if i % 2 == 0 else list(reversed(builds))
        for build in order:
            print(f"{name} on the {build} build ...", flush=True)
            run = bench(model, builds[build], args, work / f"bench-{build}-{name}")
            run["gguf_bytes"] = Path(model).stat().st_size
            results["runs"][f"{build} {name}"] = run
    results["machine"] = next(iter(results["runs"].values()))["machine"]
    save(out, "llamacpp_formats", results, markdown(results))
    return results


def markdown(results: dict) -> str:
    lines = ["# The embedded model's GGUF formats on llama.cpp, against the floor", "", results["machine"], ""]
    lines += [f"- {name} build: `{info}`" for name, info in results["builds"].items()]
    lines += ["", "| build | weights | GGUF MB | k | TTFT (s) [floor, / floor] | decode (ms) [floor, / floor] | "
              "its products at k + 1 rows (GFLOP/s) |", "|---|---|---|---|---|---|---|"]
    for label, run in results["runs"].items():
        build, name = label.split(" ", 1)
        for k, r in run["ks"].items():
            rate = run["kernel_flop_s"].get(str(int(k) + 1))
            lines.append(f"| {build} | {name} | {run['gguf_bytes'] / 1e6:.1f} | {k} | "
                         f"{r['ttft_s']:.3f} [{r['ttft_floor_s']:.3f}, {r['ttft_vs_floor']:.1f}x] | "
                         f"{r['decode_per_token_s'] * 1e3:.1f} [{r['decode_floor_s'] * 1e3:.1f}, {r['decode_vs_floor']:.1f}x] | "
                         f"{f'{rate / 1e9:.0f}' if rate else 'n/a'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
