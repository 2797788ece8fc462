"""The Python API over given documents: candidates + question -> a streaming PCED Generation or an Answer.

``Generator`` ties a backend (``pced.backend``), its loaded model, a prompt builder and the
backend's cache store together. Documents are encoded into the cache store the first time they
are seen (later calls reuse the stored caches), so ``pced generate`` on the same documents twice
pays the encoding once. A rule left None is the model family's (``pced.options.resolve_rule``),
the same one ``pced ask`` and the server use.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from .text.answers import Answer
from .backend import DEFAULT_BACKEND, Backend, get_backend
from .documents import Candidate
from .kv.tiers import CacheTiers
from .methods.pced import PCEDGeneration, pced_generation
from .options import DEFAULT_STORAGE_DTYPE
from .text.prompts import TEMPLATES, PromptBuilder, Template
from .decoding.rule import RuleConfig
from .decoding.sampling import SamplingConfig


class Generator:
    """One backend + its model + one template + one cache store; answers questions over given candidates.

    ``llm`` None loads the backend's default (the embedded model); ``backend`` None is the model's own
    (``llm.backend``, where a model names one) or the default one. ``kv_dir`` is the cache store's
    directory (None: the backend's request-cache folder for this model under the cache root).
    ``budget_bytes``/``on_demand``/``recorded_model_path``: see ``pced.kv.store.KVStore``.
    """

    def __init__(
        self,
        llm: Any = None,
        template: Template | str = "rag",
        kv_dir: str | os.PathLike | None = None,
        storage_dtype: str = DEFAULT_STORAGE_DTYPE,
        tiers: CacheTiers = CacheTiers(),
        budget_bytes: int | None = None,
        on_demand: bool = False,
        recorded_model_path: str | None = None,
        backend: str | Backend | None = None,
        settings: Any = None,
    ):
        self.backend = get_backend(backend or getattr(llm, "backend", None) or DEFAULT_BACKEND)
        self.settings = self.backend.settings(settings)
        self.llm = llm if llm is not None else self.backend.load_model(None, self.settings)
        self.template = TEMPLATES[template] if isinstance(template, str) else template
        self.builder = PromptBuilder(self.llm.tokenizer, self.template)
        if kv_dir is None:
            kv_dir = self.backend.request_cache_dir(None, self.llm, self.template, self.settings, storage_dtype)
        self.caches = self.backend.open_caches(self.llm, self.builder, kv_dir, self.settings, storage_dtype=storage_dtype,
                                               tiers=tiers, budget_bytes=budget_bytes, on_demand=on_demand,
                                               recorded_model_path=recorded_model_path)

    def guard_writes(self, guard) -> None:
        """Write an encoded document cache only where ``guard(digest)`` (a context manager yielding a
        bool) allows it; a refused one is used from memory (``pced.kv.budget.CacheUse``). Set by the
        store whose directory the caches are in, so that a document it removed is never written back."""
        use = getattr(self.caches, "use", None)  # a plug-in backend's cache store may have no CacheUse
        if use is not None:
            use.write_guard = guard

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
        return pced_generation(self, list(candidates), question, rule, sampling, follow)

    def load(self, candidate: Candidate):
        """One candidate's document cache (encoded and stored first if it is new)."""
        return self.caches.load(self.caches.add([candidate.document.render()], progress=False)[0])

    def answer(self, *args, **kwargs) -> Answer:
        """``stream`` with the same arguments, to completion."""
        return self.stream(*args, **kwargs).answer()
