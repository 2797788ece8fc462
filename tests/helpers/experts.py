"""Shared pieces of the decoding tests: a prompt builder, the prefix cache and one cache per document."""

from __future__ import annotations

import torch


def encode_setup(llm, docs):
    """(llm, builder, prefix cache, [document cache]) for ``docs`` under the RAG template."""
    from pced.kv.encode import encode_documents, encode_prefix
    from pced.text.prompts import PromptBuilder

    builder = PromptBuilder(llm.tokenizer)
    prefix = encode_prefix(llm, builder.prefix_ids)
    return llm, builder, prefix, encode_documents(llm, prefix, [builder.context_ids([d]) for d in docs])


def old_prior(relevance: torch.Tensor, gamma: float) -> torch.Tensor:
    """The prior exactly as written before the option existed."""
    return gamma * torch.log(relevance.double().clamp(1e-8, 1.0 - 1e-8)).float()


def repeats(ids: list[int], n: int) -> int:
    """Index of the first token that completes an n-gram seen before, or -1."""
    seen = set()
    for end in range(n, len(ids) + 1):
        gram = tuple(ids[end - n:end])
        if gram in seen:
            return end - 1
        seen.add(gram)
    return -1
