"""The defaults, written once: the default model, the rule each model family decodes with, and
``AskOptions`` (everything one question can be asked with).

``pced ask`` / ``generate`` / ``demo``, the server's request schema and the page, ``pced eval`` and
``pced bench`` derive their defaults from the dataclasses, and nothing else restates a number: the
paper's rule is ``RuleConfig()`` (``pced.decoding.rule``), sampling is ``SamplingConfig()``, a store's
settings ``IndexSettings()`` (``pced.store.layout``), an evaluation's ``EvalConfig``.

A rule setting left None is resolved for the model that answers (``resolve_rule``): the paper's
rule with the model family's measured overrides (``MODEL_FAMILY_RULES``), or the paper's alone
with ``paper_defaults``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from .backend import DEFAULT_BACKEND, get_backend
from .errors import UserError
from .decoding.rule_config import Beta, RuleConfig
from .decoding.sampling import MAX_NEW_TOKENS, TEMPERATURE, SamplingConfig, is_int, is_number

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
    backend: str = DEFAULT_BACKEND  # what runs the rows (pced.backend: the registry, each backend's capabilities)
    backend_settings: object = None  # that backend's settings dataclass (None: its defaults)

    def __post_init__(self) -> None:
        check_method(self.method)
        for name in ("top_k", "top_n", "max_joins", "max_experts"):
            value = getattr(self, name)
            if value is not None and not is_int(value):
                raise UserError(f"{name} must be an integer, got {value!r}")
        if self.retriever not in RETRIEVERS:
            raise UserError(f"unknown retriever {self.retriever!r}; choose one of {', '.join(RETRIEVERS)}")
        if not 0 <= self.max_joins <= MAX_TOP_K:
            raise UserError(f"max_joins must be between 0 and {MAX_TOP_K}, got {self.max_joins}")
        backend = get_backend(self.backend)  # an unknown name is refused here
        object.__setattr__(self, "backend_settings", backend.settings(self.backend_settings))
        refusal = backend.refusal(self)
        if refusal is not None:
            raise UserError(refusal)
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
