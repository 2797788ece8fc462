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

from typing import Callable, Sequence

import torch

from ..decoding.loop import Rows
from ..errors import UserError
from ..kv.attention import ROW_LAYOUT, use_pced_attention
from ..kv.buffer import BufferCache, decode_one_token, forward_slots
from ..kv.segment import DocKV
from ..llm import LoadedModel
from .clock import synchronized_time


class CachedRows(Rows):
    """A buffer cache, its valid-slot mask and each row's next position; ``advance`` feeds one token."""

    def __init__(self, llm: LoadedModel):
        self.llm = llm
        self.timings: dict[str, float] = {}
        self.stats: dict = {}
        self.cache: BufferCache | None = None
        self.valid: torch.Tensor | None = None
        self.position: torch.Tensor | None = None
        self.padded: bool | None = None  # whether any row has masked slots (None: read it from valid)
        # per row (end, resume): its valid slots are [0, end) and [resume, cursor), as the host knows
        # them (attention by each row's own length, pced.kv.attention.row_spans); None: not tracked
        self.row_layout: list[tuple[int, int]] | None = None

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, **model_kwargs) -> torch.Tensor:
        return forward_slots(self.llm.model, self.cache, self.valid, ids, positions, padded=self.padded,
                             **model_kwargs)

    def advance(self, token: int) -> torch.Tensor:
        if self.llm.decode_step != "eager" and type(self).forward is CachedRows.forward:
            return self.static_advance(token)
        ids = torch.full((len(self.position), 1), token, device=self.position.device)
        self.valid[:, self.cache.length] = True
        if self.row_layout is not None:
            logits = self.forward(ids, self.position[:, None], **{ROW_LAYOUT: self.row_layout})
        else:
            logits = self.forward(ids, self.position[:, None])
        self.position = self.position + 1
        return logits


    def static_advance(self, token: int) -> torch.Tensor:
        """One token through ``decode_one_token``: static token/position/slot buffers on the device,
        written in place; the host keeps only the cache's cursor in step for ``join``."""
        state = getattr(self, "_static", None)
        if state is None or state[0] is not self.cache:  # first step, or the rows changed (a join)
            use_pced_attention(self.llm.model)
            self.cache.write_at(torch.tensor([self.cache.length], device=self.position.device))
            token_buffer = torch.zeros(len(self.position), 1, dtype=torch.long, device=self.position.device)
            state = self._static = (self.cache, token_buffer, self.position[:, None].clone(), self.cache.layers[0].slot)
            if self.llm.decode_step == "compiled" and self.position.device.type == "cuda":
                mark_static(self.cache, self.valid, *state[1:])
        _, token_buffer, position, slot = state
        token_buffer.fill_(token)
        logits = step_function(self.llm)(self.llm.model, self.cache, self.valid, token_buffer, position, slot)
        position += 1
        slot += 1
        self.cache.set_length(self.cache.length + 1)
        self.position = position[:, 0]
        return logits


def mark_static(cache: BufferCache, *tensors: torch.Tensor) -> None:
    """CUDA graphs replay only graphs whose mutated inputs have fixed addresses
    (torch/_inductor/cudagraph_utils.py:404-415, "skipping cudagraphs due to mutated inputs"): the
    step writes the caches, the validity mask and its own buffers in place, so they are marked."""
    for layer in cache.layers:
        tensors += (layer.keys, layer.values)
    for tensor in tensors:
        torch._dynamo.mark_static_address(tensor)


def step_function(llm: LoadedModel):
    """``decode_one_token``, or its compiled form (built once per model; on CUDA ``reduce-overhead``,
    i.e. CUDA graphs; static shapes, so no recompilation from one step to the next)."""
    if llm.decode_step != "compiled":
        return decode_one_token
    if llm.compiled_step is None:
        mode = "reduce-overhead" if llm.device.type == "cuda" else None
        llm.compiled_step = torch.compile(decode_one_token, mode=mode, dynamic=False)
    return llm.compiled_step


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
        started = synchronized_time(self.llm.device)
        device = self.llm.device
        caches = [load() for load in self.loaders]
        prefix_len = self.prefix.n_tokens
        lengths = [0] + [kv.n_tokens for kv in caches]
        longest, batch = max(lengths), len(lengths)
        suffix_len = max(len(self.suffix_ids), len(self.amateur_suffix_ids))
        check_window(self.llm, "pced", "longest expert's prompt", prefix_len + longest + suffix_len, self.max_new_tokens)
        capacity = prefix_len + longest + suffix_len + self.max_new_tokens
        # Slots are written in place; only the masked padding needs zeros (never NaN-prone garbage),
        # so the last question's buffer serves again without faulting in fresh pages.
        cache = BufferCache.allocate(self.llm.model, batch, capacity, zero=False, reuse=True)
        keys, values = self.prefix.on(device)
        cache.key_buffer[:, :, :, :prefix_len] = keys[:, None]
        cache.value_buffer[:, :, :, :prefix_len] = values[:, None]
        valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        valid[:, :prefix_len] = True
        for row, length in enumerate(lengths):
            end = prefix_len + length
            if row:
                keys, values = caches[row - 1].on(device)
                cache.key_buffer[:, row, :, prefix_len:end] = keys
                cache.value_buffer[:, row, :, prefix_len:end] = values
            cache.key_buffer[:, row, :, end : prefix_len + longest] = 0
            cache.value_buffer[:, row, :, end : prefix_len + longest] = 0
            valid[row, prefix_len:end] = True
        cache.set_length(prefix_len + longest)
        self.timings["cache_load_s"] = synchronized_time(self.llm.device) - started
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
        self.layout = (prefix_len, longest, suffix_len)
        self.row_layout = [(prefix_len + length, prefix_len + longest + suffix_len - len(suffix))
                           for suffix, length in zip(suffixes, lengths)]
        # the amateur row holds no document: with any expert some slots are masked; without one, none are
        self.padded = longest > 0 or len(self.amateur_suffix_ids) < suffix_len
        suffix_started = synchronized_time(self.llm.device)
        logits = self.forward(ids, positions)
        # The floor of PCED's time to first token: one suffix forward for all k+1 rows.
        self.timings["suffix_forward_s"] = synchronized_time(self.llm.device) - suffix_started
        self.position = positions[:, -1] + 1
        return logits


    def join(self, kv: DocKV, generated: Sequence[int]) -> None:
        """Add an expert row mid-answer for the document of ``kv``: its row holds prefix + document,
        the question suffix and the tokens generated so far, computed for it alone, so it sees
        exactly what a fresh run of that expert on the same text would. The next ``advance``
        includes it. ``generated`` lists the answer's tokens; those already fed are used."""
        prefix_len, longest, suffix_len = self.layout
        fed = self.cache.length - (prefix_len + longest + suffix_len)
        if len(generated) < fed:
            raise ValueError(f"join: {fed} tokens were generated, {len(generated)} given")
        if kv.n_tokens > longest:  # widen the document region for every row (masked for the others)
            self._widen(prefix_len + longest, kv.n_tokens - longest)
            longest = kv.n_tokens
            self.layout = (prefix_len, longest, suffix_len)
        device, model = self.llm.device, self.llm.model
        tail = self.suffix_ids + list(generated[:fed])
        single = BufferCache.allocate(model, 1, prefix_len + kv.n_tokens + len(tail))
        for (keys, values), (start, end) in ((self.prefix.on(device), (0, prefix_len)),
                                             (kv.on(device), (prefix_len, prefix_len + kv.n_tokens))):
            single.key_buffer[:, 0, :, start:end] = keys
            single.value_buffer[:, 0, :, start:end] = values
        single.set_length(prefix_len + kv.n_tokens)
        start = prefix_len + kv.n_tokens
        positions = torch.arange(start, start + len(tail), device=device)[None]
        forward_slots(model, single, torch.ones(1, start + len(tail), dtype=torch.bool, device=device),
                      torch.tensor([tail], device=device), positions)
        # place it in the batch's columns: document at [P, P+L), suffix right-aligned, then the answer
        capacity, length = self.cache.key_buffer.shape[3], self.cache.length
        keys = torch.zeros_like(self.cache.key_buffer[:, :1])
        values = torch.zeros_like(self.cache.value_buffer[:, :1])
        valid = torch.zeros(1, capacity, dtype=torch.bool, device=device)
        keys[:, :, :, :start] = single.key_buffer[:, :, :, :start]
        values[:, :, :, :start] = single.value_buffer[:, :, :, :start]
        valid[:, :start] = True
        column = prefix_len + longest + suffix_len - len(self.suffix_ids)
        keys[:, :, :, column:length] = single.key_buffer[:, :, :, start:]
        values[:, :, :, column:length] = single.value_buffer[:, :, :, start:]
        valid[:, column:length] = True
        self.cache = BufferCache(torch.cat([self.cache.key_buffer, keys], dim=1),
                                 torch.cat([self.cache.value_buffer, values], dim=1), length)
        self.valid = torch.cat([self.valid, valid])
        self.row_layout = self.row_layout + [(start, column)]
        self.padded = True  # the joined row's suffix is right-aligned after masked slots
        self.position = torch.cat([self.position, self.position.new_tensor([start + len(tail)])])
        self.stats["experts"] = self.stats.get("experts", 0) + 1
        self.stats["joined"] = self.stats.get("joined", 0) + 1
        self.stats["context_tokens"] = self.stats.get("context_tokens", 0) + kv.n_tokens

    def _widen(self, at: int, extra: int) -> None:
        """Insert ``extra`` masked slots at column ``at`` of every row (positions are unchanged)."""
        keys, values, valid = self.cache.key_buffer, self.cache.value_buffer, self.valid
        gap = list(keys.shape)
        gap[3] = extra
        zeros = keys.new_zeros(gap)
        self.cache = BufferCache(torch.cat([keys[:, :, :, :at], zeros, keys[:, :, :, at:]], dim=3),
                                 torch.cat([values[:, :, :, :at], zeros, values[:, :, :, at:]], dim=3),
                                 self.cache.length + extra)
        self.valid = torch.cat([valid[:, :at], valid.new_zeros(len(valid), extra), valid[:, at:]], dim=1)
        self.row_layout = [(end, resume + extra) for end, resume in self.row_layout]  # every end <= at


class PlainRows(CachedRows):
    """One prompt in one row: every token prefilled, then decoded (All, Single, MapReduce's calls)."""

    def __init__(self, llm: LoadedModel, prompt_ids: Sequence[int], max_new_tokens: int, method: str = "all"):
        super().__init__(llm)
        self.prompt_ids, self.max_new_tokens, self.method = list(prompt_ids), max_new_tokens, method
        check_window(llm, method, "prompt", len(self.prompt_ids), max_new_tokens)

    def prefill(self) -> torch.Tensor:
        started = synchronized_time(self.llm.device)
        device = self.llm.device
        length = len(self.prompt_ids)
        self.cache = BufferCache.allocate(self.llm.model, 1, length + self.max_new_tokens)
        self.valid = torch.zeros(1, length + self.max_new_tokens, dtype=torch.bool, device=device)
        self.valid[:, :length] = True
        self.padded = False  # one prompt, every slot real: SDPA's causal path
        self.timings["cache_load_s"] = synchronized_time(self.llm.device) - started
        self.stats.update(context_tokens=length)
        ids = torch.tensor([self.prompt_ids], device=device)
        logits = self.forward(ids, torch.arange(length, device=device)[None])
        self.position = torch.tensor([length], device=device)
        return logits


def check_window(llm: LoadedModel, method: str, what: str, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse a prompt that cannot fit the model's window with the requested new tokens."""
    max_context = llm.max_context
    if max_context and prompt_tokens + max_new_tokens > max_context:
        raise UserError(
            f"{method}: the {what} has {prompt_tokens} tokens; with {max_new_tokens} new tokens it exceeds "
            f"the model's {max_context}-token window"
        )
