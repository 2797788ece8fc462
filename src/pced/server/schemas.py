"""Request bodies of the server, their limits, and the step from a request to a Job.

Pydantic checks shapes and types (strict: "5" is not a number); ``to_job`` checks what depends
on the configured ``Limits`` and builds the ``AskOptions`` the pipeline takes. Field defaults
come from ``AskOptions`` and ``SamplingConfig``; a rule setting left out is the served model
family's (resolved by the pipeline, as for ``pced ask``). Every failure is a ``RequestError``
(400 with an OpenAI-style error body), never a 500.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from ..errors import UserError
from ..decoding.sampling import MIN_TOP_P, TEMPERATURE, SamplingConfig
from ..documents import Candidate, Document
from ..options import (METHODS, RETRIEVERS, AskOptions, QuestionError,
                       check_question, check_text)
from ..decoding.rule_config import AGGREGATIONS, BETA_MODES, PRIORS, SCORE_SPACES
from .limits import Limits

SAMPLING = SamplingConfig()
MAX_TEMPERATURE = 2.0  # OpenAI's range


def form_defaults(limits: Limits) -> dict:
    """What the page's form starts from and may ask: the same defaults ``pced ask`` uses."""
    return {"method": AskOptions.method, "methods": list(METHODS), "top_k": AskOptions.top_k, "max_top_k": limits.max_top_k,
            "max_tokens": limits.default_max_tokens, "max_tokens_limit": limits.max_tokens}


class RequestError(UserError):
    """A request the server refuses: reported as {"error": {message, type, param, code}}."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value", status: int = 400,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type_


Method = Literal[METHODS]  # type: ignore[valid-type]
Aggregation = Literal[AGGREGATIONS]  # type: ignore[valid-type]
ScoreSpace = Literal[SCORE_SPACES]  # type: ignore[valid-type]
Prior = Literal[PRIORS]  # type: ignore[valid-type]
Retriever = Literal[RETRIEVERS]  # type: ignore[valid-type]
BetaMode = Literal[BETA_MODES]  # type: ignore[valid-type]


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class DocumentIn(Strict):
    """A document given with the request instead of retrieval; score = relevance in [0, 1]."""

    id: str | None = Field(None, min_length=1, max_length=200)
    text: str = Field(min_length=1)
    title: str = Field("", max_length=1000)
    score: float = Field(1.0, ge=0.0, le=1.0)


class PcedOptions(Strict):
    """The PCED knobs; names and defaults follow ``AskOptions`` (None: the served model family's rule)."""

    method: Method = AskOptions.method
    top_k: int = AskOptions.top_k
    top_n: int = AskOptions.top_n
    retriever: Retriever = AskOptions.retriever
    rerank: bool = AskOptions.rerank
    beta: Union[float, BetaMode, None] = AskOptions.beta
    gamma: float | None = AskOptions.gamma
    aggregation: Aggregation | None = AskOptions.aggregation
    score_space: ScoreSpace | None = AskOptions.score_space
    prior: Prior | None = AskOptions.prior
    no_repeat_ngram: int = SAMPLING.no_repeat_ngram  # OpenAI requests have no such field: it lives here
    max_experts: int | None = AskOptions.max_experts
    prune_margin: float | None = AskOptions.prune_margin
    rescore: bool = AskOptions.rescore
    max_joins: int = AskOptions.max_joins


class SamplingOptions(Strict):
    """OpenAI's sampling fields, mapped to SamplingConfig (greedy when temperature is 0 or absent)."""

    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: Union[str, list[ContentPart], None] = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ChatRequest(SamplingOptions):
    """OpenAI chat completions; extra fields OpenAI clients send (user, logprobs, ...) are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")
    messages: list[Message] = Field(min_length=1)
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    documents: list[DocumentIn] | None = None
    pced: PcedOptions = Field(default_factory=PcedOptions)


class AnswerRequest(PcedOptions, SamplingOptions):
    """``POST /v1/pced/answer``: the ``pced ask --json`` contract over HTTP; options are flat."""

    question: str
    documents: list[DocumentIn] | None = None


@dataclass
class Job:
    """Everything the worker needs for one generation, already validated."""

    question: str
    candidates: list[Candidate] | None  # None: retrieve from the store
    options: AskOptions


def question_of(messages: list[Message]) -> str:
    """The last user message's text (string content, or the text parts of a content list)."""
    for message in reversed(messages):
        if message.role != "user":
            continue
        if isinstance(message.content, str):
            return message.content
        if message.content is None:
            return ""
        return "\n".join(part.text or "" for part in message.content if part.type == "text")
    raise RequestError("messages must contain a user message (the question)", "messages", "missing_user_message")


def _candidates(documents: list[DocumentIn], limits: Limits) -> list[Candidate]:
    if len(documents) > limits.max_documents:
        raise RequestError(f"at most {limits.max_documents} documents per request, got {len(documents)}", "documents")
    candidates, seen = [], set()
    for number, doc in enumerate(documents, start=1):
        if len(doc.text) > limits.max_document_chars:
            raise RequestError(f"documents[{number - 1}].text is longer than {limits.max_document_chars} characters",
                               f"documents[{number - 1}].text")
        if not doc.text.strip():
            raise RequestError(f"documents[{number - 1}].text is empty", f"documents[{number - 1}].text")
        for field in ("id", "title", "text"):
            try:
                check_text(getattr(doc, field) or "", f"documents[{number - 1}].{field}")
            except QuestionError as exc:
                raise RequestError(str(exc), f"documents[{number - 1}].{field}", exc.code) from None
        doc_id = doc.id or f"doc{number}"
        if doc_id in seen:
            raise RequestError(f"duplicate document id {doc_id!r}", f"documents[{number - 1}].id")
        seen.add(doc_id)
        candidates.append(Candidate(Document(doc_id, doc.text, doc.title), float(doc.score), {"given": float(doc.score)}))
    return candidates


def _sampling(options: SamplingOptions, limits: Limits) -> SamplingConfig:
    """The one place the API's names meet the library's: OpenAI's ``max_tokens`` (or its newer
    ``max_completion_tokens``) is ``SamplingConfig.max_new_tokens`` (``pced ask --max-new-tokens``);
    left out, it is ``Limits.default_max_tokens``, which is ``SamplingConfig``'s default."""
    max_tokens = options.max_tokens if options.max_tokens is not None else options.max_completion_tokens
    max_tokens = limits.default_max_tokens if max_tokens is None else max_tokens
    if not 1 <= max_tokens <= limits.max_tokens:
        raise RequestError(f"max_tokens must be between 1 and {limits.max_tokens}, got {max_tokens}", "max_tokens")
    temperature = 0.0 if options.temperature is None else options.temperature
    if not (math.isfinite(temperature) and (temperature == 0 or TEMPERATURE[0] <= temperature <= MAX_TEMPERATURE)):
        raise RequestError(f"temperature must be 0 (greedy) or between {TEMPERATURE[0]:g} and {MAX_TEMPERATURE:g}, "
                           f"got {temperature}", "temperature")
    top_p = 1.0 if options.top_p is None else options.top_p
    if not (math.isfinite(top_p) and MIN_TOP_P <= top_p <= 1.0):
        raise RequestError(f"top_p must be between {MIN_TOP_P:g} and 1, got {top_p}", "top_p")
    stop = [options.stop] if isinstance(options.stop, str) else list(options.stop or [])
    if len(stop) > limits.max_stop or any(not s or len(s) > limits.max_stop_chars for s in stop):
        raise RequestError(f"stop: at most {limits.max_stop} non-empty strings of up to {limits.max_stop_chars} characters", "stop")
    if options.seed is not None and not 0 <= options.seed < 2**63:
        raise RequestError("seed must be a non-negative 64-bit integer", "seed")
    try:
        return SamplingConfig(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=options.seed,
                              stop=tuple(stop))
    except UserError as exc:
        raise RequestError(str(exc), None) from None


def to_job(question: str, documents: list[DocumentIn] | None, pced: PcedOptions, sampling: SamplingOptions,
           limits: Limits) -> Job:
    try:
        check_question(question, limits.max_question_chars)
    except QuestionError as exc:
        raise RequestError(str(exc), "question", exc.code) from None
    if not 1 <= pced.top_k <= limits.max_top_k:
        raise RequestError(f"top_k must be between 1 and {limits.max_top_k}, got {pced.top_k}", "top_k")
    if not 1 <= pced.top_n <= limits.max_top_n:
        raise RequestError(f"top_n must be between 1 and {limits.max_top_n}, got {pced.top_n}", "top_n")
    if pced.max_experts is not None and not 1 <= pced.max_experts <= limits.max_top_k:
        raise RequestError(f"max_experts must be between 1 and {limits.max_top_k}, got {pced.max_experts}", "max_experts")
    if pced.prune_margin is not None and not (math.isfinite(pced.prune_margin) and pced.prune_margin >= 0):
        raise RequestError(f"prune_margin must be a finite number >= 0, got {pced.prune_margin}", "prune_margin")
    if not 0 <= pced.no_repeat_ngram <= limits.max_tokens:
        raise RequestError(f"no_repeat_ngram must be between 0 (off) and {limits.max_tokens}, got {pced.no_repeat_ngram}",
                           "no_repeat_ngram")
    if documents is not None and not documents:
        raise RequestError("documents is empty: leave it out to retrieve from the store", "documents")
    try:
        options = AskOptions(method=pced.method, top_k=pced.top_k, top_n=pced.top_n, retriever=pced.retriever,
                             rerank=pced.rerank, beta=pced.beta, gamma=pced.gamma, aggregation=pced.aggregation,
                             score_space=pced.score_space, prior=pced.prior, max_experts=pced.max_experts,
                             prune_margin=pced.prune_margin, rescore=pced.rescore, max_joins=pced.max_joins)
    except UserError as exc:
        raise RequestError(str(exc), "pced") from None
    candidates = _candidates(documents, limits) if documents is not None else None
    decoding = replace(_sampling(sampling, limits), no_repeat_ngram=pced.no_repeat_ngram)
    return Job(question=question, candidates=candidates, options=replace(options, sampling=decoding))


def chat_job(request: ChatRequest, limits: Limits) -> Job:
    if request.n != 1:
        raise RequestError("only n=1 is supported", "n", "unsupported_value")
    return to_job(question_of(request.messages), request.documents, request.pced, request, limits)


def answer_job(request: AnswerRequest, limits: Limits) -> Job:
    return to_job(request.question, request.documents, request, request, limits)
