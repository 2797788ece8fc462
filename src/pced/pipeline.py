"""One question pipeline: ``ask(store, question, options)`` retrieves, prunes and starts the method;
``ask_candidates(generator, candidates, question, options)`` is its lower half, for given documents.

``pced ask``, ``pced demo``, ``pced generate``, the server, ``pced eval`` and ``pced bench`` all go
through here, so they resolve the same rule (``AskOptions.rule``), prune the same way and build
the same generation for the same options.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from .text.answers import Answer, Step, answer_json
from .backend import get_backend
from .decoding.loop import Generation
from .documents import Candidate
from .errors import UserError
from .methods import start
from .options import AskOptions, check_question, check_text


def prune_candidates(
    candidates: Sequence[Candidate], gamma: float, max_experts: int | None = None, margin: float | None = None
) -> list[Candidate]:
    """Drop experts whose prior cannot compete: keep at most ``max_experts`` (by relevance) and only
    those with gamma*log r_k >= gamma*log r_max - margin. Each expert costs a batch row per step;
    under the max rule an expert ``margin`` logits behind on its prior needs its calibrated score to
    beat the leader's by that much to ever win a token."""
    ranked = sorted(candidates, key=lambda c: -c.relevance)
    if max_experts is not None:
        ranked = ranked[: max(0, max_experts)]
    if margin is not None and ranked and gamma > 0:
        best = gamma * math.log(max(ranked[0].relevance, 1e-8))
        ranked = [c for c in ranked if gamma * math.log(max(c.relevance, 1e-8)) >= best - margin]
    keep = {id(c) for c in ranked}
    return [c for c in candidates if id(c) in keep]


@dataclass
class Asked:
    """A question on its way to an answer: iterate for Steps, then ``answer()`` / ``json()``."""

    question: str
    candidates: list[Candidate]  # what the method read (after pruning), ranked order
    retrieval_s: float
    generation: Generation  # or a backend's equivalent (same iteration, answer(), rule_config)

    def __iter__(self) -> Iterator[Step]:
        return iter(self.generation)

    def answer(self) -> Answer:
        return self.generation.answer()

    def json(self) -> dict:
        """The ``pced ask --json`` contract (docs/reference.md); experts that joined mid-answer come last."""
        answer = self.answer()
        return answer_json(answer, self.candidates + list(getattr(self.generation, "joined", [])), self.retrieval_s)


def ask_candidates(generator, candidates: Sequence[Candidate], question: str, options: AskOptions = AskOptions(),
                   retrieval_s: float = 0.0, retrieve: Callable[[str], list[Candidate]] | None = None) -> Asked:
    """Answer over given candidates with ``generator`` (a ``pced.generator.Generator`` of
    ``options.backend``). Decode-time relevance (``options.rescore`` / ``max_joins``) ranks candidates
    again with ``retrieve(query)`` (needed for it; ``ask`` passes the store's retrieval)."""
    check_question(question)
    if generator.backend is not get_backend(options.backend):
        raise UserError(f"these options run on the {options.backend} backend; the generator given runs on "
                        f"{generator.backend.name} (make it with Generator(backend={options.backend!r}))")
    window = generator.llm.max_context
    if window and options.sampling.max_new_tokens >= window:  # before any cache is loaded or buffer allocated
        raise UserError(f"max_new_tokens {options.sampling.max_new_tokens} does not fit the model's {window}-token "
                        "window with a prompt")
    rule = options.rule(generator.llm)
    candidates = list(candidates)
    if options.method == "pced":
        candidates = prune_candidates(candidates, rule.gamma, options.max_experts, options.prune_margin)
    generation = start(generator, candidates, question, options, rule, follow_for(retrieve, generator, question, options))
    return Asked(question, candidates, retrieval_s, generation)


def ask(store, question: str, options: AskOptions = AskOptions(), query: str | None = None) -> Asked:
    """Retrieve from ``store`` (a ``pced.store.DocumentStore``), then start ``options.method``.
    ``query``: what retrieval searches with, when not the question alone (a chat's follow-up adds
    the names the previous answer gave, which the question only refers to)."""
    check_question(question)
    if query is not None:
        check_text(query, "the retrieval query")
    generator = store.generator_for(options.backend, options.backend_settings)
    generator.backend.prepare(generator.llm, generator.settings)  # before retrieval loads its libraries

    def rank(query: str, top_k: int = options.top_n) -> list[Candidate]:  # default: the whole pool (decode-time relevance)
        return store.retrieve(query, options.retriever, top_k=top_k, top_n=options.top_n, rerank=options.rerank,
                              reranker_path=options.reranker)

    started = time.perf_counter()
    candidates = rank(question if query is None else query, options.top_k)
    return ask_candidates(generator, candidates, question, options, time.perf_counter() - started, rank)


def follow_for(retrieve, generator, question: str, options: AskOptions):
    """PCED's decode-time relevance for ``options`` (None when off or not PCED)."""
    if options.method != "pced" or not (options.rescore or options.max_joins):
        return None
    if retrieve is None:
        raise UserError("decode-time relevance (rescore, max_joins) retrieves again: ask a store, not given documents")
    from .methods.follow import Follow

    return Follow(question, retrieve, generator.load, options.top_k, options.rescore, options.max_joins)
