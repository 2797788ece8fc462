"""Corpus-in-context baselines: the documents (ranked order) inside one prompt, decoded greedily.

``all`` puts every candidate in the context block, ``single`` only the top-1. Both feed exactly
``PromptBuilder.prompt_ids`` (the plain path) and reuse the one decoding loop of
``pced.decoding.Generation`` with a single row and plain next-token scores.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from ..cache import BufferCache, forward_slots
from ..decoding import Generation, SamplingConfig, TextTracker
from ..llm import LoadedModel
from ..rule import AMATEUR


class SingleRowScoring:
    """For baselines that decode one row: plain next-token scores, no experts, no attribution."""

    def _scores(self, logits: torch.Tensor):
        return logits[0].float(), lambda token: AMATEUR

    def _doc_id(self, winner: int) -> None:
        return None

    def answer(self):
        answer = super().answer()
        answer.betas, answer.amateur_only = [], False
        return answer


class PlainGeneration(SingleRowScoring, Generation):
    """Greedy (or sampled) decoding of one prompt; no experts, no attribution (doc_id is null)."""

    def __init__(self, llm: LoadedModel, prompt_ids: Sequence[int], sampling: SamplingConfig = SamplingConfig(), method: str = "all"):
        max_context = llm.max_context
        if max_context and len(prompt_ids) + sampling.max_new_tokens > max_context:
            raise ValueError(
                f"{method}: the prompt has {len(prompt_ids)} tokens; with {sampling.max_new_tokens} new tokens it exceeds "
                f"the model's {max_context}-token window"
            )
        self.llm, self.sampling, self.method = llm, sampling, method
        self.prompt_ids = list(prompt_ids)
        self.experts = []
        self.tracker = TextTracker.for_model(llm, sampling)
        self.trace, self.timings, self.stats = [], {}, {}
        self.last_logits = None
        self.rule = None

    def _prefill(self):
        started = time.perf_counter()
        device = self.llm.device
        length = len(self.prompt_ids)
        cache = BufferCache.allocate(self.llm.model, 1, length + self.sampling.max_new_tokens)
        valid = torch.zeros(1, length + self.sampling.max_new_tokens, dtype=torch.bool, device=device)
        valid[:, :length] = True
        self.timings["cache_load_s"] = time.perf_counter() - started
        self.stats.update(context_tokens=length)
        ids = torch.tensor([self.prompt_ids], device=device)
        positions = torch.arange(length, device=device)[None]
        logits = forward_slots(self.llm.model, cache, valid, ids, positions)
        return cache, valid, torch.tensor([length], device=device), logits
