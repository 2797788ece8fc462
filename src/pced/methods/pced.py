"""PCED: the amateur and one expert per document in one batch of rows, scored by the contrastive rule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..answers import Answer
from ..sampling import SamplingConfig
from ..backends.rows import ExpertRows
from ..decoding import ContrastiveScoring, Generation
from ..documents import Candidate
from ..options import resolve_rule
from ..kv.segment import DocKV
from ..kv.store import KVStore
from ..llm import LoadedModel
from ..rule import RuleConfig
from .follow import Follow


@dataclass
class Expert:
    """A contextual expert: its document id, relevance r in (0, 1) and a loader for its cache."""

    doc_id: str
    relevance: float
    load: Callable[[], DocKV]


class PCEDGeneration(Generation):
    """Row 0 the amateur (prefix + question), row k the expert for document k; ``rule`` None is the
    model family's rule."""

    def __init__(
        self,
        llm: LoadedModel,
        prefix: DocKV,
        experts: Sequence[Expert],
        suffix_ids: Sequence[int],
        amateur_suffix_ids: Sequence[int] | None = None,
        rule: RuleConfig | None = None,
        sampling: SamplingConfig = SamplingConfig(),
        follow: Follow | None = None,
    ):
        experts = list(experts)
        rows = ExpertRows(llm, prefix, [e.load for e in experts], suffix_ids, amateur_suffix_ids, sampling.max_new_tokens)
        scoring = ContrastiveScoring(rule if rule is not None else resolve_rule(llm),
                                     [e.doc_id for e in experts], [e.relevance for e in experts])
        super().__init__(rows, scoring, llm, sampling, method="pced", amateur_only=not experts)
        self.experts = experts
        self.follow = follow
        self.base_relevance = [e.relevance for e in experts]  # from the question alone
        self.joined: list[Candidate] = []  # candidates that joined mid-answer, in order

    def between_tokens(self) -> None:
        if self.follow is None or not self.follow.active:
            return
        rule = self.scoring.rule
        relevance, joining = self.follow.look(self.tracker.text, self.scoring.doc_ids, self.base_relevance,
                                              rule.relevance.tolist())
        if relevance is not None:
            rule.set_relevance(torch.tensor(relevance))
        if joining is not None:
            self.rows.join(self.follow.load(joining), self.tracker.ids)
            self.scoring.doc_ids.append(joining.document.id)
            rule.add_expert(joining.relevance)
            self.base_relevance.append(joining.relevance)
            self.joined.append(joining)
            self.amateur_only = False
        self.stats["looks"] = self.follow.looks

    def step_relevance(self) -> list[float] | None:
        return None if self.follow is None else self.scoring.rule.relevance.tolist()


def pced_from_store(
    llm: LoadedModel,
    store: KVStore,
    candidates: Sequence[Candidate],
    question: str,
    rule: RuleConfig | None = None,
    sampling: SamplingConfig = SamplingConfig(),
    follow: Follow | None = None,
) -> PCEDGeneration:
    """A PCEDGeneration over candidates (ranked order), encoding any document not yet in ``store``."""
    digests = store.add([c.document.render() for c in candidates], progress=False)
    experts = [Expert(c.document.id, c.relevance, lambda d=digest: store.load(d)) for c, digest in zip(candidates, digests)]
    return PCEDGeneration(llm, store.prefix(), experts, store.builder.suffix_ids(question, with_context=True),
                          store.builder.suffix_ids(question, with_context=False), rule, sampling, follow)


def generate(*args, **kwargs) -> Answer:
    """PCED decoding to completion: ``PCEDGeneration(...)`` with the same arguments, then ``answer()``."""
    return PCEDGeneration(*args, **kwargs).answer()
