"""Batched expert decoding: N+1 experts in one forward per step, one decoding loop under every front end.

Row 0 is the amateur (prefix + question), row k the expert for document k (prefix + document_k +
question). Rows live in one preallocated cache::

    slots [0, P)            the shared prefix (stored once, copied into every row)
    slots [P, P + L_max)    row k's document in [P, P + L_k), the rest masked padding
    slots [P + L_max, ...)  the question suffix, then the generated tokens

Each row's position ids continue its own sequential prompt (P + L_k + j), so every expert sees
exactly the keys and positions of ``prefix + document_k + suffix + generated``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from .cache import BufferCache, forward_slots
from .kvstore import DocKV
from .llm import LoadedModel
from .rule import AMATEUR, ContrastiveRule, RuleConfig


@dataclass(frozen=True)
class SamplingConfig:
    """Greedy unless temperature > 0; stops on EOS, any stop string, or max_new_tokens."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks: generate exactly max_new_tokens

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("need temperature >= 0, 0 < top_p <= 1 and top_k >= 0")


@dataclass
class Expert:
    """A contextual expert: its document id, relevance r in (0, 1) and a loader for its cache."""

    doc_id: str
    relevance: float
    load: Callable[[], DocKV]


@dataclass
class Step:
    """One generated token, the text it added, and the expert that won it (AMATEUR = -1)."""

    index: int
    token_id: int
    text: str
    winner: int
    doc_id: str | None
    support: list[float] = field(default_factory=list)  # s_hat_k[token] per expert (PCED only)


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    trace: list[Step]
    betas: list[float]
    timings: dict[str, float]
    method: str = "pced"
    amateur_only: bool = False
    stats: dict = field(default_factory=dict)


def pick_token(scores: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> int:
    """Greedy argmax (lowest id on ties), or a temperature / top-k / top-p draw."""
    if sampling.temperature <= 0:
        return int(torch.argmax(scores))
    logits = scores.float() / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= sampling.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


class TextTracker:
    """Incremental detokenization and stop handling shared by every decoding loop."""

    def __init__(self, tokenizer: object, eos_ids: set[int], stop: Sequence[str]):
        self.tokenizer, self.eos_ids, self.stop = tokenizer, eos_ids, tuple(stop)
        self.ids: list[int] = []
        self.text = ""
        self.finished = False

    @classmethod
    def for_model(cls, llm: LoadedModel, sampling: SamplingConfig) -> "TextTracker":
        return cls(llm.tokenizer, set() if sampling.ignore_eos else llm.eos_token_ids(), sampling.stop)

    def push(self, token: int) -> str:
        """Add a token; returns the text it adds (empty for EOS) and sets ``finished``.

        A character split across tokens decodes to U+FFFD until its last byte arrives, so a
        trailing replacement character is held back instead of streamed (``flush`` releases it).
        """
        if token in self.eos_ids:
            self.finished = True
            return ""
        self.ids.append(token)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for stop in self.stop:
            cut = full.find(stop)
            if cut >= 0:
                full, self.finished = full[:cut], True
        self.full = full
        stable = full if self.finished else full.rstrip("\ufffd")
        piece, self.text = stable[len(self.text) :], stable
        return piece

    def flush(self) -> str:
        """Whatever was held back (an incomplete character at the very end)."""
        rest = getattr(self, "full", self.text)[len(self.text) :]
        self.text += rest
        return rest


class Generation:
    """Iterate to stream Steps; afterwards ``answer()`` has the text, trace, betas and timings.

    Subclasses (the baselines) reuse this loop and override ``_prefill`` (build the cache and
    the first logits), ``_scores`` (logits -> vocabulary scores and winner) and ``_forward``.
    """

    method = "pced"

    def __init__(
        self,
        llm: LoadedModel,
        prefix: DocKV,
        experts: Sequence[Expert],
        suffix_ids: Sequence[int],
        amateur_suffix_ids: Sequence[int] | None = None,
        rule: RuleConfig = RuleConfig(),
        sampling: SamplingConfig = SamplingConfig(),
    ):
        if not suffix_ids:
            raise ValueError("the question suffix is empty")
        self.llm, self.prefix, self.experts = llm, prefix, list(experts)
        self.suffix_ids = list(suffix_ids)
        self.amateur_suffix_ids = list(amateur_suffix_ids) if amateur_suffix_ids else self.suffix_ids
        self.rule_config, self.sampling = rule, sampling
        relevance = torch.tensor([e.relevance for e in self.experts], dtype=torch.float32)
        self.rule = ContrastiveRule(rule, relevance)
        self.tracker = TextTracker.for_model(llm, sampling)
        self.trace: list[Step] = []
        self.timings: dict[str, float] = {}
        self.stats: dict = {}
        self.last_logits: torch.Tensor | None = None  # [N+1, V] of the latest step, for tests and tools

    def _prefill(self) -> tuple[BufferCache, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Load the caches into one buffer and run the question suffix for all rows at once.

        The amateur's suffix may be shorter (no context separator): it is left-padded with masked
        slots so that every row's last suffix token sits in the same column.
        """
        started = time.perf_counter()
        device = self.llm.device
        caches = [expert.load() for expert in self.experts]
        prefix_len = self.prefix.n_tokens
        lengths = [0] + [kv.n_tokens for kv in caches]
        longest, batch = max(lengths), len(lengths)
        suffix_len = max(len(self.suffix_ids), len(self.amateur_suffix_ids))
        capacity = prefix_len + longest + suffix_len + self.sampling.max_new_tokens
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
        suffix_started = time.perf_counter()
        logits = forward_slots(self.llm.model, cache, valid, ids, positions)
        # The floor of PCED's time to first token: one suffix forward for all k+1 rows.
        self.timings["suffix_forward_s"] = time.perf_counter() - suffix_started
        return cache, valid, positions[:, -1] + 1, logits

    def __iter__(self) -> Iterator[Step]:
        started = time.perf_counter()
        generator = torch.Generator().manual_seed(self.sampling.seed) if self.sampling.seed is not None else None
        cache, valid, position, logits = self._prefill()
        for index in range(self.sampling.max_new_tokens):
            self.last_logits = logits
            scores, winner_of = self._scores(logits)
            token = pick_token(scores, self.sampling, generator)
            winner = winner_of(token)
            if index == 0:
                self.timings["ttft_s"] = time.perf_counter() - started
            piece = self.tracker.push(token)
            if token in self.tracker.eos_ids:
                break
            step = Step(index, token, piece, winner, self._doc_id(winner), self._support(token))
            self.trace.append(step)
            yield step
            if self.tracker.finished or index + 1 == self.sampling.max_new_tokens:
                break
            ids = torch.full((len(position), 1), token, device=position.device)
            valid[:, cache.length] = True
            logits = self._forward(cache, valid, ids, position[:, None])
            position = position + 1
        rest = self.tracker.flush()
        if rest and self.trace:
            self.trace[-1].text += rest
        self.timings["total_s"] = time.perf_counter() - started
        self.timings.setdefault("ttft_s", self.timings["total_s"])

    def _scores(self, logits: torch.Tensor):
        return self.rule.scores(logits)

    def _forward(self, cache: BufferCache, valid: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return forward_slots(self.llm.model, cache, valid, ids, positions)

    def _support(self, token: int) -> list[float]:
        return self.rule.support(token) if self.rule is not None else []

    def _doc_id(self, winner: int) -> str | None:
        return None if winner == AMATEUR else self.experts[winner].doc_id

    def answer(self) -> Answer:
        if "total_s" not in self.timings:
            for _ in self:
                pass
        return Answer(
            text=self.tracker.text,
            token_ids=list(self.tracker.ids),
            trace=self.trace,
            betas=self.rule.betas() if self.rule is not None else [],
            timings=dict(self.timings),
            method=self.method,
            amateur_only=not self.experts,
            stats=dict(self.stats),
        )


def generate(
    llm: LoadedModel,
    prefix: DocKV,
    experts: Sequence[Expert],
    suffix_ids: Sequence[int],
    amateur_suffix_ids: Sequence[int] | None = None,
    rule: RuleConfig = RuleConfig(),
    sampling: SamplingConfig = SamplingConfig(),
) -> Answer:
    """PCED decoding to completion (the non-streaming face of ``Generation``)."""
    return Generation(llm, prefix, experts, suffix_ids, amateur_suffix_ids, rule, sampling).answer()
