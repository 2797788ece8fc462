"""PCED: the amateur and one expert per document in one batch of rows, scored by the contrastive rule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..text.answers import Answer
from ..decoding.sampling import SamplingConfig
from ..backends.rows import ExpertRows
from ..decoding.loop import ContrastiveScoring, Generation, Rows, Scoring
from ..documents import Candidate
from ..options import resolve_rule
from ..kv.segment import DocKV
from ..llm import LoadedModel
from ..decoding.rule import RuleConfig
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
        """PCED on the transformers rows over given caches (the form tests and tools build by hand);
        ``over`` builds it on any backend's rows."""
        experts = list(experts)
        rows = ExpertRows(llm, prefix, [e.load for e in experts], suffix_ids, amateur_suffix_ids, sampling.max_new_tokens)
        scoring = ContrastiveScoring(rule if rule is not None else resolve_rule(llm),
                                     [e.doc_id for e in experts], [e.relevance for e in experts])
        self._start(rows, scoring, llm, sampling, [e.relevance for e in experts], follow)

    @classmethod
    def over(cls, rows: Rows, scoring: Scoring, llm, sampling: SamplingConfig, relevance: Sequence[float],
             follow: Follow | None = None) -> "PCEDGeneration":
        """PCED over a backend's rows and scoring (``Backend.expert_rows``, ``Backend.pced_scoring``)."""
        generation = cls.__new__(cls)
        generation._start(rows, scoring, llm, sampling, relevance, follow)
        return generation

    def _start(self, rows: Rows, scoring: Scoring, llm, sampling: SamplingConfig, relevance: Sequence[float],
               follow: Follow | None) -> None:
        Generation.__init__(self, rows, scoring, llm, sampling, method="pced", amateur_only=not relevance)
        self.follow = follow
        self.base_relevance = list(relevance)  # from the question alone
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


def pced_generation(generator, candidates: Sequence[Candidate], question: str, rule: RuleConfig | None = None,
                    sampling: SamplingConfig = SamplingConfig(), follow: Follow | None = None) -> PCEDGeneration:
    """PCED over candidates (ranked order) on ``generator``'s backend (``pced.generator.Generator``:
    a backend, its model, prompt builder and caches), encoding any document not yet cached."""
    candidates = list(candidates)
    backend = generator.backend
    rule = rule if rule is not None else resolve_rule(generator.llm)
    rows = backend.expert_rows(generator, candidates, question, sampling, rule, follow.max_joins if follow else 0)
    return PCEDGeneration.over(rows, backend.pced_scoring(rows, rule, candidates), generator.llm, sampling,
                               [c.relevance for c in candidates], follow)


def generate(*args, **kwargs) -> Answer:
    """PCED decoding to completion: ``PCEDGeneration(...)`` with the same arguments, then ``answer()``."""
    return PCEDGeneration(*args, **kwargs).answer()
