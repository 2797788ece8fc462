"""Decode-time relevance: the answer so far is evidence about what to read.

PCED's priors r_k come from the question alone, so in a two-hop question the second document's
relevance only shows once the bridge entity has been generated. ``Follow`` is called by
``PCEDGeneration`` between tokens; at each word boundary (when the answer has a new complete
word) it retrieves again with the question plus the answer's complete words and

- ``rescore``: r_k <- max(r_k from the question, r_k from question + answer) for every expert
  found in the new ranking's pool (an expert never loses the relevance the question gave it);
- ``max_joins``: a document of the new top-k that is not an expert yet joins the batch as a new
  expert (its cache loaded, its row caught up on the question suffix and the answer so far) with
  its new relevance: at most one per boundary, ``max_joins`` per answer.

Both off (the default) is the paper's PCED, token for token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..documents import Candidate
from ..kv.segment import DocKV

MODES = ("off", "rescore", "join", "rescore+join")  # pced eval --follow


@dataclass
class Follow:
    """How to look again: ``retrieve(query)`` ranks the store's candidates (relevance set) for a
    query; ``load(candidate)`` gives a document's cache (encoding it if needed)."""

    question: str
    retrieve: Callable[[str], Sequence[Candidate]]
    load: Callable[[Candidate], DocKV]
    top_k: int
    rescore: bool = False
    max_joins: int = 0
    seen: str = ""  # the complete words the last look used
    joins: int = 0
    looks: int = 0

    @property
    def active(self) -> bool:
        return self.rescore or self.joins < self.max_joins

    def words(self, answer: str) -> str | None:
        """The answer's complete words if they changed since the last look, else None."""
        cut = max(answer.rfind(" "), answer.rfind("\n"))
        words = answer[:cut].strip() if cut > 0 else ""
        if not words or words == self.seen:
            return None
        self.seen = words
        return words

    def look(self, answer: str, experts: Sequence[str], base: Sequence[float],
             current: Sequence[float]) -> tuple[list[float] | None, Candidate | None]:
        """New relevances for ``experts`` (doc ids; None: unchanged) and the candidate that joins (or None)."""
        words = self.words(answer)
        if words is None or not self.active:
            return None, None
        self.looks += 1
        ranked = list(self.retrieve(f"{self.question} {words}"))
        found = {c.document.id: c.relevance for c in ranked}
        relevance = None
        if self.rescore:
            relevance = [max(b, found.get(doc_id, 0.0)) for doc_id, b in zip(experts, base)]
            if relevance == list(current):
                relevance = None
        joining = None
        if self.joins < self.max_joins:
            present = set(experts)
            joining = next((c for c in ranked[: self.top_k] if c.document.id not in present), None)
            if joining is not None:
                self.joins += 1
        return relevance, joining
