"""Shared pieces of the decoding tests: a prompt builder, the prefix cache and one cache per document."""

from __future__ import annotations


def encode_setup(llm, docs):
    """(llm, builder, prefix cache, [document cache]) for ``docs`` under the RAG template."""
    from pced.kv.encode import encode_documents, encode_prefix
    from pced.prompts import PromptBuilder

    builder = PromptBuilder(llm.tokenizer)
    prefix = encode_prefix(llm, builder.prefix_ids)
    return llm, builder, prefix, encode_documents(llm, prefix, [builder.context_ids([d]) for d in docs])
