"""The one decoding loop under every method and front end (the shape of mlx-lm's ``generate_step``).

The loop knows two narrow things, both protocols here, so that methods and backends plug in:

- ``Rows``: rows of a model with their caches. ``prefill()`` runs the prompts and returns the
  next-token logits ``[R, V]``; ``advance(token)`` appends one token to every row and returns the
  next logits. The transformers backend implements it with one preallocated cache
  (``pced.backends.rows``); a method may compose rows (MapReduce runs its map calls in ``prefill``).
- ``Scoring``: from ``[R, V]`` logits to vocabulary scores and the row that won a token: the PCED
  rule (``ContrastiveScoring``) or plain next-token scores of one row (``PlainScoring``).

Everything else, sampling, stop strings, EOS (and ``ignore_eos``), the no-repeat n-gram ban,
detokenization, the trace, timings, is done here once, for every method.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, NamedTuple, Protocol, Sequence

import torch

from .answers import Answer, Step
from .errors import DataError, PcedError
from .sampling import SamplingConfig
from .detokenize import TextTracker
from .rule import AMATEUR, ContrastiveRule, RuleConfig


class DecodingError(DataError):
    """The model produced something the rule cannot use (non-finite logits: a damaged cache)."""

    code = "damaged_cache"


class TimeLimitError(PcedError):
    """An answer stopped at its deadline (the server's time limit for one request)."""

    code = "timeout"


class Deadline:
    """A point on the monotonic clock after which a generation stops between two tokens."""

    def __init__(self, seconds: float, start: float | None = None):
        self.seconds = seconds
        self.at = (time.monotonic() if start is None else start) + seconds

    def check(self) -> None:
        if time.monotonic() > self.at:
            raise TimeLimitError(f"stopped after the time limit of {self.seconds:g} s for one request")


def check_finite(logits: torch.Tensor, scoring: "Scoring") -> None:
    """Stop before NaN or infinite logits reach the rule; name the rows (documents) that made them."""
    finite = torch.isfinite(logits).all(dim=-1)
    if bool(finite.all()):
        return
    rows = finite.tolist()
    if len(rows) == 1:
        names = "the prompt"
    else:  # row 0 is the amateur, row k the expert of document k
        names = ", ".join("the amateur" if i == 0 else repr(scoring.doc_id(i - 1)) for i, ok in enumerate(rows) if not ok)
    raise DecodingError(f"non-finite logits from {names}: a stored KV cache is damaged (run pced verify STORE)")


class Decision(NamedTuple):
    """A token that a backend's rows chose themselves (inside a serving engine) and the expert that
    won it: the loop takes it as it is, without scoring logits."""

    token: int
    winner: int


class Rows(Protocol):
    """Rows of a model with caches: the backend seam of the loop. ``prefill`` and ``advance`` return
    the next-token logits ``[R, V]``, or a ``Decision`` where the backend decides the token itself."""

    timings: dict[str, float]  # e.g. cache_load_s, suffix_forward_s
    stats: dict

    def prefill(self) -> torch.Tensor | Decision: ...

    def advance(self, token: int) -> torch.Tensor | Decision: ...

    # Optional ``close()``: called once the loop ends (finished, stopped early or abandoned), for
    # rows that hold engine resources (the vLLM backend's running requests).


class Scoring(Protocol):
    def scores(self, logits: torch.Tensor) -> tuple[torch.Tensor, Callable[[int], int]]: ...

    def doc_id(self, winner: int) -> str | None: ...

    def support(self, token: int) -> list[float]: ...

    def betas(self) -> list[float]: ...


class PlainScoring:
    """One row's next-token scores; no experts, no attribution (every doc_id is null)."""

    rule_config = None

    def scores(self, logits: torch.Tensor):
        return logits[0].float(), lambda token: AMATEUR

    def doc_id(self, winner: int) -> None:
        return None

    def support(self, token: int) -> list[float]:
        return []

    def betas(self) -> list[float]:
        return []


class ContrastiveScoring:
    """The PCED rule over row 0 (the amateur) and one row per expert document."""

    def __init__(self, rule: RuleConfig, doc_ids: Sequence[str], relevance: Sequence[float]):
        self.rule_config, self.doc_ids = rule, list(doc_ids)
        self.rule = ContrastiveRule(rule, torch.tensor(list(relevance), dtype=torch.float32))

    def scores(self, logits: torch.Tensor):
        return self.rule.scores(logits)

    def doc_id(self, winner: int) -> str | None:
        return None if winner == AMATEUR else self.doc_ids[winner]

    def support(self, token: int) -> list[float]:
        return self.rule.support(token)

    def betas(self) -> list[float]:
        return self.rule.betas()


def ban_repeated_ngrams(scores: torch.Tensor, generated: Sequence[int], n: int) -> torch.Tensor:
    """``scores`` [V] with -inf for every token that would complete an n-gram already in
    ``generated`` (a new tensor; nothing else changes). ``generated`` is the answer's own tokens,
    not the prompt: the loop sees only those for every method (PCED's rows hold different prompts,
    the baselines' one), and repeating a phrase of the question is legitimate. transformers'
    ``NoRepeatNGramLogitsProcessor`` does the matching."""
    if n <= 0 or len(generated) < n:
        return scores
    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

    ids = torch.tensor([list(generated)], dtype=torch.long, device=scores.device)
    return NoRepeatNGramLogitsProcessor(n)(ids, scores[None].clone())[0]


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


class Generation:
    """Iterate to stream Steps; afterwards ``answer()`` has the text, trace, betas and timings.

    ``llm`` is anything with ``tokenizer`` and ``eos_token_ids()``. ``amateur_only`` marks a PCED
    answer that had no documents (the amateur alone decided).
    """

    def __init__(self, rows: Rows, scoring: Scoring, llm, sampling: SamplingConfig = SamplingConfig(),
                 method: str = "pced", amateur_only: bool = False):
        self.rows, self.scoring, self.sampling, self.method = rows, scoring, sampling, method
        self.rule_config: RuleConfig | None = getattr(scoring, "rule_config", None)
        self.amateur_only = amateur_only
        self.tracker = TextTracker.for_model(llm, sampling)
        self.trace: list[Step] = []
        self.timings = rows.timings  # one dict: the rows' cache_load_s / suffix_forward_s, then ttft_s, total_s
        self.last_logits: torch.Tensor | None = None  # [R, V] of the latest step, for tests and tools
        self.deadline: Deadline | None = None  # checked before the prefill and between tokens

    @property
    def stats(self) -> dict:
        return self.rows.stats

    def __iter__(self) -> Iterator[Step]:
        try:
            yield from self._steps()
        finally:  # finished, stopped early or abandoned: rows that hold engine resources give them back
            close = getattr(self.rows, "close", None)
            if close is not None:
                close()

    def _steps(self) -> Iterator[Step]:
        started = time.perf_counter()
        generator = torch.Generator().manual_seed(self.sampling.seed) if self.sampling.seed is not None else None
        self.check_deadline()
        logits = self.rows.prefill()
        for index in range(self.sampling.max_new_tokens):
            if isinstance(logits, Decision):
                token, winner = logits
            else:
                check_finite(logits, self.scoring)
                self.last_logits = logits
                scores, winner_of = self.scoring.scores(logits)
                if self.sampling.no_repeat_ngram:  # after the rule: the winner still comes from the unbanned scores
                    scores = ban_repeated_ngrams(scores, self.tracker.ids, self.sampling.no_repeat_ngram)
                token = pick_token(scores, self.sampling, generator)
                winner = winner_of(token)
            if index == 0:
                self.timings["ttft_s"] = time.perf_counter() - started
            piece = self.tracker.push(token)
            if token in self.tracker.eos_ids:
                break
            step = Step(index, token, piece, winner, self.scoring.doc_id(winner), self.scoring.support(token),
                        self.step_relevance())
            self.trace.append(step)
            yield step
            if self.tracker.finished or index + 1 == self.sampling.max_new_tokens:
                break
            self.check_deadline()
            self.between_tokens()
            logits = self.rows.advance(token)
        rest = self.tracker.flush()
        if rest and self.trace:
            self.trace[-1].text += rest
        self.timings["total_s"] = time.perf_counter() - started
        self.timings.setdefault("ttft_s", self.timings["total_s"])

    def check_deadline(self) -> None:
        if self.deadline is not None:
            self.deadline.check()

    def between_tokens(self) -> None:
        """After a token is chosen and streamed, before the rows take it: a method may change its
        experts here (PCED's decode-time relevance). Nothing by default."""

    def step_relevance(self) -> list[float] | None:
        """The relevance each expert had at this step, when it can change during the answer."""
        return None

    def answer(self) -> Answer:
        if "total_s" not in self.timings:
            for _ in self:
                pass
        return Answer(
            text=self.tracker.text,
            token_ids=list(self.tracker.ids),
            trace=self.trace,
            betas=self.scoring.betas(),
            timings=dict(self.timings),
            method=self.method,
            amateur_only=self.amateur_only,
            stats=dict(self.stats),
        )
