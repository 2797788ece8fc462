"""Rows of a transformers model with their caches: the transformers backend of ``decoding.Rows``.

``ExpertRows`` (PCED): row 0 is the amateur (prefix + question), row k the expert for document k
(prefix + document_k + question). Rows live in one preallocated cache::

    slots [0, P)            the shared prefix (stored once, copied into every row)
    slots [P, P + L_max)    row k's document in [P, P + L_k), the rest masked padding
    slots [P + L_max, ...)  the question suffix, then the generated tokens

Each row's position ids continue its own sequential prompt (P + L_k + j), so every expert sees
exactly the keys and positions of ``prefix + document_k + suffix + generated``.

``PlainRows`` (All, Single, MapReduce's calls): one prompt in one row, prefilled from scratch.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from ..cache import BufferCache, forward_slots
from ..kvstore import DocKV
from ..llm import LoadedModel


class CachedRows:
    """A buffer cache, its valid-slot mask and each row's next position; ``advance`` feeds one token."""

    def __init__(self, llm: LoadedModel):
        self.llm = llm
        self.timings: dict[str, float] = {}
        self.stats: dict = {}
        self.cache: BufferCache | None = None
        self.valid: torch.Tensor | None = None
        self.position: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return forward_slots(self.llm.model, self.cache, self.valid, ids, positions)

    def advance(self, token: int) -> torch.Tensor:
        ids = torch.full((len(self.position), 1), token, device=self.position.device)
        self.valid[:, self.cache.length] = True
        logits = self.forward(ids, self.position[:, None])
        self.position = self.position + 1
        return logits


class ExpertRows(CachedRows):
    """The amateur and one row per document cache, prefilled with the question suffix in one forward."""

    def __init__(self, llm: LoadedModel, prefix: DocKV, loaders: Sequence[Callable[[], DocKV]],
                 suffix_ids: Sequence[int], amateur_suffix_ids: Sequence[int] | None, max_new_tokens: int):
        super().__init__(llm)
        if not suffix_ids:
            raise ValueError("the question suffix is empty")
        self.prefix, self.loaders = prefix, list(loaders)
        self.suffix_ids = list(suffix_ids)
        self.amateur_suffix_ids = list(amateur_suffix_ids) if amateur_suffix_ids else self.suffix_ids
        self.max_new_tokens = max_new_tokens

    def prefill(self) -> torch.Tensor:
        """Load the caches into one buffer and run the question suffix for all rows at once.

        The amateur's suffix may be shorter (no context separator): it is left-padded with masked
        slots so that every row's last suffix token sits in the same column.
        """
        started = time.perf_counter()
        device = self.llm.device
        caches = [load() for load in self.loaders]
        prefix_len = self.prefix.n_tokens
        lengths = [0] + [kv.n_tokens for kv in caches]
        longest, batch = max(lengths), len(lengths)
        suffix_len = max(len(self.suffix_ids), len(self.amateur_suffix_ids))
        capacity = prefix_len + longest + suffix_len + self.max_new_tokens
        # Slots are written in place; only the masked padding needs zeros (never NaN-prone garbage).
        cache = BufferCache.allocate(self.llm.model, batch, capacity, zero=False)
        cache.key_buffer[:, :, :, :prefix_len] = self.prefix.keys[:, None]
        cache.value_buffer[:, :, :, :prefix_len] = self.prefix.values[:, None]
        valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        valid[:, :prefix_len] = True
        for row, length in enumerate(lengths):
            end = prefix_len + length
            if row:
                cache.key_buffer[:, row, :, prefix_len:end] = caches[row - 1].keys
                cache.value_buffer[:, row, :, prefix_len:end] = caches[row - 1].values
            cache.key_buffer[:, row, :, end : prefix_len + longest] = 0
            cache.value_buffer[:, row, :, end : prefix_len + longest] = 0
            valid[row, prefix_len:end] = True
        cache.set_length(prefix_len + longest)
        self.timings["cache_load_s"] = time.perf_counter() - started
        self.stats.update(experts=len(caches), context_tokens=sum(lengths), padded_slots=batch * longest - sum(lengths))
        suffixes = [self.amateur_suffix_ids] + [self.suffix_ids] * len(caches)
        ids = torch.zeros(batch, suffix_len, dtype=torch.long, device=device)
        positions = torch.zeros(batch, suffix_len, dtype=torch.long, device=device)
        for row, (suffix, length) in enumerate(zip(suffixes, lengths)):
            pad = suffix_len - len(suffix)
            ids[row, pad:] = torch.tensor(suffix, device=device)
            positions[row] = prefix_len + length + torch.arange(suffix_len, device=device) - pad
            valid[row, prefix_len + longest + pad : prefix_len + longest + suffix_len] = True
        self.cache, self.valid = cache, valid
        suffix_started = time.perf_counter()
        logits = self.forward(ids, positions)
        # The floor of PCED's time to first token: one suffix forward for all k+1 rows.
        self.timings["suffix_forward_s"] = time.perf_counter() - suffix_started
        self.position = positions[:, -1] + 1
        return logits


class PlainRows(CachedRows):
    """One prompt in one row: every token prefilled, then decoded (All, Single, MapReduce's calls)."""

    def __init__(self, llm: LoadedModel, prompt_ids: Sequence[int], max_new_tokens: int, method: str = "all"):
        super().__init__(llm)
        self.prompt_ids, self.max_new_tokens, self.method = list(prompt_ids), max_new_tokens, method
        check_window(llm, method, "prompt", len(self.prompt_ids), max_new_tokens)

    def prefill(self) -> torch.Tensor:
        started = time.perf_counter()
        device = self.llm.device
        length = len(self.prompt_ids)
        self.cache = BufferCache.allocate(self.llm.model, 1, length + self.max_new_tokens)
        self.valid = torch.zeros(1, length + self.max_new_tokens, dtype=torch.bool, device=device)
        self.valid[:, :length] = True
        self.timings["cache_load_s"] = time.perf_counter() - started
        self.stats.update(context_tokens=length)
        ids = torch.tensor([self.prompt_ids], device=device)
        logits = self.forward(ids, torch.arange(length, device=device)[None])
        self.position = torch.tensor([length], device=device)
        return logits


def check_window(llm: LoadedModel, method: str, what: str, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse a prompt that cannot fit the model's window with the requested new tokens."""
    max_context = llm.max_context
    if max_context and prompt_tokens + max_new_tokens > max_context:
        raise ValueError(
            f"{method}: the {what} has {prompt_tokens} tokens; with {max_new_tokens} new tokens it exceeds "
            f"the model's {max_context}-token window"
        )
