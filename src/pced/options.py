"""``AskOptions``: everything one question can be asked with. Its field defaults are THE defaults:
``pced ask`` / ``generate`` / ``demo``, the server's request schema, ``pced eval`` and
``pced bench`` derive theirs from this class, and nothing else restates a number.

A rule setting left None is resolved for the model that answers (``pced.defaults.resolve_rule``):
the paper's rule with the model family's measured overrides, or the paper's alone with
``paper_defaults``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .sampling import SamplingConfig
from .defaults import resolve_rule
from .rule import Beta, RuleConfig

METHODS = ("pced", "all", "single", "ape", "mapreduce")
RETRIEVERS = ("hybrid", "sparse", "dense", "colbert", "hybrid-mean", "hybrid-rrf")  # hybrid-*: other fusions of the same indexes
BACKENDS = ("transformers", "vllm", "llamacpp")
STORAGE_DTYPES = ("float16", "float32", "bfloat16", "int8")  # int8: pced.kv.segment
DEFAULT_STORAGE_DTYPE = "float16"  # how KV caches are stored unless an index says otherwise
# Input limits shared by the CLI, the library and the server (each expert is a batch row per step,
# and every question character is prefilled for every row).
MAX_QUESTION_CHARS = 4000
MAX_TOP_K = 64
MAX_TOP_N = 1000


class QuestionError(ValueError):
    """A question that cannot be asked; ``code`` names the reason (for the server's error body)."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


def check_text(text: str, what: str = "the question") -> str:
    """Refuse text that is not valid Unicode (undecodable command-line bytes, lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise QuestionError(f"{what} is not valid UTF-8 text (undecodable byte or lone surrogate at character "
                            f"{exc.start + 1})", "invalid_encoding") from None
    return text


def check_question(question: str, max_chars: int = MAX_QUESTION_CHARS) -> str:
    """The question, or a one-line ``QuestionError`` (empty, too long, not valid text)."""
    if not question.strip():
        raise QuestionError("the question is empty", "empty_question")
    if len(question) > max_chars:
        raise QuestionError(f"the question is longer than {max_chars} characters ({len(question)})", "question_too_long")
    return check_text(question)


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    return method


@dataclass(frozen=True)
class VLLMSettings:
    """How pced starts a vLLM engine (``--backend vllm``): options passed through to ``vllm.LLM``."""

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
    kv_transfer_config: str | None = None  # a JSON file: vLLM's KVTransferConfig (LMCache, native offloading)

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1 or self.tensor_parallel_size < 1:
            raise ValueError("max_num_seqs and tensor_parallel_size must be at least 1")

        if self.kv_transfer_config is not None:
            self.kv_transfer()  # a missing or malformed file is refused before any engine starts

    def kv_transfer(self) -> dict:
        path = Path(self.kv_transfer_config)
        try:
            value = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"kv_transfer_config {path}: not a readable JSON file ({exc})") from None
        if not isinstance(value, dict) or "kv_connector" not in value:
            raise ValueError(f"kv_transfer_config {path}: expected a JSON object with 'kv_connector' "
                             "(vLLM's KVTransferConfig, e.g. LMCacheConnectorV1)")
        return value

    def engine_args(self) -> dict:
        args = {k: v for k, v in asdict(self).items() if v is not None}
        if self.kv_transfer_config is not None:
            args["kv_transfer_config"] = self.kv_transfer()
        return args


LLAMA_CACHE_TYPES = ("f16", "q8_0")  # llama.cpp KV cache types: a sequence state is stored in it


@dataclass(frozen=True)
class LlamaSettings:
    """How pced runs a GGUF model on llama.cpp (``--backend llamacpp``)."""

    cache_type: str = "f16"  # the KV cache's type (keys and values); q8_0 halves a stored state
    threads: int | None = None  # None: torch's intra-op threads, i.e. --threads
    batch_tokens: int = 512  # tokens per llama_decode call (n_batch)
    # tokens per compute step (n_ubatch): below 64, llama.cpp's CPU kernels give a row the same numbers
    # whatever else is in the step (measured: at 64 and above a row's logits moved by up to 0.5), so
    # every PCED row is exactly its expert decoded alone; a step of more rows runs as several
    ubatch_tokens: int = 32

    def __post_init__(self) -> None:
        if self.cache_type not in LLAMA_CACHE_TYPES:
            raise ValueError(f"unknown llama.cpp cache type {self.cache_type!r}; choose one of {', '.join(LLAMA_CACHE_TYPES)}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        if not 1 <= self.ubatch_tokens <= self.batch_tokens:
            raise ValueError(f"need 1 <= ubatch_tokens <= batch_tokens, got {self.ubatch_tokens} and {self.batch_tokens}")


@dataclass(frozen=True)
class AskOptions:
    """How to answer one question: method, retrieval, expert pruning, rule, sampling, backend."""

    method: str = "pced"
    retriever: str = "hybrid"
    top_k: int = 8  # documents used as experts (or put in the prompt)
    top_n: int = 90  # candidates retrieved before reranking (the paper's pool)
    rerank: bool = True  # use the store's reranker, when it has one
    reranker: str | None = None  # another local reranker directory instead of the store's
    max_experts: int | None = None  # PCED: keep at most this many experts (by relevance)
    prune_margin: float | None = None  # PCED: drop experts this many logits behind the best prior
    beta: Beta | None = None  # None: the model family's rule (dynamic, AdaCAD)
    gamma: float | None = None  # None: the model family's rule (2.5 in the paper, 32 for SmolLM2)
    aggregation: str | None = None  # None: the model family's rule (max)
    score_space: str | None = None  # None: the model family's rule (logits)
    prior: str | None = None  # None: the model family's rule (log: gamma*log r; or standardized within the question)
    paper_defaults: bool = False  # unset rule settings from the paper's rule, not the family's
    rescore: bool = False  # PCED: at word boundaries, r_k <- max(r_k, r_k against question + answer so far)
    max_joins: int = 0  # PCED: documents that may join as experts mid-answer (retrieved with question + answer)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    ape_temperature: float = 0.9  # APE's T (APE's README)
    ape_scale: float = 0.9  # APE's S
    summary_tokens: int = 128  # MapReduce: tokens per map summary
    backend: str = "transformers"  # or "vllm" (pced only, greedy): the same rule inside a vLLM engine
    vllm: VLLMSettings = field(default_factory=VLLMSettings)  # the engine's options, with --backend vllm
    llamacpp: LlamaSettings = field(default_factory=LlamaSettings)  # with --backend llamacpp (a GGUF model)

    def __post_init__(self) -> None:
        check_method(self.method)
        if self.retriever not in RETRIEVERS:
            raise ValueError(f"unknown retriever {self.retriever!r}; choose one of {', '.join(RETRIEVERS)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if not 0 <= self.max_joins <= MAX_TOP_K:
            raise ValueError(f"max_joins must be between 0 and {MAX_TOP_K}, got {self.max_joins}")
        if self.backend == "vllm" and (self.rescore or self.max_joins):
            raise ValueError("decode-time relevance (--rescore, --max-joins) runs on the transformers backend only")
        if self.backend == "llamacpp" and self.method != "pced":
            raise ValueError(f"the llamacpp backend runs pced only; use --backend transformers for {self.method}")
        if self.backend == "vllm" and self.method != "pced":
            raise ValueError(f"the vllm backend runs pced only; use --backend transformers for {self.method}")
        if self.backend == "vllm" and self.sampling.temperature > 0:
            raise ValueError("the vllm backend decodes greedily: --temperature is not supported with --backend vllm")
        if self.backend == "vllm" and self.sampling.no_repeat_ngram:
            raise ValueError("the vllm backend decodes inside vLLM's sampler: --no-repeat-ngram is not supported with --backend vllm")
        if not 1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be between 1 and {MAX_TOP_K}, got {self.top_k} (each expert is a batch row)")
        if not 1 <= self.top_n <= MAX_TOP_N:
            raise ValueError(f"top_n must be between 1 and {MAX_TOP_N}, got {self.top_n}")
        if self.max_experts is not None and not 1 <= self.max_experts <= MAX_TOP_K:
            raise ValueError(f"max_experts must be between 1 and {MAX_TOP_K}, got {self.max_experts}")
        if self.prune_margin is not None and not (math.isfinite(self.prune_margin) and self.prune_margin >= 0):
            raise ValueError(f"prune_margin must be a finite number >= 0, got {self.prune_margin}")
        if self.ape_temperature <= 0 or self.ape_scale <= 0:
            raise ValueError(f"APE needs temperature > 0 and scale > 0, got T={self.ape_temperature}, S={self.ape_scale}")
        if self.summary_tokens < 1:
            raise ValueError(f"summary_tokens must be >= 1, got {self.summary_tokens}")
        self.rule(None)  # a bad beta / gamma / aggregation / score space / prior fails here, before any model loads

    def rule(self, model: object = None) -> RuleConfig:
        """The rule for ``model`` (a loaded model or a ``--model`` setting; None = the embedded one)."""
        return resolve_rule(model, self.paper_defaults, beta=self.beta, gamma=self.gamma,
                            aggregation=self.aggregation, score_space=self.score_space, prior=self.prior)
