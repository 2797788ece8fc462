"""The document record and the candidate (a document chosen for a question), shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Document:
    """One retrievable passage. ``text`` is the body; ``title`` is optional."""

    id: str
    text: str
    title: str = ""
    source: str = ""  # a chunk: the id of the document it was split from (that document owns it)

    @property
    def owner(self) -> str:
        """The id of the document as the user indexed it (a chunk's source, else its own id)."""
        return self.source or self.id

    def render(self) -> str:
        """The text an LLM sees for this document (title on its own line when present)."""
        body = self.text.strip()
        title = self.title.strip()
        return f"{title}\n{body}" if title else body


@dataclass
class Candidate:
    """A document chosen for a question: its relevance r in (0, 1) and the scores behind it.

    ``score_parts`` is the breakdown reported in ``pced ask --json`` (``experts[].scores``):
    ``retrieval`` (raw retriever score) and ``r_ret``, ``rerank`` and ``r_rer`` with a reranker,
    one raw score per retriever component, or ``given`` for documents passed with a question.
    ``index`` is the document's row in the retriever's corpus (None when not retrieved).
    """

    document: Document
    relevance: float
    score_parts: dict = field(default_factory=dict)
    index: int | None = None

    def scores(self) -> dict:
        return self.score_parts

    @property
    def doc_id(self) -> str:
        return self.document.id

    @property
    def retrieval_score(self) -> float | None:
        return self.score_parts.get("retrieval")

    @property
    def r_ret(self) -> float | None:
        return self.score_parts.get("r_ret")

    @property
    def rerank_score(self) -> float | None:
        return self.score_parts.get("rerank")

    @property
    def r_rer(self) -> float | None:
        return self.score_parts.get("r_rer")
