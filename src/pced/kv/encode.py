"""Encoding caches: the shared prefix, then documents after it, each in one forward over a buffer cache."""

from __future__ import annotations

import torch

from ..llm import LoadedModel
from .buffer import BufferCache, forward_slots
from .segment import DocKV

ENCODING = "to encode documents' KV caches"  # why a model loaded without weights gets them here


def _kv_from_cache(cache: BufferCache, row: int, start: int, end: int) -> DocKV:
    return DocKV(
        keys=cache.key_buffer[:, row, :, start:end].clone(),
        values=cache.value_buffer[:, row, :, start:end].clone(),
    )


@torch.inference_mode()
def encode_prefix(llm: LoadedModel, prefix_ids: list[int]) -> DocKV:
    llm = llm.with_weights(ENCODING)
    cache = BufferCache.allocate(llm.model, 1, len(prefix_ids))
    valid = torch.ones(1, len(prefix_ids), dtype=torch.bool, device=llm.device)
    ids = torch.tensor([prefix_ids], device=llm.device)
    positions = torch.arange(len(prefix_ids), device=llm.device)[None]
    forward_slots(llm.model, cache, valid, ids, positions)
    return _kv_from_cache(cache, 0, 0, len(prefix_ids))


@torch.inference_mode()
def encode_documents(llm: LoadedModel, prefix: DocKV, documents: list[list[int]]) -> list[DocKV]:
    """Encode a batch of documents after the shared prefix in one forward (right-padded)."""
    llm = llm.with_weights(ENCODING)
    prefix_len, longest = prefix.n_tokens, max(len(ids) for ids in documents)
    batch = len(documents)
    cache = BufferCache.allocate(llm.model, batch, prefix_len + longest)
    keys, values = prefix.on(llm.device)
    cache.key_buffer[:, :, :, :prefix_len] = keys[:, None]
    cache.value_buffer[:, :, :, :prefix_len] = values[:, None]
    cache.set_length(prefix_len)
    valid = torch.ones(batch, prefix_len + longest, dtype=torch.bool, device=llm.device)
    pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
    ids = torch.full((batch, longest), pad, dtype=torch.long, device=llm.device)
    for row, doc in enumerate(documents):
        ids[row, : len(doc)] = torch.tensor(doc, device=llm.device)
    positions = torch.arange(prefix_len, prefix_len + longest, device=llm.device)[None].expand(batch, -1)
    # Right padding: a real token never sees a later pad, so the stored part is exact.
    forward_slots(llm.model, cache, valid, ids, positions)
    return [_kv_from_cache(cache, row, prefix_len, prefix_len + len(doc)) for row, doc in enumerate(documents)]


