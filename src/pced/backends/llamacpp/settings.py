"""``LlamaSettings``: how pced runs a GGUF model on llama.cpp (the llama.cpp backend's settings)."""

from __future__ import annotations

from dataclasses import dataclass

from ..threads import check_thread_count

LLAMA_CACHE_TYPES = ("f16", "q8_0")  # llama.cpp KV cache types: a sequence state is stored in it


@dataclass(frozen=True)
class LlamaSettings:
    """How pced runs a GGUF model on llama.cpp (``--backend llamacpp``)."""

    cache_type: str = "f16"  # the KV cache's type (keys and values); q8_0 halves a stored state
    threads: int | None = None  # None: torch's intra-op threads, i.e. --threads
    batch_tokens: int = 512  # tokens per llama_decode call (n_batch) in one unified KV cache
    # tokens of one sequence per compute step (n_ubatch; with a KV stream per row, a step holds this many
    # of every row): below 64, llama.cpp's CPU kernels give a row the same numbers whatever else is in
    # the step (at 64 queries of a stream its flash attention tiles, ggml-cpu/ops.cpp:9547-9551: a row's
    # logits moved by up to 0.5; K-quant products are kept untiled, see backends/llamacpp/model.py), so
    # every PCED row is exactly its expert decoded alone
    ubatch_tokens: int = 32
    # layers offloaded to a GPU: None, all of them when llama-cpp-python was built with a GPU backend
    # (Metal, CUDA, Vulkan: llama_supports_gpu_offload) and none otherwise; 0 keeps the model on the CPU
    gpu_layers: int | None = None

    def __post_init__(self) -> None:
        if self.gpu_layers is not None and self.gpu_layers < 0:
            raise ValueError(f"gpu layers must be 0 or more, got {self.gpu_layers}")
        if self.cache_type not in LLAMA_CACHE_TYPES:
            raise ValueError(f"unknown llama.cpp cache type {self.cache_type!r}; choose one of {', '.join(LLAMA_CACHE_TYPES)}")
        if self.threads is not None:
            check_thread_count(self.threads, "threads")
        if not 1 <= self.ubatch_tokens <= self.batch_tokens:
            raise ValueError(f"need 1 <= ubatch_tokens <= batch_tokens, got {self.ubatch_tokens} and {self.batch_tokens}")
