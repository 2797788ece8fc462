"""The defaults, written once: the default model, the rule each model family decodes with, and
``AskOptions`` (everything one question can be asked with).

``pced ask`` / ``generate`` / ``demo``, the server's request schema and the page, ``pced eval`` and
``pced bench`` derive their defaults from the dataclasses, and nothing else restates a number: the
paper's rule is ``RuleConfig()`` (``pced.rule``), sampling is ``SamplingConfig()``, a store's
settings ``IndexSettings()`` (``pced.store.layout``), an evaluation's ``EvalConfig``.

A rule setting left None is resolved for the model that answers (``resolve_rule``): the paper's
rule with the model family's measured overrides (``MODEL_FAMILY_RULES``), or the paper's alone
with ``paper_defaults``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import ClassVar

from .errors import UserError
from .rule import Beta, RuleConfig
from .sampling import MAX_NEW_TOKENS, TEMPERATURE, SamplingConfig, is_int, is_number

EMBEDDED = "embedded"  # the --model setting (and store setting) of the embedded default model
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
PAPER_RULE = RuleConfig()  # the paper's rule for 8B-13B models: raw logits, dynamic beta, gamma 2.5, max
RULE_FIELDS = tuple(f.name for f in fields(RuleConfig))

# model_type / name prefix -> overrides measured on our data, where the paper's choice lost (docs/results.md).
# smollm2: with the embedded hybrid retriever one question's candidates differ by ~0.23 in log r, so
# the paper's gamma barely gates distractors; on NQ (100 questions, paired) this gamma scored 47.0
# against 23.0 (+24, 95% interval [+16, +32], 24 wins, 0 losses).
MODEL_FAMILY_RULES: dict[str, dict] = {"smollm2": {"gamma": 32.0}}

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


@dataclass(frozen=True)
class GivenDocuments:
    """Documents sent with a question (the server's ``documents``, ``pced generate --docs``): how
    many and how long, and the bounded cache their KV caches go to. They never enter a store: the
    request cache is its own directory, least recently used caches evicted past ``cache_gb``, and
    shared by identical documents across requests (content-addressed)."""

    max_documents: int = 64  # per question (each is an expert: a batch row per step)
    max_document_chars: int = 20_000  # checked before any tokenizer loads; tokens: the store's per-document limit
    cache_gb: float = 2.0  # the request cache's budget on disk
    cache_dir: str | None = None  # None: under $PCED_CACHE_DIR/kv/, one folder per model, template and dtype

    def __post_init__(self) -> None:
        if self.max_documents < 1 or self.max_document_chars < 1:
            raise ValueError("max_documents and max_document_chars must be at least 1")
        if not (math.isfinite(self.cache_gb) and self.cache_gb > 0):
            raise ValueError(f"the request cache needs a budget > 0 GB, got {self.cache_gb}")

    def check(self, documents: list) -> None:
        """Refuse too many or too long documents (``Candidate`` or ``Document``) before any model loads."""
        if len(documents) > self.max_documents:
            raise QuestionError(f"at most {self.max_documents} documents per question, got {len(documents)}",
                                "too_many_documents")
        for d in documents:
            text = getattr(d, "document", d).text
            if len(text) > self.max_document_chars:
                raise QuestionError(f"document {getattr(d, 'document', d).id!r} has {len(text)} characters; at most "
                                    f"{self.max_document_chars} per document (split it)", "document_too_long")


def is_embedded(model: object) -> bool:
    """Whether a ``--model`` setting names the embedded model (unset, "embedded" or its name)."""
    return model is None or (isinstance(model, str) and model in ("", EMBEDDED, EMBEDDED_NAME))


def model_family(model: object = None) -> str:
    """The family of a loaded model (anything with ``name`` and ``model.config``) or of a ``--model``
    setting without loading it (None / "embedded" is the embedded SmolLM2; a directory's
    ``config.json`` names its ``model_type``). Unknown: ""."""
    if is_embedded(model):
        return "smollm2"
    if isinstance(model, (str, os.PathLike)):
        path = Path(model).expanduser()
        if path.name.lower().startswith("smollm2"):
            return "smollm2"
        try:
            return json.loads((path / "config.json").read_text()).get("model_type", "")
        except (OSError, ValueError):
            return ""
    name = getattr(model, "name", "") or ""
    if name.lower().startswith("smollm2"):
        return "smollm2"
    return getattr(getattr(getattr(model, "model", None), "config", None), "model_type", "") or ""


def resolve_rule(model: object = None, paper: bool = False, **settings) -> RuleConfig:
    """The rule for ``model`` (see ``model_family``): the paper's, the family's measured overrides
    unless ``paper``, then every setting given that is not None (beta, gamma, aggregation, score_space,
    prior). The library, the CLI, the server and ``pced eval`` all resolve the rule here."""
    unknown = set(settings) - set(RULE_FIELDS)
    if unknown:
        raise TypeError(f"unknown rule settings: {', '.join(sorted(unknown))}")
    overrides = {} if paper else dict(MODEL_FAMILY_RULES.get(model_family(model), {}))
    overrides.update({k: v for k, v in settings.items() if v is not None})
    return replace(PAPER_RULE, **overrides)


def family_defaults(setting: str) -> str:
    """Help text for a rule setting, formatted from the table that holds it: "32 for smollm2 (the
    embedded SmolLM2-135M-Instruct); the paper's 2.5 otherwise"."""
    overrides = [f"{rules[setting]:g} for {family}" if isinstance(rules[setting], float) else f"{rules[setting]} for {family}"
                 for family, rules in MODEL_FAMILY_RULES.items() if setting in rules]
    paper = getattr(PAPER_RULE, setting)
    paper = f"{paper:g}" if isinstance(paper, float) else str(paper)
    if not overrides:
        return f"the paper's {paper}"
    embedded = f" (the embedded {EMBEDDED_NAME})" if setting in MODEL_FAMILY_RULES.get(model_family(None), {}) else ""
    return f"{', '.join(overrides)}{embedded}; the paper's {paper} otherwise"


class QuestionError(UserError):
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
        raise UserError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    return method


@dataclass(frozen=True)
class VLLMSettings:
    """How pced starts a vLLM engine (``--backend vllm``): options passed through to ``vllm.LLM``.
    A field left None takes its platform's value from ``PLATFORM`` (``for_platform``)."""

    dtype: str | None = None  # CPU: float32 (token for token like the transformers backend); CUDA: the model's own
    gpu_memory_utilization: float | None = None  # share of GPU memory for weights + KV cache (CPU build: RAM for the KV)
    max_num_seqs: int = 256  # requests (rows: a question is N+1 of them) scheduled at once
    max_model_len: int | None = None  # CPU: the model's window; CUDA: at most PLATFORM's cap (it bounds the prefill budget)
    tensor_parallel_size: int = 1  # more is refused: see __post_init__
    block_size: int | None = 32  # small blocks: a document's KV is cached up to its last 31 tokens (CPU: a multiple of 32)
    max_num_batched_tokens: int | None = None  # None: vLLM's default on a CPU, max_model_len on CUDA
    # Off: a prompt prefilled in chunks hands the logits processor rows that are not next-token
    # logits yet, indistinguishable from real ones; whole prefills keep every row meaningful.
    enable_chunked_prefill: bool = False
    enforce_eager: bool | None = None  # CPU: True (seconds to start, no graph capture); CUDA: False (CUDA graphs)
    kv_transfer_config: str | None = None  # a JSON file: vLLM's KVTransferConfig (LMCache, native offloading)

    # The platform values of the fields left None. CUDA: bf16/fp16 weights (an 8B model is 16 GB, not
    # 32), 0.85 of the GPU (weights + KV; vLLM's own default is 0.9), CUDA graphs, and a 16k-token cap
    # on the window, which bounds the prefill budget (whole prefills need max_num_batched_tokens >=
    # max_model_len: vllm/config/scheduler.py:315-327).
    PLATFORM: ClassVar[dict[str, dict]] = {
        "cpu": {"dtype": "float32", "gpu_memory_utilization": 0.3, "enforce_eager": True, "max_model_len": None},
        "cuda": {"dtype": "auto", "gpu_memory_utilization": 0.85, "enforce_eager": False, "max_model_len": 16384},
    }

    def __post_init__(self) -> None:
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise UserError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1 or self.tensor_parallel_size < 1:
            raise UserError("max_num_seqs and tensor_parallel_size must be at least 1")
        if self.tensor_parallel_size > 1:
            raise UserError("--tensor-parallel-size > 1 is refused: vLLM 0.32 then runs its workers in other processes, "
                             "where PCED's group decisions are made, and its model-runner output has no field that "
                             "brings a logits processor's result (who won each token, the betas) back; the trace "
                             "could not be read. Use one GPU per engine.")
        for name in ("max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.kv_transfer_config is not None:
            self.kv_transfer()  # a missing or malformed file is refused before any engine starts

    def for_platform(self, cuda: bool) -> "VLLMSettings":
        """These settings with every field left None set to its platform's value."""
        table = self.PLATFORM["cuda" if cuda else "cpu"]
        return replace(self, **{k: v for k, v in table.items() if getattr(self, k) is None})

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
    # whatever else is in the step (at 64 queries its flash attention tiles, ggml-cpu/ops.cpp:9547-9551:
    # a row's logits moved by up to 0.5; K-quant products are kept untiled, see backends/llamacpp/model.py),
    # so every PCED row is exactly its expert decoded alone; a step of more rows runs as several
    ubatch_tokens: int = 32
    # layers offloaded to a GPU: None, all of them when llama-cpp-python was built with a GPU backend
    # (Metal, CUDA, Vulkan: llama_supports_gpu_offload) and none otherwise; 0 keeps the model on the CPU
    gpu_layers: int | None = None

    def __post_init__(self) -> None:
        if self.gpu_layers is not None and self.gpu_layers < 0:
            raise ValueError(f"gpu layers must be 0 or more, got {self.gpu_layers}")
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
    beta: Beta | None = None  # None: the model family's rule (see resolve_rule)
    gamma: float | None = None
    aggregation: str | None = None
    score_space: str | None = None
    prior: str | None = None  # log: gamma*log r; standardized: log r standardized within the question
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
        for name in ("top_k", "top_n", "max_joins", "max_experts"):
            value = getattr(self, name)
            if value is not None and not is_int(value):
                raise UserError(f"{name} must be an integer, got {value!r}")
        if self.retriever not in RETRIEVERS:
            raise UserError(f"unknown retriever {self.retriever!r}; choose one of {', '.join(RETRIEVERS)}")
        if self.backend not in BACKENDS:
            raise UserError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if not 0 <= self.max_joins <= MAX_TOP_K:
            raise UserError(f"max_joins must be between 0 and {MAX_TOP_K}, got {self.max_joins}")
        if self.backend == "vllm" and (self.rescore or self.max_joins):
            raise UserError("decode-time relevance (--rescore, --max-joins) runs on the transformers backend only")
        if self.backend == "llamacpp" and self.method != "pced":
            raise UserError(f"the llamacpp backend runs pced only; use --backend transformers for {self.method}")
        if self.backend == "vllm" and self.method != "pced":
            raise UserError(f"the vllm backend runs pced only; use --backend transformers for {self.method}")
        if self.backend == "vllm" and self.sampling.temperature > 0:
            raise UserError("the vllm backend decodes greedily: --temperature is not supported with --backend vllm")
        if self.backend == "vllm" and self.sampling.no_repeat_ngram:
            raise UserError("the vllm backend decodes inside vLLM's sampler: --no-repeat-ngram is not supported with --backend vllm")
        if not 1 <= self.top_k <= MAX_TOP_K:
            raise UserError(f"top_k must be between 1 and {MAX_TOP_K}, got {self.top_k} (each expert is a batch row)")
        if not 1 <= self.top_n <= MAX_TOP_N:
            raise UserError(f"top_n must be between 1 and {MAX_TOP_N}, got {self.top_n}")
        if self.max_experts is not None and not 1 <= self.max_experts <= MAX_TOP_K:
            raise UserError(f"max_experts must be between 1 and {MAX_TOP_K}, got {self.max_experts}")
        if self.prune_margin is not None and not (is_number(self.prune_margin) and self.prune_margin >= 0):
            raise UserError(f"prune_margin must be a finite number >= 0, got {self.prune_margin}")
        if not (is_number(self.ape_temperature) and is_number(self.ape_scale)
                and 0 < self.ape_temperature <= TEMPERATURE[1] and 0 < self.ape_scale <= TEMPERATURE[1]):
            raise UserError(f"APE needs temperature and scale in (0, {TEMPERATURE[1]:g}], "
                            f"got T={self.ape_temperature!r}, S={self.ape_scale!r}")
        if not is_int(self.summary_tokens) or not 1 <= self.summary_tokens <= MAX_NEW_TOKENS:
            raise UserError(f"summary_tokens must be between 1 and {MAX_NEW_TOKENS}, got {self.summary_tokens!r}")
        self.rule(None)  # a bad beta / gamma / aggregation / score space / prior fails here, before any model loads

    def rule(self, model: object = None) -> RuleConfig:
        """The rule for ``model`` (a loaded model or a ``--model`` setting; None = the embedded one)."""
        return resolve_rule(model, self.paper_defaults, beta=self.beta, gamma=self.gamma,
                            aggregation=self.aggregation, score_space=self.score_space, prior=self.prior)
