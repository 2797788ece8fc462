"""Corpus-in-context baselines: the documents (ranked order) inside one prompt, decoded by the one loop.

``all`` puts every candidate in the context block, ``single`` only the top-1. Both feed exactly
``PromptBuilder.prompt_ids`` (the plain path): one row, plain next-token scores, no attribution.
"""

from __future__ import annotations

from typing import Sequence

from ..decoding.sampling import SamplingConfig
from ..backends.rows import PlainRows
from ..decoding.loop import Generation, PlainScoring
from ..llm import LoadedModel


class PlainGeneration(Generation):
    """Greedy (or sampled) decoding of one prompt; no experts, no attribution (doc_id is null)."""

    def __init__(self, llm: LoadedModel, prompt_ids: Sequence[int], sampling: SamplingConfig = SamplingConfig(),
                 method: str = "all"):
        super().__init__(PlainRows(llm, prompt_ids, sampling.max_new_tokens, method), PlainScoring(), llm, sampling,
                         method=method)
        self.prompt_ids = list(prompt_ids)
