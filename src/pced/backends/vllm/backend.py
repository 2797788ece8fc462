"""``VLLMBackend``: PCED inside a vLLM engine, declared for the registry (``pced.backend``).

A question is N+1 requests of the engine, decided together by pced's logits processor
(``engine``, ``groups``, ``processor``); many questions decode together (continuous batching).
The model is the store's Hugging Face folder: the engine loads its weights, pced's process holds
its config, tokenizer and chat template only (``load_model``), and loads the weights too only for
what transformers runs there (a baseline method on the default backend, a document's KV encoded
for the store), saying so. The document caches are the transformers backend's ``kv/`` (this
backend encodes none of its own). Settings vLLM would refuse for the model are refused before an
engine starts (``fit.engine_refusal``). It runs PCED only, greedily, without
decode-time relevance or the loop's n-gram ban (vLLM's sampler decides the token). Nothing heavy is
imported at module level (vLLM loads with the first engine).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ...backend import Capabilities
from ...errors import UserError
from ..transformers.backend import TransformersBackend
from .settings import VLLMSettings

DEFAULTS = VLLMSettings()


class VLLMBackend(TransformersBackend):
    name = "vllm"
    summary = "PCED inside a vLLM engine, many questions at once (pced only, greedy); pip install 'pced[vllm]'"
    capabilities = Capabilities(methods=("pced",), sampling=False, no_repeat_ngram=False, decode_time_relevance=False,
                                concurrent_questions=True, own_caches=False)
    settings_class = VLLMSettings

    def __init__(self) -> None:
        super().__init__()
        self._noted: set = set()  # (model, settings) whose store-KV note was printed

    # -- settings -------------------------------------------------------------------------
    def add_options(self, group, command: str = "ask") -> None:
        if command == "index":  # it encodes no caches of its own
            return
        cpu, cuda = VLLMSettings.PLATFORM["cpu"], VLLMSettings.PLATFORM["cuda"]
        group.add_argument("--gpu-memory-utilization", type=float, default=DEFAULTS.gpu_memory_utilization,
                           help="vllm: memory share for weights and KV cache (CPU build: RAM for the KV; default "
                                f"{cpu['gpu_memory_utilization']} on a CPU, {cuda['gpu_memory_utilization']} on CUDA)")
        group.add_argument("--vllm-dtype", default=DEFAULTS.dtype, choices=["auto", "float32", "float16", "bfloat16"],
                           help=f"vllm: the engine's dtype (default {cpu['dtype']} on a CPU, {cuda['dtype']}: the "
                                "model's own, on CUDA)")
        group.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=DEFAULTS.enforce_eager,
                           help=f"vllm: no CUDA graphs or compilation (default {cpu['enforce_eager']} on a CPU, "
                                f"{cuda['enforce_eager']} on CUDA)")
        group.add_argument("--max-model-len", type=int, default=DEFAULTS.max_model_len,
                           help="vllm: the longest sequence (default: the model's window; on CUDA at most "
                                f"{cuda['max_model_len']})")
        group.add_argument("--max-num-batched-tokens", type=int, default=DEFAULTS.max_num_batched_tokens,
                           help="vllm: tokens one engine step may prefill (default: max-model-len on CUDA, vLLM's "
                                "own on a CPU)")
        group.add_argument("--max-num-seqs", type=int, default=DEFAULTS.max_num_seqs,
                           help=f"vllm: requests scheduled at once (a question is N+1; default {DEFAULTS.max_num_seqs})")
        group.add_argument("--tensor-parallel-size", type=int, default=DEFAULTS.tensor_parallel_size,
                           help="vllm: GPUs (on a CPU build: ranks) one model is split over; its attention heads "
                                "must divide by it")
        group.add_argument("--kv-transfer-config", default=DEFAULTS.kv_transfer_config, metavar="FILE",
                           help="vllm: a JSON file with vLLM's KVTransferConfig (LMCache, native KV offloading); "
                                "alone it replaces pced's own connector; with --store-kv the store is the last tier "
                                "after it (vLLM's MultiConnector)")
        group.add_argument("--store-kv", action=argparse.BooleanOptionalAction, default=DEFAULTS.store_kv,
                           help="vllm: read documents' KV from the store's caches, so only the question is prefilled "
                                "(default: on, except for a model pced's connector cannot serve, e.g. latent "
                                "attention, which is said in one line); off: vLLM prefills prefix and documents itself")
        group.add_argument("--kv-cache-gb", type=float, default=DEFAULTS.kv_cache_gb, metavar="GiB",
                           help="vllm: the whole engine's KV cache, split evenly over its tensor-parallel ranks "
                                "(default: from --gpu-memory-utilization)")
        if command == "serve":
            group.add_argument("--warm-up", action="store_true", default=DEFAULTS.warm_up,
                               help="vllm: prefill every stored document into vLLM's prefix cache at start (not needed "
                                    "with --store-kv: documents are read from the store when first asked for)")
        if command in ("serve", "bench"):
            group.add_argument("--warm-start", action=argparse.BooleanOptionalAction, default=DEFAULTS.warm_start,
                               help="vllm: before serving, answer one question over a made-up document, so that the "
                                    "first client's question does not pay the engine's one-time costs (default: on)")
        if command == "serve":
            group.add_argument("--engine-stats", action=argparse.BooleanOptionalAction, default=DEFAULTS.engine_stats,
                               help="vllm: keep vLLM's own statistics, served as its vllm:* metrics on /metrics "
                                    f"(default: {'on' if DEFAULTS.engine_stats else 'off'})")

    def settings_from_args(self, args: argparse.Namespace) -> VLLMSettings:
        names = ("gpu_memory_utilization", "max_num_seqs", "tensor_parallel_size", "kv_transfer_config",
                 "enforce_eager", "max_model_len", "max_num_batched_tokens", "store_kv", "kv_cache_gb", "warm_up",
                 "warm_start", "engine_stats")
        given = {name: getattr(args, name) for name in names if hasattr(args, name)}
        if hasattr(args, "vllm_dtype"):
            given["dtype"] = args.vllm_dtype
        try:
            return VLLMSettings(**given)
        except ValueError as exc:
            raise UserError(str(exc)) from None

    # -- the model: its config, tokenizer and chat template; the engine loads the weights ------------
    def load_model(self, model: str | None, settings: Any, device: str | None = None, dtype: str = "auto") -> Any:
        from ...llm import load_model

        return load_model(model, device=device, dtype=dtype, weights=False)

    def refusal_for(self, llm: Any, settings: VLLMSettings) -> str | None:
        """Why vLLM would refuse an engine with ``settings`` for ``llm`` (decided from its config), or None."""
        from .fit import engine_refusal

        return engine_refusal(llm.model.config, settings, cuda=llm.device.type == "cuda",
                              tokenizer_max_length=getattr(llm.tokenizer, "model_max_length", None))

    def engine_settings(self, llm: Any, settings: VLLMSettings) -> VLLMSettings:
        """``settings`` as the engine for ``llm`` runs them: the store's KV on where the connector can
        serve the model and it was left unset (one line where it cannot: ``fit.with_store_kv``)."""
        import sys

        from .fit import with_store_kv

        resolved, note = with_store_kv(llm.model.config, settings)
        if note is not None and (llm.path, settings) not in self._noted:
            self._noted.add((llm.path, settings))
            print(f"pced: {note}", file=sys.stderr, flush=True)
        return resolved

    def _engine(self, llm: Any, settings: VLLMSettings) -> Any:
        """The process's engine for ``llm`` and ``settings``. What vLLM would refuse is refused first,
        in one line, before vLLM is imported (vLLM finds it in its engine process, minutes later)."""
        reason = self.refusal_for(llm, settings)
        if reason is not None:
            raise UserError(reason)
        from .engine import shared_engine

        return shared_engine(llm.path, self.engine_settings(llm, settings))

    def _running(self, generator: Any) -> Any:
        """The engine of ``generator`` if it has started (never started here), else None."""
        from .engine import running_engine

        return running_engine(generator.llm.path, self.engine_settings(generator.llm, generator.settings))

    # -- document caches: the transformers backend's (kv/), read, never written as its own --------------
    def cache_dirs(self, root: Path) -> list[Path]:
        return []

    def open_caches(self, model: Any, builder: Any, directory: Path, settings: Any, **policy: Any) -> Any:
        """The store's caches as the engine reads them (their files, through pced's connector): no
        device tier, and no weights loaded here for them."""
        from ...kv.store import KVStore
        from ...kv.tier_settings import CacheTiers

        no_device_tier = CacheTiers(gpu_cache_gb=0, pinned_staging=False)
        return KVStore(directory, model, builder, **{**policy, "tiers": no_device_tier})

    # -- a question -----------------------------------------------------------------------
    def prepare(self, model: Any, settings: VLLMSettings) -> None:
        """Start the engine before the retrieval libraries load (vLLM 0.32 scans them at start)."""
        self._engine(model, settings)

    def expert_rows(self, generator: Any, candidates: list, question: str, sampling: Any, rule: Any,
                    max_joins: int = 0) -> Any:
        from .engine import EngineRows

        return EngineRows(self._engine(generator.llm, generator.settings), generator.builder, candidates,
                          question, rule, sampling, store=generator.caches)  # the engine reads the documents' KV there

    def pced_scoring(self, rows: Any, rule: Any, candidates: list) -> Any:
        from .engine import TapeScoring

        return TapeScoring(rows.betas, candidates, rule)

    # -- serving --------------------------------------------------------------------------
    def warm_up(self, store: Any, settings: VLLMSettings) -> dict:
        """Start the engine; with ``settings.warm_up`` also prefill every stored document into its
        prefix cache (with ``store_kv`` a document is read from the store when first asked for); with
        ``settings.warm_start`` then answer a made-up question (``warm.warm_start``)."""
        generator = store.generator_for(self, settings)
        engine = self._engine(generator.llm, settings)
        report = {"engine_start_s": engine.start_s, "warm_up_tokens": 0, "reads_store": engine.reads_store}
        if settings.warm_up:
            tokens = engine.warm_up(generator.builder, [d.render() for d in store.documents])
            report.update(warm_up_tokens=tokens, warm_up_s=engine.warm_up_s)
            said = (f"{len(store.documents)} documents ({tokens} tokens) prefilled into its prefix cache in "
                    f"{engine.warm_up_s:.1f} s")
        else:
            said = ("documents' KV read from the store's caches" if engine.reads_store
                    else "documents prefilled by vLLM when first asked for")
        report["message"] = f"vLLM engine started in {engine.start_s:.1f} s; {said}" + self._warm_start(engine, generator,
                                                                                                           report)
        return report

    def _warm_start(self, engine: Any, generator: Any, report: dict) -> str:
        """The first question's one-time costs paid now, where the settings say so; what to say of it."""
        if not generator.settings.warm_start:
            return ""
        from .warm import warm_start

        report["warm_start_s"] = warm_start(engine, generator)
        return f"; a first question answered in {report['warm_start_s']:.1f} s before serving (--no-warm-start: not)"

    def bench_prepare(self, generator: Any, documents: list[str]) -> dict:
        """The engine started and, as ``pced serve`` does, its first question answered (no document
        warm-up: with ``store_kv`` the documents come from the store)."""
        engine = self._engine(generator.llm, generator.settings)
        report = {"engine_start_s": engine.start_s, "reads_store": engine.reads_store}
        self._warm_start(engine, generator, report)
        return report

    def bench_forget(self, generator: Any) -> None:
        """Empty the engine's prefix cache (``LLM.reset_prefix_cache``: vllm/entrypoints/llm.py:829-834),
        between questions, while the engine's thread waits for work (no step is running)."""
        import time

        llm = self._engine(generator.llm, generator.settings).loop.llm
        deadline = time.monotonic() + 60
        while not llm.reset_prefix_cache():  # refused while a request still holds blocks (an abort in flight)
            if time.monotonic() > deadline:
                raise RuntimeError("vLLM refused to empty its prefix cache for a minute (requests still running)")
            time.sleep(0.1)

    def bench_threads(self, settings: Any) -> int | None:
        """On the CPU build every core this process may use: one rank takes its NUMA node's CPUs
        (``VLLM_CPU_OMP_THREADS_BIND=auto``), tensor-parallel ranks share them (``cpu.bind_threads``)."""
        import os

        from vllm.platforms import current_platform

        return len(os.sched_getaffinity(0)) if current_platform.is_cpu() else None

    def work_shape(self, generator: Any) -> Any:
        """The torch model's work with its weights, keys and values in the engine's dtype (the
        platform's where unset; "auto": the model's own, as the torch model loads it)."""
        from dataclasses import replace

        import torch

        shape = super().work_shape(generator)
        dtype = generator.settings.for_platform(generator.llm.device.type == "cuda").dtype
        if dtype in (None, "auto") or dtype == shape.gemm_dtype:
            return shape
        scale = getattr(torch, dtype).itemsize / getattr(torch, shape.gemm_dtype).itemsize
        weights, cell = int(shape.weight_bytes * scale), shape.kv_bytes_per_cell * scale
        return replace(shape, weight_bytes=weights, kv_bytes_per_cell=cell, gemm_dtype=dtype,
                       described_as=f"{dtype} weights {weights / 1e9:.3f} GB, {dtype} KV {cell:,.0f} B/token")

    def bench_cache_bytes(self, generator: Any, files: list) -> int:
        """The files, read through pced's connector (``store_kv``); nothing without it (vLLM
        prefills the documents)."""
        return super().bench_cache_bytes(generator, files) if self._engine(generator.llm, generator.settings).reads_store \
            else 0

    def health(self, generator: Any) -> dict:
        engine = self._running(generator)  # never started by a health check
        return {} if engine is None else dict(engine.counters)

    def failure(self, generator: Any) -> str | None:
        engine = self._running(generator)
        death = None if engine is None else engine.loop.death
        return None if death is None else str(death)

    def shutdown(self) -> None:
        from .engine import close_engines

        close_engines()
