"""This machine's limits, measured once and cached: what the bench's floors divide by.

- **Memory bandwidth**: bytes read plus bytes written per second by a large device copy
  (``dst.copy_(src)``, 256 MiB on a CPU, 1 GiB on CUDA, where it is the HBM bandwidth). On a CPU
  also a one-thread copy (numpy's), and the faster counts: torch's threads wait for each other at
  the copy's end, which on a busy machine costs more than a second thread gains.
- **Page-cache read rate**: a file just written (so its pages are still cached) read back two ways,
  ``readinto`` a buffer and a copy out of a fresh ``mmap`` (page faults included: a cache loader
  maps each file anew); the floors use the faster, since a loader may read either way.
- **GEMM rates**: ``torch.nn.functional.linear`` (what a transformers linear layer runs) at the
  shapes a run asks for, ``rows x inner x outer`` in the run's dtype, 2 · rows · inner · outer
  FLOPs each. On CUDA also one large square bfloat16 matmul: the tensor-core peak.

Every rate is the best of a few repeats, not their median: a limit is what the machine can do, and
on a shared machine the neighbours only ever slow a repeat down.

The measurements are cached as JSON under ``cache_root()/machine/``, one file per key: the CPU's
model name, its instruction-set flags, torch's thread count and version, and on CUDA the GPU's
name. A run that needs GEMM shapes the file lacks times those and adds them; ``remeasure`` starts
the file again. Measuring everything takes seconds.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import platform
import re
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

from ..fs import atomic_write_json
from ..llm import cache_root

MACHINE_FORMAT = 3  # a new way of measuring: every cached file is measured again
# the instruction-set flags that pick kernels (x86 vector units, AMX, ARM's SIMD): in the key and the report
ISA_FLAG = re.compile(r"^(avx\w*|fma\w*|f16c|amx\w*|sse4\w*|asimd\w*|sve\w*|neon|bf16|i8mm)$")
TENSOR_CORE_SIZE = 8192  # n x n x n bfloat16: large enough to reach an H100's tensor-core peak


def _cpu() -> tuple[str, list[str]]:
    """The CPU's model name and its instruction-set flags (from /proc/cpuinfo where there is one)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return name, []
    for line in text.splitlines():
        label, _, value = line.partition(":")
        label = label.strip().lower()
        if label in ("model name", "cpu model") and value.strip():
            name = value.strip()
        elif label in ("flags", "features"):
            flags.update(f for f in value.split() if ISA_FLAG.match(f))
    return name, sorted(flags)


def gpu_name(device: torch.device) -> str | None:
    """The GPU's name on CUDA; None elsewhere (a CUDA device asked for on a machine without one included)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device)


def machine_key(device: str | torch.device = "cpu", threads: int | None = None) -> dict:
    cpu, flags = _cpu()
    key = {"cpu": cpu, "flags": flags, "threads": threads or torch.get_num_threads(), "torch": torch.__version__}
    gpu = gpu_name(torch.device(device))
    if gpu is not None:
        key["gpu"] = gpu
    return key


def cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "machine" / f"{digest}.json"


def gemm_name(dtype: torch.dtype, rows: int, inner: int, outer: int) -> str:
    return f"{str(dtype).removeprefix('torch.')} {rows}x{inner}x{outer}"


@dataclass
class MachineLimits:
    key: dict
    device: str  # "cpu" or "cuda": which measurements were taken (copy on the device; tensor-core peak on CUDA)
    memory_bandwidth: float  # bytes/s: the faster of a read-only pass and a copy's bytes read + written
    page_cache_read: float  # bytes/s, readinto
    page_cache_mmap: float  # bytes/s, copied out of a fresh mmap
    gemm: dict[str, float] = field(default_factory=dict)  # gemm_name(...) -> FLOP/s
    tensor_core: float | None = None  # FLOP/s of the large bfloat16 matmul (CUDA)
    measured_at: str = ""
    path: str = ""

    @property
    def page_cache(self) -> float:
        return max(self.page_cache_read, self.page_cache_mmap)

    def gemm_peak(self, names: Iterable[str]) -> tuple[float, str]:
        """The best rate among ``names`` (and the tensor-core peak, where measured) and which it is."""
        rates = {name: self.gemm[name] for name in names}
        if self.tensor_core:
            rates[f"bfloat16 {TENSOR_CORE_SIZE}^3 (tensor cores)"] = self.tensor_core
        if not rates:
            raise ValueError("no GEMM rate measured")
        best = max(rates, key=rates.get)
        return rates[best], best

    def to_json(self) -> dict:
        return {"format": MACHINE_FORMAT, **asdict(self)}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _best_seconds(run, device: torch.device, repeats: int, budget_s: float) -> float:
    """The fastest of up to ``repeats`` timed calls of ``run`` (after one untimed), stopping once
    ``budget_s`` is spent (one timed call at least)."""
    run()
    _synchronize(device)
    best, spent = float("inf"), 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        _synchronize(device)
        elapsed = time.perf_counter() - started
        best, spent = min(best, elapsed), spent + elapsed
        if spent > budget_s:
            break
    return best


def memory_bandwidth(device: torch.device, megabytes: int | None = None, repeats: int = 5) -> float:
    device = torch.device(device)
    megabytes = megabytes or (1024 if device.type == "cuda" else 256)
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = _best_seconds(lambda: dst.copy_(src), device, repeats, budget_s=float("inf"))
    if device.type == "cpu":
        a, b = src.numpy(), dst.numpy()
        seconds = min(seconds, _best_seconds(lambda: np.copyto(b, a), device, repeats, budget_s=float("inf")))
    copied = 2 * src.numel() * src.element_size() / seconds
    # A decode step only reads its weights and caches: a read-only pass (a sum, whose result is one
    # number) streams faster than a copy, whose writes also cost a read of each line they fill.
    seconds = _best_seconds(src.sum, device, repeats, budget_s=float("inf"))
    if device.type == "cpu":
        seconds = min(seconds, _best_seconds(a.sum, device, repeats, budget_s=float("inf")))
    return max(copied, src.numel() * src.element_size() / seconds)


def page_cache_rates(folder: Path, megabytes: int = 256, repeats: int = 3) -> tuple[float, float]:
    """(readinto, mmap) bytes/s of a file still in the page cache after it was written."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"page-cache-probe-{os.getpid()}.bin"
    size = megabytes * 2**20
    buffer = np.empty(size, dtype=np.uint8)
    try:
        buffer.fill(7)  # the page cache stores any bytes alike
        with open(path, "wb") as handle:
            handle.write(memoryview(buffer))

        def read() -> None:
            with open(path, "rb", buffering=0) as handle:
                view, done = memoryview(buffer), 0
                while done < size:
                    done += handle.readinto(view[done:])

        def mapped() -> None:
            with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as pages:
                source = np.frombuffer(pages, dtype=np.uint8)
                np.copyto(buffer, source)
                del source  # the map cannot close while an array views it

        cpu = torch.device("cpu")
        rates = tuple(size / _best_seconds(f, cpu, repeats, budget_s=float("inf")) for f in (read, mapped))
    finally:
        path.unlink(missing_ok=True)
    return rates


@torch.inference_mode()
def gemm_rate(rows: int, inner: int, outer: int, dtype: torch.dtype, device: torch.device, repeats: int = 3,
              budget_s: float = 1.0) -> float:
    """FLOP/s of ``linear(x [rows, inner], w [outer, inner])``: 2 · rows · inner · outer over the best time.
    On a CPU also with the weight packed once for oneDNN (``torch.ops.mkldnn._linear_pointwise``,
    what pced's CPU fast path and vLLM's CPU GEMM run), and the faster counts: at a decode step's few
    rows it is several times torch's plain product here (108 against 28 GFLOP/s at 3 x 576 x 1536)."""
    device = torch.device(device)
    weight = torch.randn(outer, inner, dtype=dtype, device=device)
    x = torch.randn(rows, inner, dtype=dtype, device=device)
    seconds = _best_seconds(lambda: torch.nn.functional.linear(x, weight), device, repeats, budget_s)
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            seconds = min(seconds, _best_seconds(
                lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), device, repeats, budget_s))
        except RuntimeError:  # a dtype oneDNN does not pack on this CPU: the plain product alone
            pass
    return 2 * rows * inner * outer / seconds


@torch.inference_mode()
def tensor_core_peak(device: torch.device, size: int = TENSOR_CORE_SIZE, repeats: int = 10) -> float:
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    return 2 * size**3 / _best_seconds(lambda: a @ b, torch.device(device), repeats, budget_s=float("inf"))


def _load(path: Path, key: dict) -> MachineLimits | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.pop("format", None) != MACHINE_FORMAT or data.get("key") != key:
        return None
    try:
        return MachineLimits(**data)
    except TypeError:
        return None


def machine_limits(device: str | torch.device = "cpu", gemms: Sequence[tuple[int, int, int]] = (),
                   dtype: torch.dtype = torch.float32, remeasure: bool = False, copy_megabytes: int | None = None,
                   file_megabytes: int = 256, progress: bool = True) -> MachineLimits:
    """This machine's limits, from the cache where it holds them, measured (and cached) otherwise;
    ``gemms``: (rows, inner, outer) shapes whose rate in ``dtype`` the caller needs."""
    from tqdm.auto import tqdm

    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("machine limits on cuda: torch sees no CUDA device")
    key = machine_key(device)
    path = cache_path(key)
    limits = None if remeasure else _load(path, key)
    todo = sorted({(int(r), int(i), int(o)) for r, i, o in gemms})
    names = {shape: gemm_name(dtype, *shape) for shape in todo}
    todo = [shape for shape in todo if limits is None or names[shape] not in limits.gemm]
    if limits is not None and not todo:
        return limits
    steps = len(todo) + (0 if limits is not None else 2 + (device.type == "cuda"))
    with tqdm(total=steps, desc="measuring this machine's limits (once)", unit="step", disable=not progress) as bar:
        if limits is None:
            bandwidth = memory_bandwidth(device, copy_megabytes)
            bar.update(1)
            read, mapped = page_cache_rates(path.parent, file_megabytes)
            bar.update(1)
            limits = MachineLimits(key=key, device=device.type, memory_bandwidth=bandwidth, page_cache_read=read,
                                   page_cache_mmap=mapped, measured_at=datetime.now(timezone.utc).isoformat(),
                                   path=str(path))
            if device.type == "cuda":
                limits.tensor_core = tensor_core_peak(device)
                bar.update(1)
        for shape in todo:
            limits.gemm[names[shape]] = gemm_rate(*shape, dtype=dtype, device=device)
            bar.update(1)
    atomic_write_json(path, limits.to_json())
    return limits


def machine_name(key: dict) -> str:
    """"AMD EPYC (avx2 avx512_bf16 ...), 2 threads, torch 2.13.0": the CPU (and GPU) and the flags that pick kernels."""
    where = f"{key['gpu']} on " if key.get("gpu") else ""
    flags = " ".join(f for f in key["flags"] if f.startswith(("avx512", "amx", "avx2", "fma", "sve", "asimd"))) or "none"
    return f"{where}{key['cpu']} ({flags}), {key['threads']} threads, torch {key['torch']}"


def describe(limits: MachineLimits, gemm_names: Iterable[str] = ()) -> str:
    """One line naming the machine and its limits, for the reports."""
    names = list(gemm_names)
    peak = ""
    if names or limits.tensor_core:
        rate, name = limits.gemm_peak(names)
        peak = f"; GEMM peak {rate / 1e9:.1f} GFLOP/s ({name})"
        if names:
            low = min(limits.gemm[n] for n in names)
            peak += f", {low / 1e9:.1f}-{rate / 1e9:.1f} over this run's {len(names)} shapes"
    return (f"{machine_name(limits.key)}: memory "
            f"{limits.memory_bandwidth / 1e9:.1f} GB/s (read or copy, the faster), page cache {limits.page_cache_read / 1e9:.1f} GB/s "
            f"read() / {limits.page_cache_mmap / 1e9:.1f} GB/s mmap{peak}; measured {limits.measured_at[:19]}Z")
