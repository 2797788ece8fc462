"""The Python API over given documents: candidates + question -> a streaming PCED Generation or an Answer.

``Generator`` ties a loaded model, a prompt builder and a KV store together. Documents are encoded
into the store the first time they are seen (later calls reuse the stored caches), so
``pced generate`` on the same documents twice pays the encoding once. A rule left None is the
model family's (``pced.options.resolve_rule``), the same one ``pced ask`` and the server use.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from .answers import Answer
from .sampling import SamplingConfig
from .documents import Candidate
from .kv.tiers import CacheTiers
from .kv.segment import DocKV
from .kv.store import KVStore
from .options import DEFAULT_STORAGE_DTYPE
from .llm import LoadedModel, cache_root, load_model
from .methods.pced import PCEDGeneration, pced_from_store
from .prompts import TEMPLATES, PromptBuilder, Template
from .rule import RuleConfig


def default_kv_dir(llm: LoadedModel, template: Template, storage_dtype: str) -> Path:
    return cache_root() / "kv" / f"{llm.name}-{llm.fingerprint[:8]}-{template.name}-{storage_dtype}"


class Generator:
    """One model + one template + one KV store; answers questions over given candidates."""

    def __init__(
        self,
        llm: LoadedModel | None = None,
        template: Template | str = "rag",
        kv_dir: str | os.PathLike | None = None,
        storage_dtype: str = DEFAULT_STORAGE_DTYPE,
        tiers: CacheTiers = CacheTiers(),
        budget_bytes: int | None = None,
        on_demand: bool = False,
        recorded_model_path: str | None = None,
    ):
        """``budget_bytes``/``on_demand``/``recorded_model_path``: see ``pced.kv.store.KVStore``."""
        self.llm = llm if llm is not None else load_model()
        self.template = TEMPLATES[template] if isinstance(template, str) else template
        self.builder = PromptBuilder(self.llm.tokenizer, self.template)
        kv_dir = kv_dir if kv_dir is not None else default_kv_dir(self.llm, self.template, storage_dtype)
        self.caches = KVStore(kv_dir, self.llm, self.builder, storage_dtype, tiers=tiers, budget_bytes=budget_bytes,
                              on_demand=on_demand, recorded_model_path=recorded_model_path)

    def stream(
        self,
        candidates: Sequence[Candidate],
        question: str,
        rule: RuleConfig | None = None,
        sampling: SamplingConfig = SamplingConfig(),
        follow=None,
    ) -> PCEDGeneration:
        """A PCED Generation: iterate it for Steps as tokens are chosen, then call ``answer()``;
        ``follow`` (a ``methods.follow.Follow``) turns on decode-time relevance."""
        return pced_from_store(self.llm, self.caches, candidates, question, rule, sampling, follow)

    def load(self, candidate: Candidate) -> DocKV:
        """One candidate's document cache (encoded and stored first if it is new)."""
        return self.caches.load(self.caches.add([candidate.document.render()], progress=False)[0])

    def answer(self, *args, **kwargs) -> Answer:
        """``stream`` with the same arguments, to completion."""
        return self.stream(*args, **kwargs).answer()
