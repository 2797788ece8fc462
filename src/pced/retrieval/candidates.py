"""From a question to the candidate experts and their relevance priors r_k.

Paper §3: retrieve the top-N (recall), rerank them with a cross-encoder (precision), and keep
the scalar scores instead of discarding them: each candidate's prior is the harmonic mean of
its normalised retrieval and reranker scores (Appendix B), or the retrieval relevance alone
when no reranker is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pced.documents import Document
from pced.retrieval.base import DEFAULT_TOP_N, BaseRetriever, Hit
from pced.retrieval.rerankers import Reranker
from pced.retrieval.scores import fuse, normalize_reranker

DEFAULT_TOP_K = 8


@dataclass(frozen=True)
class Candidate:
    """One expert document with every score that went into its relevance ``r``."""

    index: int  # position in the indexed corpus
    doc_id: str
    retrieval_score: float  # raw retriever score
    r_ret: float  # retrieval relevance in (0, 1)
    rerank_score: float | None  # raw reranker logit, None without a reranker
    r_rer: float | None  # sigmoid(logit), None without a reranker
    relevance: float  # r_k used by the decoder: fuse(r_ret, r_rer) or r_ret
    parts: dict[str, float] = field(default_factory=dict)  # raw component scores

    def scores(self) -> dict[str, Any]:
        """The score breakdown for JSON output (``pced ask --json`` ``experts[].scores``)."""
        out: dict[str, Any] = {"retrieval": self.retrieval_score, "r_ret": self.r_ret}
        if self.rerank_score is not None:
            out.update(rerank=self.rerank_score, r_rer=self.r_rer)
        out.update(self.parts)
        return out


def retrieve(query: str, retriever: BaseRetriever, top_n: int = DEFAULT_TOP_N,
             reranker: Reranker | None = None, top_k: int | None = DEFAULT_TOP_K,
             documents: Sequence[Document] | None = None) -> list[Candidate]:
    """Top-``top_k`` candidates for ``query`` out of the retriever's top-``top_n``.

    Without a reranker the order is the retriever's. With one, the candidates are ordered (and
    cut to ``top_k``) by the reranker logit, as in the paper's retrieve-then-rerank pipeline,
    while ``relevance`` is the fused prior. The reranker reads ``documents[i].render()``;
    ``documents`` defaults to those the retriever indexed in this process (a loaded index
    must be given the store's documents).
    """
    hits = retriever.search(query, top_n)
    if reranker is None:
        candidates = [_candidate(h, None) for h in hits]
    else:
        docs = documents if documents is not None else retriever.documents
        if docs is None:
            raise ValueError("reranking needs the document texts: pass documents=")
        logits = reranker.score(query, [docs[h.index].render() for h in hits]) if hits else []
        candidates = [_candidate(h, float(z)) for h, z in zip(hits, logits, strict=True)]
        # Stable sort: equal logits keep the retriever's order.
        candidates.sort(key=lambda c: -c.rerank_score)
    return candidates if top_k is None else candidates[:top_k]


def _candidate(hit: Hit, logit: float | None) -> Candidate:
    r_rer = None if logit is None else float(normalize_reranker(logit))
    relevance = hit.relevance if r_rer is None else float(fuse(hit.relevance, r_rer))
    return Candidate(index=hit.index, doc_id=hit.doc_id, retrieval_score=hit.score,
                     r_ret=hit.relevance, rerank_score=logit, r_rer=r_rer, relevance=relevance,
                     parts=dict(hit.parts))


def relevances(candidates: Sequence[Candidate]) -> np.ndarray:
    """The decoder's relevance vector ``r_1..r_k`` in candidate order."""
    return np.array([c.relevance for c in candidates], dtype=np.float64)
