"""``BenchConfig``: what ``pced bench`` measures, with its defaults (kept apart from the bench so
that the command line reads them without importing the benchmark)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..options import DEFAULT_STORAGE_DTYPE


@dataclass
class BenchConfig:
    ks: tuple[int, ...] = (4, 8, 16, 32, 64)
    doc_tokens: tuple[int, ...] = (256, 448)
    new_tokens: int = 16  # for per-token decode time
    repeats: int = 3
    storage_dtype: str = DEFAULT_STORAGE_DTYPE
    methods: tuple[str, ...] = ("pced", "all", "ape")
    storage_dtypes: tuple[str, ...] = ("float16", "bfloat16", "float32", "int8")
    long_new_tokens: int = 128  # end-to-end latency of a long answer at the largest k
    memory: bool = True  # peak resident memory of each method, each in a fresh process
    cold: bool = True  # also measure PCED with the cache files evicted from the page cache
    resident: bool = True  # also measure PCED with every cache kept on the model's device (pced.kv.tiers)
    concurrency: tuple[int, ...] = (1, 4, 16)  # a --backend whose engine batches questions: questions at once
    remeasure: bool = False  # measure this machine's limits again instead of reading them from the cache (pced.bench.machine)
    out: str = "runs/bench"
    seed: int = 42
    extra: dict = field(default_factory=dict)
