"""What every backend produces and every front end reads: sampling settings, steps, answers, and
the ``pced ask --json`` contract. Plain dataclasses: a backend imports them without transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .documents import Candidate


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
    no_repeat_ngram: int = 0  # n > 0: never complete an n-gram the answer already holds (0 = off)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("need temperature >= 0, 0 < top_p <= 1 and top_k >= 0")
        if isinstance(self.no_repeat_ngram, bool) or not isinstance(self.no_repeat_ngram, int) or self.no_repeat_ngram < 0:
            raise ValueError(f"no_repeat_ngram must be an integer >= 0 (0 = off), got {self.no_repeat_ngram!r}")


@dataclass
class Step:
    """One generated token, the text it added, and the expert that won it (AMATEUR = -1)."""

    index: int
    token_id: int
    text: str
    winner: int
    doc_id: str | None
    support: list[float] = field(default_factory=list)  # s_hat_k[token] per expert (PCED only)
    relevance: list[float] | None = None  # r_k used at this step, when decode-time relevance is on


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


def experts_json(candidates: Sequence[Candidate]) -> list[dict]:
    """The ``experts`` list of the contract: one entry per document the method read, ranked order."""
    return [{"doc_id": c.document.id, "title": c.document.title, "relevance": c.relevance, "scores": c.scores()}
            for c in candidates]


def answer_json(answer: Answer, candidates: Sequence[Candidate], retrieval_s: float = 0.0) -> dict:
    """The ``pced ask --json`` contract of DESIGN.md."""
    timings = {"retrieval_s": retrieval_s, "cache_load_s": 0.0, "ttft_s": 0.0, "total_s": 0.0}
    timings.update(answer.timings)
    return {
        "answer": answer.text,
        "method": answer.method,
        "experts": experts_json(candidates),
        "trace": [{"token": step.text, "doc_id": step.doc_id,
                   **({"relevance": step.relevance} if step.relevance is not None else {})} for step in answer.trace],
        "beta": answer.betas,
        "timings": timings,
        "amateur_only": answer.amateur_only,
    }
