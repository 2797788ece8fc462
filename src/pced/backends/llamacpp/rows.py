"""Rows of a GGUF model on llama.cpp: the llamacpp backend of ``decoding.Rows``.

Sequence 0 is the amateur (prefix + question), sequence k the expert of document k
(prefix + document_k + question), each in a KV stream of its own (``LlamaModel.split_streams``)::

    prefix cells         restored from the stored prefix into every row's stream
    document k's cells   restored from its stored state into sequence k (positions P..P+L_k-1),
                         joined to the prefix's in the same restore (``restore_expert``)
    suffix, answer       every row's own cells, decoded together: one llama_batch per token

A row's attention then walks its own cells only. In one unified cache (split streams off) the
prefix is restored once and shared, and every row walks every row's cells.

Each row's positions continue its own sequential prompt, so every expert sees exactly
prefix + document_k + suffix + generated, as on the transformers backend.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from ...decoding.loop import Rows
from ...errors import UserError
from .model import LlamaModel
from .states import SeqState, restore_expert, restore_prefix


class LlamaExpertRows(Rows):
    """The amateur and one sequence per document state, prefilled with the question suffix in one batch."""

    def __init__(self, llm: LlamaModel, prefix: SeqState, loaders: Sequence[Callable[[], SeqState]],
                 suffix_ids: Sequence[int], amateur_suffix_ids: Sequence[int] | None, max_new_tokens: int):
        if not suffix_ids:
            raise ValueError("the question suffix is empty")
        self.llm, self.prefix, self.loaders = llm, prefix, list(loaders)
        self.suffix_ids = list(suffix_ids)
        self.amateur_suffix_ids = list(amateur_suffix_ids) if amateur_suffix_ids else self.suffix_ids
        self.max_new_tokens = max_new_tokens
        self.timings: dict[str, float] = {}
        self.stats: dict = {}
        self.ctx = None
        self.position: list[int] = []  # each row's next position
        self.fed = 0  # answer tokens fed to every row so far
        self.extra_cells = 0  # room kept for experts that join mid-answer
        self._locked = False

    def reserve(self, tokens: int) -> None:
        """Keep room in the context for ``tokens`` more cells (documents that may join, with their catch-up)."""
        self.extra_cells = tokens

    def _join_streams(self, seq_cells: int) -> int:
        """Sequences kept free for joins: the reserved cells in rows as long as the longest row (in one
        unified cache, 64 as before). A join that finds none free, or too short, grows the context."""
        if not self.llm.split_streams:
            return 64
        return min(64, -(-self.extra_cells // seq_cells)) if self.extra_cells else 0

    def _grow(self, sequences: int, seq_cells: int) -> None:
        """A larger context mid-answer: every row's cells saved and restored into it. A restored state
        gives exactly the cells it was saved from, in the same order, so no row's numbers move."""
        held = [self.ctx.get_state(seq) for seq in range(len(self.position))]
        total = sum(self.position) + seq_cells + self.extra_cells
        self.ctx = self.llm.context(total, sequences, seq_cells=max(seq_cells, self.ctx.seq_cells))
        for seq, data in enumerate(held):
            self.ctx.set_state(seq, data)

    def prefill(self) -> torch.Tensor:
        started = time.perf_counter()
        states = [load() for load in self.loaders]
        p = self.prefix.n_tokens
        rows = len(states) + 1
        cells = (p + sum(s.n_tokens for s in states) + len(self.amateur_suffix_ids) + len(states) * len(self.suffix_ids)
                 + rows * self.max_new_tokens + self.extra_cells)
        if self.llm.max_context and p + max([0] + [s.n_tokens for s in states]) + len(self.suffix_ids) \
                + self.max_new_tokens > self.llm.max_context:
            raise UserError(f"a document with the question and {self.max_new_tokens} new tokens exceeds the "
                             f"model's {self.llm.max_context}-token window")
        longest = max([p + len(self.amateur_suffix_ids)] + [p + s.n_tokens + len(self.suffix_ids) for s in states]) \
            + self.max_new_tokens
        self.llm.lock.acquire()
        self._locked = True
        self.ctx = ctx = self.llm.context(cells, rows + self._join_streams(longest), seq_cells=longest)
        restore_prefix(ctx, self.prefix)
        for seq, state in enumerate(states, start=1):
            restore_expert(ctx, seq, self.prefix, state)
        self.timings["cache_load_s"] = time.perf_counter() - started
        self.stats.update(experts=len(states), context_tokens=sum(s.n_tokens for s in states),
                          state_bytes=sum(s.nbytes for s in states))
        tokens, positions, seqs, outputs = [], [], [], []
        self.position = []
        for seq, (suffix, start) in enumerate([(self.amateur_suffix_ids, p)]
                                              + [(self.suffix_ids, p + s.n_tokens) for s in states]):
            tokens += suffix
            positions += range(start, start + len(suffix))
            seqs += [seq] * len(suffix)
            outputs += [False] * (len(suffix) - 1) + [True]
            self.position.append(start + len(suffix))
        suffix_started = time.perf_counter()
        logits = ctx.decode(tokens, positions, seqs, outputs)
        self.timings["suffix_forward_s"] = time.perf_counter() - suffix_started
        return logits

    def advance(self, token: int) -> torch.Tensor:
        rows = len(self.position)
        logits = self.ctx.decode([token] * rows, self.position, list(range(rows)), [True] * rows)
        self.position = [pos + 1 for pos in self.position]
        self.fed += 1
        return logits

    def join(self, state: SeqState, generated: Sequence[int]) -> None:
        """A new expert mid-answer: its document state in a new sequence, caught up alone on the
        question suffix and the answer tokens fed so far; the next ``advance`` includes it."""
        if len(generated) < self.fed:
            raise ValueError(f"join: {self.fed} tokens were generated, {len(generated)} given")
        seq = len(self.position)
        p = self.prefix.n_tokens
        tail = self.suffix_ids + list(generated[: self.fed])
        needed = p + state.n_tokens + len(tail) + self.max_new_tokens - self.fed
        if self.ctx.split and (seq >= self.ctx.n_seq or needed > self.ctx.seq_cells):
            self._grow(seq + 1, needed)
        if seq >= self.ctx.n_seq:
            raise ValueError(f"join: the context holds {self.ctx.n_seq} sequences")
        restore_expert(self.ctx, seq, self.prefix, state)
        start = p + state.n_tokens
        self.ctx.decode(tail, range(start, start + len(tail)), [seq] * len(tail), [False] * len(tail))
        self.position.append(start + len(tail))
        self.stats["experts"] = self.stats.get("experts", 0) + 1
        self.stats["joined"] = self.stats.get("joined", 0) + 1
        self.stats["context_tokens"] = self.stats.get("context_tokens", 0) + state.n_tokens

    def close(self) -> None:
        """After the loop: the context is free for the next question."""
        if self._locked:
            self._locked = False
            self.llm.lock.release()
