"""PCED over given documents on llama.cpp: the ``pced.generator.Generator`` of this backend.

``LlamaGenerator`` ties a ``LlamaModel``, a prompt builder and a ``StateStore``; ``stream`` gives
a PCED generation that runs the one decoding loop (``pced.decoding``) with the same rule, trace,
JSON contract and decode-time relevance as the transformers backend, on llama.cpp's rows.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from ...answers import Answer
from ...decoding import ContrastiveScoring, Generation
from ...options import resolve_rule
from ...documents import Candidate
from ...llm import cache_root
from ...methods.pced import Expert, PCEDGeneration
from ...options import LlamaSettings
from ...prompts import TEMPLATES, PromptBuilder, Template
from ...rule import RuleConfig
from ...sampling import SamplingConfig
from .model import LlamaModel
from .rows import LlamaExpertRows
from .states import SeqState, StateStore


def default_states_dir(llm: LlamaModel, template: Template) -> Path:
    return cache_root() / "kv" / f"{llm.name}-{llm.fingerprint[:8]}-{template.name}-llamacpp-{llm.settings.cache_type}"


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


class LlamaGenerator:
    """One GGUF model + one template + one state store; answers questions over given candidates."""

    def __init__(self, llm: LlamaModel | None = None, template: Template | str = "rag",
                 states_dir: str | os.PathLike | None = None, settings: LlamaSettings = LlamaSettings()):
        self.llm = llm if llm is not None else LlamaModel(None, settings)
        self.template = TEMPLATES[template] if isinstance(template, str) else template
        self.builder = PromptBuilder(self.llm.tokenizer, self.template)
        root = states_dir if states_dir is not None else default_states_dir(self.llm, self.template)
        self.caches = StateStore(root, self.llm, self.builder)

    def experts(self, candidates: Sequence[Candidate]) -> list[Expert]:
        digests = self.caches.add([c.document.render() for c in candidates])
        return [Expert(doc_id=c.document.id, relevance=c.relevance, load=lambda d=digest: self.caches.load(d))
                for c, digest in zip(candidates, digests)]

    def stream(self, candidates: Sequence[Candidate], question: str, rule: RuleConfig | None = None,
               sampling: SamplingConfig = SamplingConfig(), follow=None) -> LlamaPCEDGeneration:
        # room for joining documents: the window's worth per join, at most (a join is refused past it)
        join_room = follow.max_joins * (self.llm.max_context or 2048) // 4 if follow is not None else 0
        return LlamaPCEDGeneration(self.llm, self.caches.prefix(), self.experts(candidates),
                                   self.builder.suffix_ids(question, with_context=True),
                                   self.builder.suffix_ids(question, with_context=False), rule, sampling, follow,
                                   join_room)

    def load(self, candidate: Candidate) -> SeqState:
        """One candidate's document state (encoded and stored first if it is new)."""
        return self.caches.load(self.caches.add([candidate.document.render()])[0])

    def answer(self, *args, **kwargs) -> Answer:
        return self.stream(*args, **kwargs).answer()
