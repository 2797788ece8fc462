"""The Python API over given documents: candidates + question -> a streaming PCED Generation or an Answer.

``Generator`` ties a loaded model, a prompt builder and a KV store together (``LlamaGenerator``:
a GGUF on llama.cpp, its prompt builder and its sequence-state store). Documents are encoded
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
from .methods.pced import Expert, PCEDGeneration, pced_from_store
from .prompts import TEMPLATES, PromptBuilder, Template
from .options import LlamaSettings
from .rule import RuleConfig
from .backends.llamacpp.model import LlamaModel
from .backends.llamacpp.states import SeqState, StateStore
from .methods.pced_llamacpp import LlamaPCEDGeneration


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


def default_states_dir(llm: LlamaModel, template: Template) -> Path:
    return cache_root() / "kv" / f"{llm.name}-{llm.fingerprint[:8]}-{template.name}-llamacpp-{llm.settings.cache_type}"


def request_states_dir(cache_dir: str | os.PathLike | None, llm: LlamaModel, template: Template) -> Path:
    """Where documents sent with a question keep their llama.cpp states: ``llamacpp-<cache type>/``
    under a request cache directory (beside its transformers ``kv/``, as in a store), or, without
    one, a folder per GGUF, template and cache type under the cache root. One layout for the server
    and ``pced generate``, so both share one request cache and each cache type has its own."""
    if cache_dir is None:
        return default_states_dir(llm, template)
    from .backends.llamacpp.states import states_dir

    return states_dir(Path(cache_dir), llm.settings.cache_type)


class LlamaGenerator:
    """One GGUF model + one template + one state store; answers questions over given candidates."""

    def __init__(self, llm: LlamaModel | None = None, template: Template | str = "rag",
                 states_dir: str | os.PathLike | None = None, settings: LlamaSettings = LlamaSettings(),
                 budget_bytes: int | None = None, on_demand: bool = False):
        """``budget_bytes``/``on_demand``: see ``pced.backends.llamacpp.states.StateStore``."""
        self.llm = llm if llm is not None else LlamaModel(None, settings)
        self.template = TEMPLATES[template] if isinstance(template, str) else template
        self.builder = PromptBuilder(self.llm.tokenizer, self.template)
        root = states_dir if states_dir is not None else default_states_dir(self.llm, self.template)
        self.caches = StateStore(root, self.llm, self.builder, budget_bytes=budget_bytes, on_demand=on_demand)

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
