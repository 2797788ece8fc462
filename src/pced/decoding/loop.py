"""The one decoding loop under every method and front end (the shape of mlx-lm's ``generate_step``).

The loop knows two narrow things, both protocols here, so that methods and backends plug in:

- ``Rows``: rows of a model with their caches. ``prefill()`` runs the prompts and returns the
  next-token logits ``[R, V]``; ``advance(token)`` appends one token to every row and returns the
  next logits. The transformers backend implements it with one preallocated cache
  (``pced.backends.rows``); a method may compose rows (MapReduce runs its map calls in ``prefill``).
- ``Scoring``: from ``[R, V]`` logits to vocabulary scores and the row that won a token: the PCED
  rule (``ContrastiveScoring``) or plain next-token scores of one row (``PlainScoring``).

Everything else, sampling, stop strings, EOS (and ``ignore_eos``), the logits processors (the
no-repeat n-gram ban), the loop guard (``pced.decoding.repetition``), detokenization, the trace, timings,
is done here once, for every method.
Each step runs on the logits' device and reads back one small tensor (token, winner, finiteness,
support): one device-to-host transfer per token.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, NamedTuple, Protocol, Sequence

import torch

from ..text.answers import Answer, Step
from ..errors import DataError, PcedError
from .sampling import SamplingConfig
from ..text.detokenize import TextTracker
from .repetition import LoopGuard, key_of
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


def raise_if_not_finite(rows: Sequence[bool], scoring: "Scoring") -> None:
    """Stop before NaN or infinite logits decide a token; name the rows (documents) that made them.
    ``rows``: whether each row's logits were all finite (read back with the step's token)."""
    if all(rows):
        return
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

    def close(self) -> None:
        """Optional: called once the loop ends (finished, stopped early or abandoned), for rows that
        hold engine resources (a serving engine's running requests). Rows that subclass ``Rows``
        inherit this no-op."""


class Scoring(Protocol):
    """From ``[R, V]`` logits to vocabulary scores and the row that won a token, on the logits' device:
    ``scores`` returns scores [V] and ``winner_of(token)`` (token a 0-d tensor) a 0-d integer tensor
    (or an int, for a backend that decided on the host); ``support(token)`` each expert's score of
    the token, [N] (or a list). Nothing here reads the device: the loop reads once per step."""

    rule_config: RuleConfig | None

    def scores(self, logits: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor | int]]: ...

    def doc_id(self, winner: int) -> str | None: ...

    def support(self, token: torch.Tensor) -> torch.Tensor | list[float]: ...

    def betas(self) -> list[float]: ...


class PlainScoring:
    """One row's next-token scores; no experts, no attribution (every doc_id is null)."""

    rule_config = None

    def scores(self, logits: torch.Tensor):
        return logits[0].float(), lambda token: AMATEUR

    def doc_id(self, winner: int) -> None:
        return None

    def support(self, token: torch.Tensor) -> list[float]:
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

    def support(self, token: torch.Tensor) -> torch.Tensor:
        return self.rule.support_at(token)

    def betas(self) -> list[float]:
        return self.rule.betas()


# A logits processor (mlx-lm's shape): (the answer's tokens so far [T] on the scores' device,
# scores [V]) -> scores [V]. The loop applies them in order, after the rule and before sampling.
LogitsProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def ban_repeated_ngrams(scores: torch.Tensor, generated: Sequence[int] | torch.Tensor, n: int) -> torch.Tensor:
    """``scores`` [V] with -inf for every token that would complete an n-gram already in
    ``generated`` (a new tensor; nothing else changes). ``generated`` is the answer's own tokens,
    not the prompt: the loop sees only those for every method (PCED's rows hold different prompts,
    the baselines' one), and repeating a phrase of the question is legitimate. On the device, with
    no read back: every window of n tokens whose first n - 1 equal the last n - 1 bans its last."""
    if n <= 0 or len(generated) < n:
        return scores
    tokens = generated if isinstance(generated, torch.Tensor) else torch.tensor(list(generated), dtype=torch.long)
    tokens = tokens.to(scores.device)
    windows = tokens.unfold(0, n, 1)  # [T - n + 1, n]
    match = (windows[:, : n - 1] == tokens[len(tokens) - n + 1 :]).all(dim=-1)
    hit = torch.zeros(scores.shape[-1], dtype=torch.float32, device=scores.device)
    hit.scatter_reduce_(0, windows[:, n - 1], match.float(), reduce="amax")
    return scores.masked_fill(hit > 0, float("-inf"))


def make_logits_processors(sampling: SamplingConfig) -> list[LogitsProcessor]:
    """The processors a sampling configuration asks for (today: the no-repeat n-gram ban)."""
    processors: list[LogitsProcessor] = []
    if sampling.no_repeat_ngram:
        n = sampling.no_repeat_ngram
        processors.append(lambda tokens, scores: ban_repeated_ngrams(scores, tokens, n))
    return processors


def pick_token(scores: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """Greedy argmax (lowest id on ties), or a temperature / top-k / top-p draw; a 0-d tensor on the
    scores' device. The draw is ``argmax(p / E)``, E ~ Exponential(1): the fast path of
    ``torch.multinomial`` for one sample (the same tokens for the same generator), without its
    validity check, which reads the device."""
    if sampling.temperature <= 0:
        return torch.argmax(scores)
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
    return torch.argmax(probs / torch.empty_like(probs).exponential_(1, generator=generator))


class Generation:
    """Iterate to stream Steps; afterwards ``answer()`` has the text, trace, betas and timings.

    ``llm`` is anything with ``tokenizer`` and ``eos_token_ids()``. ``amateur_only`` marks a PCED
    answer that had no documents (the amateur alone decided).
    """

    def __init__(self, rows: Rows, scoring: Scoring, llm, sampling: SamplingConfig = SamplingConfig(),
                 method: str = "pced", amateur_only: bool = False):
        self.rows, self.scoring, self.sampling, self.method = rows, scoring, sampling, method
        self.rule_config: RuleConfig | None = scoring.rule_config
        self.processors: list[LogitsProcessor] = make_logits_processors(sampling)
        self.amateur_only = amateur_only
        self.tracker = TextTracker.for_model(llm, sampling)
        self.trace: list[Step] = []
        self.streamed = 0  # steps of the trace yielded so far (the loop guard holds back the rest)
        self.guard = LoopGuard(sampling.loop_span, sampling.max_new_tokens) if sampling.loop_span and not sampling.ignore_eos else None
        self.keys: dict[int, str] = {}
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
            self.rows.close()

    def decide(self, logits: torch.Tensor, history: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """One step on the device: the rule, the processors, the draw. Returns one small float64
        tensor [token, winner, finite per row (R), support per expert (N)], read back in one transfer."""
        finite = torch.isfinite(logits).all(dim=-1)
        scores, winner_of = self.scoring.scores(logits)
        for processor in self.processors:  # after the rule: the winner still comes from the unprocessed scores
            scores = processor(history, scores)
        token = pick_token(scores, self.sampling, generator)
        winner, support = winner_of(token), self.scoring.support(token)
        parts = [token.view(1), torch.as_tensor(winner, device=logits.device).view(1), finite,
                 torch.as_tensor(support, dtype=torch.float64, device=logits.device).view(-1)]
        return torch.cat([part.to(torch.float64) for part in parts])

    def _steps(self) -> Iterator[Step]:
        started = time.perf_counter()
        self.check_deadline()
        logits = self.rows.prefill()
        generator, history = None, None
        for index in range(self.sampling.max_new_tokens):
            if isinstance(logits, Decision):  # the backend chose the token itself (inside its engine)
                token, winner = logits
                support = self.scoring.support(token)
            else:
                if history is None:  # the draw and the n-gram history live on the logits' device
                    device = logits.device
                    if self.sampling.seed is not None:
                        generator = torch.Generator(device=device).manual_seed(self.sampling.seed)
                    history = torch.zeros(self.sampling.max_new_tokens, dtype=torch.long, device=device)
                self.last_logits = logits
                packet = self.decide(logits, history[:index], generator).tolist()  # the step's one read
                rows = logits.shape[0]
                token, winner = int(packet[0]), int(packet[1])
                raise_if_not_finite([bool(ok) for ok in packet[2 : 2 + rows]], self.scoring)
                support = packet[2 + rows :]
            if index == 0:
                self.timings["ttft_s"] = time.perf_counter() - started
            piece = self.tracker.push(token)
            if token in self.tracker.eos_ids:
                break
            step = Step(index, token, piece, winner, self.scoring.doc_id(winner), support, self.step_relevance())
            self.trace.append(step)
            if self.guard is not None and self.guard.push(self.key(token)):
                self.cut(self.guard.keep)
                break
            yield from self.release(self.guard.held if self.guard is not None else 0)
            if self.tracker.finished or index + 1 == self.sampling.max_new_tokens:
                break
            if history is not None:
                history[index] = token
            self.check_deadline()
            self.between_tokens()
            logits = self.rows.advance(token)
        rest = self.tracker.flush()
        if rest and self.trace:
            self.trace[-1].text += rest
        self.timings["total_s"] = time.perf_counter() - started
        self.timings.setdefault("ttft_s", self.timings["total_s"])
        yield from self.release(0)

    def key(self, token: int) -> str:
        if token not in self.keys:
            self.keys[token] = key_of(self.tracker.tokenizer, token)
        return self.keys[token]

    def release(self, held: int) -> Iterator[Step]:
        """Yield the steps of the trace not yet streamed, but the last ``held``."""
        end = len(self.trace) - held
        while self.streamed < end:
            self.streamed += 1
            yield self.trace[self.streamed - 1]

    def cut(self, keep: int) -> None:
        """The answer loops: keep its first ``keep`` tokens (none of the rest was streamed)."""
        del self.trace[keep:]
        self.tracker.truncate(keep)

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
