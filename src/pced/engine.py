"""The Python API: documents + relevances + question -> a streaming Generation or an Answer.

``Engine`` ties a loaded model, a prompt builder and a KV store together. Documents are encoded
into the store the first time they are seen (later calls reuse the stored caches), so
``pced generate`` on the same documents twice pays the encoding once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .decoding import Answer, Expert, Generation, SamplingConfig
from .documents import Document
from .kvstore import KVStore
from .llm import LoadedModel, cache_root, load_model
from .prompts import TEMPLATES, PromptBuilder, Template
from .rule import RuleConfig


@dataclass
class Candidate:
    """A document chosen for a question with its relevance r in (0, 1) and the raw scores behind it."""

    document: Document
    relevance: float
    scores: dict


def prune_candidates(
    candidates: Sequence[Candidate], gamma: float, max_experts: int | None = None, margin: float | None = None
) -> list[Candidate]:
    """Drop experts whose prior cannot compete: keep at most ``max_experts`` (by relevance) and only
    those with gamma*log r_k >= gamma*log r_max - margin. Each expert costs a batch row per step;
    under the max rule an expert ``margin`` logits behind on its prior needs its calibrated score to
    beat the leader's by that much to ever win a token."""
    import math

    ranked = sorted(candidates, key=lambda c: -c.relevance)
    if max_experts is not None:
        ranked = ranked[: max(0, max_experts)]
    if margin is not None and ranked and gamma > 0:
        best = gamma * math.log(max(ranked[0].relevance, 1e-8))
        ranked = [c for c in ranked if gamma * math.log(max(c.relevance, 1e-8)) >= best - margin]
    keep = {id(c) for c in ranked}
    return [c for c in candidates if id(c) in keep]


def default_kv_dir(llm: LoadedModel, template: Template, storage_dtype: str) -> Path:
    return cache_root() / "kv" / f"{llm.name}-{llm.fingerprint[:8]}-{template.name}-{storage_dtype}"


class Engine:
    """One model + one template + one KV store; answers questions over given candidates."""

    def __init__(
        self,
        llm: LoadedModel | None = None,
        template: Template | str = "rag",
        kv_dir: str | os.PathLike | None = None,
        storage_dtype: str = "float16",
    ):
        self.llm = llm if llm is not None else load_model()
        self.template = TEMPLATES[template] if isinstance(template, str) else template
        self.builder = PromptBuilder(self.llm.tokenizer, self.template)
        kv_dir = kv_dir if kv_dir is not None else default_kv_dir(self.llm, self.template, storage_dtype)
        self.store = KVStore(kv_dir, self.llm, self.builder, storage_dtype)

    def experts(self, candidates: Sequence[Candidate], progress: bool = False) -> list[Expert]:
        """Experts for the candidates, encoding (and storing) any document not cached yet."""
        digests = self.store.add([c.document.render() for c in candidates], progress=progress)
        return [
            Expert(doc_id=c.document.id, relevance=c.relevance, load=lambda d=digest: self.store.load(d))
            for c, digest in zip(candidates, digests)
        ]

    def stream(
        self,
        candidates: Sequence[Candidate],
        question: str,
        rule: RuleConfig = RuleConfig(),
        sampling: SamplingConfig = SamplingConfig(),
    ) -> Generation:
        """A PCED Generation: iterate it for Steps as tokens are chosen, then call ``answer()``."""
        experts = self.experts(candidates)
        return Generation(
            self.llm,
            self.store.prefix(),
            experts,
            self.builder.suffix_ids(question, with_context=True),
            self.builder.suffix_ids(question, with_context=False),
            rule,
            sampling,
        )

    def answer(
        self,
        candidates: Sequence[Candidate],
        question: str,
        rule: RuleConfig = RuleConfig(),
        sampling: SamplingConfig = SamplingConfig(),
    ) -> Answer:
        return self.stream(candidates, question, rule, sampling).answer()


def answer_json(answer: Answer, candidates: Sequence[Candidate], retrieval_s: float = 0.0) -> dict:
    """The ``pced ask --json`` contract of DESIGN.md."""
    timings = {"retrieval_s": retrieval_s, "cache_load_s": 0.0, "ttft_s": 0.0, "total_s": 0.0}
    timings.update(answer.timings)
    return {
        "answer": answer.text,
        "method": answer.method,
        "experts": [
            {"doc_id": c.document.id, "title": c.document.title, "relevance": c.relevance, "scores": c.scores}
            for c in candidates
        ],
        "trace": [{"token": step.text, "doc_id": step.doc_id} for step in answer.trace],
        "beta": answer.betas,
        "timings": timings,
        "amateur_only": answer.amateur_only,
    }
