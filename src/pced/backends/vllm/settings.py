"""How pced starts a vLLM engine; the defaults are written here once (the CLI derives its own)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class VLLMSettings:
    """Engine options passed through to ``vllm.LLM``."""

    dtype: str = "float32"  # float32 decodes token for token like the transformers backend on CPU
    gpu_memory_utilization: float = 0.3  # on the CPU build: the share of RAM reserved for the KV cache
    max_num_seqs: int = 256  # requests (rows: a question is N+1 of them) scheduled at once
    max_model_len: int | None = None  # None: the model's window
    tensor_parallel_size: int = 1
    block_size: int | None = 32  # small blocks: a document's KV is cached up to its last 31 tokens (CPU: a multiple of 32)
    max_num_batched_tokens: int | None = None  # None: vLLM's default (at least the model's window)
    # Off: a prompt prefilled in chunks hands the logits processor rows that are not next-token
    # logits yet, indistinguishable from real ones; whole prefills keep every row meaningful.
    enable_chunked_prefill: bool = False
    enforce_eager: bool = True  # no graph capture: seconds to start instead of minutes on a CPU

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1 or self.tensor_parallel_size < 1:
            raise ValueError("max_num_seqs and tensor_parallel_size must be at least 1")

    def engine_args(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}
