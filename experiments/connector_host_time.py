"""Host work per loaded token of pced's vLLM connector, an earlier revision's load path against this
tree's, in one run on one machine (docs/gpu.md, "Loads off the critical path").

    python experiments/connector_host_time.py --baseline 8154293 --out docs/bench/connector-host

Writes a synthetic store of Llama-3.1-8B's KV shape (32 layers, 8 KV heads, head_dim 128; random
values, the file format pced writes) in float16 and int8, a 32-token prefix and documents of
``--doc-tokens`` tokens, then times a worker's whole load of one document (after a prefix-cache hit:
the document alone), the model's dtype bfloat16, the files already verified, through a writer that
does nothing (on a GPU the writer is the device's work):

- ``baseline``: the revision's connector (``git show REV:src/pced/backends/vllm/...``);
- ``cpu path``: this tree's connector on the CPU (everything it does, the device's share included);
- ``gpu host part``: what this tree's loader leaves to the host on a GPU: each layer's stored bytes
  copied from the mapped file into the (pinned) staging buffer (``loader.stage_into``); the copy to
  the device, the dequantization and the writer are queued on the device.

Medians (and minima) of ``--repeats`` runs taken in turn, in microseconds per loaded token, and the
host reads of device data each load path makes (``tests/helpers/host_reads.py``). Then the model of
docs/gpu.md: the load's per-token cost (the larger of the measured staging and the link) and fixed
cost per document against an H100's recompute, and the fewest documents k at which loading wins,
every assumption a constant below.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

LAYERS, HEADS, HEAD_DIM, PREFIX, BLOCK = 32, 8, 128, 32, 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def write_store(root: Path, storage: str, doc_tokens: list[int]) -> dict[int, str]:
    """kvstore.json, prefix.safetensors and one document per length, as pced.kv.store writes them."""
    from pced.fs import atomic_save_tensors, atomic_write_json
    from pced.kv.format import FORMAT_VERSION, content_hash, tensor_checksum
    from pced.kv.segment import DocKV

    identity = {"format": FORMAT_VERSION, "model_fingerprint": "synthetic-llama-3.1-8b-kv", "tokenizer_hash": "-",
                "template": "-", "template_hash": "-", "storage_dtype": storage}
    atomic_write_json(root / "kvstore.json", {**identity, "model": "synthetic"})
    generator = torch.Generator().manual_seed(0)

    def save(path: Path, digest: str, tokens: int) -> None:
        shape = (LAYERS, HEADS, tokens, HEAD_DIM)
        kv = DocKV(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)).stored_as(storage)
        meta = {k: str(v) for k, v in identity.items()}
        meta.update(model="synthetic", content_hash=digest, n_tokens=str(tokens),
                    checksum=tensor_checksum(list(kv.tensors().values())))
        atomic_save_tensors(path, kv.tensors(), meta)

    save(root / "prefix.safetensors", "prefix", PREFIX)
    digests = {}
    for tokens in doc_tokens:
        digest = content_hash(f"document of {tokens} tokens")
        save(root / "kv" / digest[:2] / f"{digest}.safetensors", digest, tokens)
        digests[tokens] = digest
    return digests


def baseline_package(revision: str, folder: Path) -> str:
    """The revision's connector and kv_layout as a package of their own (relative imports pointed at
    this tree's pced for everything else, which the load path shares)."""
    package = folder / "pced_baseline"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in ("connector", "kv_layout"):
        source = subprocess.run(["git", "show", f"{revision}:src/pced/backends/vllm/{name}.py"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout
        source = (source.replace("from ...", "from pced.").replace("from .kv_layout", "from pced_baseline.kv_layout")
                  .replace("from .store_kv", "from pced.backends.vllm.store_kv"))
        (package / f"{name}.py").write_text(source)
    sys.path.insert(0, str(folder))
    return "pced_baseline.connector"


def silent_layers() -> dict:
    impl = SimpleNamespace(num_kv_heads=HEADS, head_size=HEAD_DIM, do_kv_cache_update=lambda *args: None)
    backend = SimpleNamespace(forward_includes_kv_cache_update=False, get_name=lambda: "none")
    return {name: SimpleNamespace(kv_cache=torch.zeros(1), impl=impl, attn_backend=backend,
                                  kv_sharing_target_layer_name=None) for name in NAMES}


def build(module_name: str, layers: dict):
    import vllm.distributed.parallel_state as parallel_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    parallel_state.get_tensor_model_parallel_world_size = lambda: 1
    parallel_state.get_tensor_model_parallel_rank = lambda: 0
    module = importlib.import_module(module_name)
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(), cache_config=SimpleNamespace(block_size=BLOCK),
                             compilation_config=SimpleNamespace(static_forward_context=layers),
                             model_config=SimpleNamespace(dtype=torch.bfloat16))
    connector = module.PCEDStoreConnector(config, KVConnectorRole.WORKER, None)
    connector.register_kv_caches({name: layer.kv_cache for name, layer in layers.items()})
    return module, connector


def load_once(module, connector, spec, new: bool) -> None:
    blocks = list(range(1, 2 + spec.tokens // BLOCK))
    load = module.StoreLoad("r", spec, PREFIX, [blocks] if new else blocks)
    connector.bind_connector_metadata(module.StoreLoads([BLOCK] if new else BLOCK, [load]))
    connector.start_load_kv(None)
    for name in NAMES:
        connector.wait_for_layer_load(name)
    assert not connector.get_block_ids_with_load_errors()


def staging_once(files, spec) -> int:
    from pced.backends.vllm.kv_layout import segment_chunks, stored_parts
    from pced.backends.vllm.loader import stage_into

    chunks = segment_chunks(files.segments(spec), PREFIX, spec.tokens)
    buffer, total = None, 0
    for layer in range(LAYERS):
        parts = [t for chunk in chunks for t in stored_parts(chunk, layer, slice(0, HEADS))]
        size = sum(t.numel() * t.element_size() for t in parts) + 64 * len(parts)
        if buffer is None or buffer.numel() < size:
            buffer = torch.empty(size, dtype=torch.uint8)
        stage_into(parts, buffer)
        total += size
    return total


# the model of docs/gpu.md: every assumption, stated once
KV_BYTES_BF16 = 2 * LAYERS * HEADS * HEAD_DIM * 2  # keys and values, bfloat16, per token
LINKS_GBPS = {"PCIe 4.0 x16": 25.0, "PCIe 5.0 x16": 50.0, "NVLink-C2C (GH200)": 450.0}  # achieved host->device
H100_BF16_TFLOPS, MFU = 989.4, 0.6  # H100 SXM dense bfloat16 peak; share a prefill reaches
WEIGHT_BYTES, HBM_TBPS = 16.06e9, 3.35  # Llama-3.1-8B in bfloat16; H100 SXM HBM3
MATMUL_PARAMS = 8_030_261_248 - 2 * 128_256 * 4096  # Llama-3.1-8B less its embedding and output layers


def prefill_flops(tokens: int, position: float) -> float:
    """Floating-point operations to prefill ``tokens`` tokens at mean position ``position``."""
    return tokens * (2 * MATMUL_PARAMS + 4 * LAYERS * HEADS * 4 * HEAD_DIM * position)


def crossover(rows: list[dict], lengths=(64, 128, 512, 2048), ks=range(1, 129)) -> dict:
    """Per document length: recompute against load per token, and the smallest k where loading k
    documents costs less than recomputing them. Both hide under the question's own forward up to its
    weight-read floor (WEIGHT_BYTES / HBM); the load's per-token cost is the larger of the host's
    staging (measured here: the minimum of the runs, the copy undisturbed by the other processes of a
    shared machine, whose medians it also reports) and the link; its fixed cost per document is the
    measured rest."""
    floor = WEIGHT_BYTES / (HBM_TBPS * 1e12)
    rate = H100_BF16_TFLOPS * 1e12 * MFU
    out = {"floor_ms": floor * 1e3, "rate_tflops": rate / 1e12, "storage": {}}
    for storage in ("float16", "int8"):
        by_length = {r["doc_tokens"]: r["gpu host part min"] for r in rows if r["storage"] == storage}
        longest, shortest = max(by_length), min(by_length)
        per_token = by_length[longest] * 1e-6
        fixed = max(0.0, (by_length[shortest] * 1e-6 - per_token) * shortest)
        stored_bytes = KV_BYTES_BF16 if storage == "float16" else [r for r in rows if r["storage"] == storage][0][
            "staged bytes per token"]
        entry = {"host_us_per_token": per_token * 1e6, "fixed_ms_per_document": fixed * 1e3, "links": {}}
        for link, gbps in LINKS_GBPS.items():
            load_token = max(per_token, stored_bytes / (gbps * 1e9))
            table = {}
            for length in lengths:
                recompute = prefill_flops(length, PREFIX + length / 2) / rate
                load = fixed + length * load_token
                k = next((k for k in ks if k * load < max(k * recompute, floor) and k * recompute > floor), None)
                table[length] = {"recompute_ms": recompute * 1e3, "load_ms": load * 1e3, "k": k}
            entry["links"][link] = {"load_us_per_token": load_token * 1e6, "by_length": table}
        out["storage"][storage] = entry
    return out


def model_text(model: dict) -> list[str]:
    lines = ["## The load against a recompute on an H100 (docs/gpu.md)", "",
             "Load: the minima of `gpu host part` above (staging, one host thread as vLLM's GPU workers run) "
             "or the link, whichever is slower, plus the fixed cost per document they imply.", "",
             f"Recompute: Llama-3.1-8B prefill FLOPs at {model['rate_tflops']:.0f} TFLOP/s (H100 SXM bfloat16 "
             f"{H100_BF16_TFLOPS} dense x {MFU}); both hide under the question's forward up to its "
             f"{model['floor_ms']:.1f} ms weight-read floor. k: the fewest documents at which loading costs less.", "",
             "| stored | link | load µs/token | L=64 | L=128 | L=512 | L=2048 |", "|---|---|---|---|---|---|---|"]
    for storage, entry in model["storage"].items():
        for link, row in entry["links"].items():
            cells = [f"{v['load_ms']:.2f} vs {v['recompute_ms']:.2f} ms, k={v['k'] or 'never'}"
                     for v in row["by_length"].values()]
            lines.append(f"| {storage} | {link} | {row['load_us_per_token']:.2f} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"{storage}: host {e['host_us_per_token']:.2f} µs/token, {e['fixed_ms_per_document']:.2f} ms fixed "
              "per document" for storage, e in model["storage"].items()]
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the git revision whose load path is the baseline")
    parser.add_argument("--doc-tokens", default="64,2048")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (2 on a shared 2-core machine "
                        "stalled OpenMP's waits for seconds)")
    parser.add_argument("--out", default="runs/connector-host")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from results_files import save

    from helpers.host_reads import HostReads
    from pced.backends.vllm.store_files import StoreFiles
    from pced.backends.vllm.store_kv import StoreSpec

    lengths = [int(x) for x in args.doc_tokens.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        old_module = baseline_package(args.baseline, scratch)
        for storage in ("float16", "int8"):
            root = scratch / storage
            digests = write_store(root, storage, lengths)
            for tokens in lengths:
                spec = StoreSpec(str(root), digests[tokens], PREFIX, PREFIX + tokens, "")
                row = {"storage": storage, "doc_tokens": tokens}
                runs = {}
                for label, module_name, new in (("baseline", old_module, False),
                                                ("cpu path", "pced.backends.vllm.connector", True)):
                    module, connector = build(module_name, silent_layers())
                    load_once(module, connector, spec, new)  # files mapped and verified: the steady state
                    with HostReads() as reads:
                        load_once(module, connector, spec, new)
                    row[f"{label} reads"] = reads.count
                    runs[label] = lambda module=module, connector=connector, new=new: load_once(module, connector,
                                                                                                 spec, new)
                files = StoreFiles()
                row["staged bytes per token"] = staging_once(files, spec) / tokens
                runs["gpu host part"] = lambda: staging_once(files, spec)
                times = {label: [] for label in runs}
                for _ in range(args.repeats):  # in turn, so that a busy moment of the machine hits all alike
                    for label, run in runs.items():
                        start = time.perf_counter()
                        run()
                        times[label].append((time.perf_counter() - start) / tokens * 1e6)
                for label, values in times.items():
                    row[label] = statistics.median(values)
                    row[f"{label} min"] = min(values)
                rows.append(row)
                print(json.dumps(row), flush=True)
    columns = ["storage", "doc_tokens", "baseline", "cpu path", "gpu host part", "baseline min", "cpu path min",
               "gpu host part min", "staged bytes per token", "baseline reads", "cpu path reads"]
    table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        table.append("| " + " | ".join(f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c])
                                         for c in columns) + " |")
    text = "\n".join([
        f"# pced's connector: host work per loaded token (µs), baseline {args.baseline} against this tree",
        "",
        f"Llama-3.1-8B KV shape ({LAYERS} layers, {HEADS} KV heads, head_dim {HEAD_DIM}), model dtype bfloat16, "
        f"a document loaded alone after a {PREFIX}-token prefix, files verified, medians (and minima) of "
        f"{args.repeats} runs taken in turn, "
        f"torch threads {torch.get_num_threads()}. Writer: none (the device's work on a GPU).", "",
        *table, "",
        "`gpu host part`: the bytes the loader stages on a GPU's host (each layer's stored tensors copied from "
        "the mapped file into the staging buffer, here pageable); `reads`: host reads of device data on one load.",
        ""])
    model = crossover(rows)
    text += "\n" + "\n".join(model_text(model))
    save(args.out, "connector_host", {"baseline": args.baseline, "torch_threads": torch.get_num_threads(),
                                      "shape": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": HEAD_DIM},
                                      "repeats": args.repeats, "rows": rows, "model": model}, text)


if __name__ == "__main__":
    main()
