"""``VLLMSettings``: how pced starts a vLLM engine (the vLLM backend's settings, its flags' defaults)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import ClassVar

from ...errors import UserError
from .store_kv import tiered_config


@dataclass(frozen=True)
class VLLMSettings:
    """How pced starts a vLLM engine (``--backend vllm``): options passed through to ``vllm.LLM``.
    A field left None takes its platform's value from ``PLATFORM`` (``for_platform``)."""

    dtype: str | None = None  # CPU: float32 (token for token like the transformers backend); CUDA: the model's own
    gpu_memory_utilization: float | None = None  # share of GPU memory for weights + KV cache (CPU build: RAM for the KV)
    max_num_seqs: int = 256  # requests (rows: a question is N+1 of them) scheduled at once
    max_model_len: int | None = None  # CPU: the model's window; CUDA: at most PLATFORM's cap (it bounds the prefill budget)
    tensor_parallel_size: int = 1  # ranks of one engine, in vLLM's worker processes (docs/vllm.md)
    block_size: int | None = 32  # small blocks: a document's KV is cached up to its last 31 tokens (CPU: a multiple of 32)
    max_num_batched_tokens: int | None = None  # None: vLLM's default on a CPU, max_model_len on CUDA
    # None: per model runner (engine.engine_plan): off on V1, whose logits processors cannot tell a
    # half-prefilled row from a next-token one; vLLM's own choice on V2, which can.
    enable_chunked_prefill: bool | None = None
    enforce_eager: bool | None = None  # CPU: True (seconds to start, no graph capture); CUDA: False (CUDA graphs)
    # a JSON file: vLLM's KVTransferConfig (LMCache, native offloading). Alone it replaces pced's connector; with
    # store_kv=True the store is chained after it, the last tier (store_kv.tiered_config, docs/vllm.md "Deployment")
    kv_transfer_config: str | None = None
    # documents' KV read from the store's caches (pced's KV connector); False: vLLM prefills them; None: on where
    # the connector can serve the model (fit.with_store_kv: not latent attention or recurrent layers)
    store_kv: bool | None = None
    # the whole engine's KV cache, GiB, split evenly over its ranks (vLLM's kv_cache_memory_bytes is a rank's);
    # None: from the memory share
    kv_cache_gb: float | None = None
    warm_up: bool = False  # pced serve: prefill every stored document into the prefix cache at start
    # pced serve, pced bench: answer one question over a made-up document before serving, so that the first
    # client's question does not pay the engine's one-time costs (vLLM compiles its logprobs kernel on first use)
    warm_start: bool = True
    # vLLM's own statistics (its scheduler's and iterations'): the vllm:* metrics pced serve's /metrics hands on,
    # at a few microseconds of host work per engine step (vLLM's LLM class keeps them off by default)
    engine_stats: bool = True

    # The platform values of the fields left None. CUDA: bf16/fp16 weights (an 8B model is 16 GB, not
    # 32), 0.85 of each GPU (weights + KV; vLLM's own default is 0.9), CUDA graphs, and a 16k-token cap
    # on the window, which bounds the prefill budget (whole prefills need max_num_batched_tokens >=
    # max_model_len: vllm/config/scheduler.py:315-327). CPU: 0.3 of the machine's memory for the whole
    # engine; vLLM's CPU worker takes the share for each rank (v1/worker/cpu_worker.py:72-76, :234-236),
    # so each rank gets 0.3 / tensor_parallel_size (for_platform).
    PLATFORM: ClassVar[dict[str, dict]] = {
        "cpu": {"dtype": "float32", "gpu_memory_utilization": 0.3, "enforce_eager": True, "max_model_len": None},
        "cuda": {"dtype": "auto", "gpu_memory_utilization": 0.85, "enforce_eager": False, "max_model_len": 16384},
    }

    def __post_init__(self) -> None:
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise UserError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1 or self.tensor_parallel_size < 1:
            raise UserError("max_num_seqs and tensor_parallel_size must be at least 1")
        for name in ("max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.kv_cache_gb is not None and not (math.isfinite(self.kv_cache_gb) and self.kv_cache_gb > 0):
            raise UserError(f"kv_cache_gb must be a number of GiB > 0, got {self.kv_cache_gb}")
        if self.kv_transfer_config is not None:
            self.kv_transfer()  # a missing or malformed file is refused before any engine starts

    def for_platform(self, cuda: bool) -> "VLLMSettings":
        """These settings with every field left None set to its platform's value."""
        table = self.PLATFORM["cuda" if cuda else "cpu"]
        values = {k: v for k, v in table.items() if getattr(self, k) is None}
        if not cuda and "gpu_memory_utilization" in values:  # ranks share one machine's memory
            values["gpu_memory_utilization"] /= self.tensor_parallel_size
        return replace(self, **values)

    def kv_transfer(self) -> dict:
        path = Path(self.kv_transfer_config)
        try:
            value = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise UserError(f"kv_transfer_config {path}: not a readable JSON file ({exc})") from None
        if not isinstance(value, dict) or "kv_connector" not in value:
            raise UserError(f"kv_transfer_config {path}: expected a JSON object with 'kv_connector' "
                             "(vLLM's KVTransferConfig, e.g. LMCacheConnectorV1)")
        return value

    def engine_args(self) -> dict:
        """``vllm.LLM``'s arguments (pced's connector alone is added by the engine: ``store_kv``)."""
        own = ("store_kv", "kv_cache_gb", "warm_up", "warm_start", "engine_stats")
        args = {k: v for k, v in asdict(self).items() if v is not None and k not in own}
        args["disable_log_stats"] = not self.engine_stats
        if self.kv_transfer_config is not None:
            args["kv_transfer_config"] = tiered_config(self.kv_transfer()) if self.store_kv else self.kv_transfer()
        if self.kv_cache_gb is not None:
            args["kv_cache_memory_bytes"] = self.rank_kv_cache_bytes()
        return args

    def rank_kv_cache_bytes(self) -> int | None:
        """A rank's share of ``kv_cache_gb`` in bytes: what vLLM sizes each rank's KV cache by
        (``kv_cache_memory_bytes``: v1/worker/cpu_worker.py:216-229, v1/worker/gpu_worker.py:649-669)."""
        return None if self.kv_cache_gb is None else int(self.kv_cache_gb * 2**30 / self.tensor_parallel_size)
