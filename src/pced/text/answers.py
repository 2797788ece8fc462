"""What every backend produces and every front end reads: sampling settings, steps, answers, and
the ``pced ask --json`` contract. Plain dataclasses: a backend imports them without transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .citations import CitationRule, cite_answer
from ..documents import Candidate


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


def answer_json(answer: Answer, candidates: Sequence[Candidate], retrieval_s: float = 0.0,
                citation_rule: CitationRule = CitationRule()) -> dict:
    """The ``pced ask --json`` contract (docs/reference.md, "The JSON answer"), ``citations`` included: one per sentence of the
    answer, ``{"start", "end", "text", "doc_ids"}`` (``pced.text.citations``)."""
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
        "citations": [c.json() for c in cite_answer(answer, citation_rule)],
    }
