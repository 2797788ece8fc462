"""PCED on llama.cpp rows: the transformers ``PCEDGeneration`` (its rule, trace, JSON contract and
decode-time relevance) over ``pced.backends.llamacpp`` sequences instead of buffer-cache rows."""

from __future__ import annotations

from typing import Sequence

from ..backends.llamacpp.model import LlamaModel
from ..backends.llamacpp.rows import LlamaExpertRows
from ..backends.llamacpp.states import SeqState
from ..decoding import ContrastiveScoring, Generation
from ..documents import Candidate
from ..options import resolve_rule
from ..rule import RuleConfig
from ..sampling import SamplingConfig
from .pced import Expert, PCEDGeneration


class LlamaPCEDGeneration(PCEDGeneration):
    """PCED on llama.cpp rows; decode-time relevance (rescore, joins) as ``PCEDGeneration`` does it."""

    def __init__(self, llm: LlamaModel, prefix: SeqState, experts: Sequence[Expert], suffix_ids: Sequence[int],
                 amateur_suffix_ids: Sequence[int] | None, rule: RuleConfig | None = None,
                 sampling: SamplingConfig = SamplingConfig(), follow=None, join_room: int = 0):
        experts = list(experts)
        rows = LlamaExpertRows(llm, prefix, [e.load for e in experts], suffix_ids, amateur_suffix_ids,
                               sampling.max_new_tokens)
        if follow is not None and follow.max_joins:
            rows.reserve(join_room)
        scoring = ContrastiveScoring(rule if rule is not None else resolve_rule(llm),
                                     [e.doc_id for e in experts], [e.relevance for e in experts])
        Generation.__init__(self, rows, scoring, llm, sampling, method="pced", amateur_only=not experts)
        self.experts = experts
        self.follow = follow
        self.base_relevance = [e.relevance for e in experts]
        self.joined: list[Candidate] = []
