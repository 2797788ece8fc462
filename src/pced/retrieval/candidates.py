"""From a question to the candidate experts and their relevance priors r_k.

Paper §3: retrieve the top-N (recall), rerank them with a cross-encoder (precision), and keep
the scalar scores instead of discarding them: each candidate's prior is the harmonic mean of
its normalised retrieval and reranker scores (Appendix B), or the retrieval relevance alone
when no reranker is used. ``rank_given`` does the same for a fixed set of documents (an
example's own paragraphs), ``rescore`` recomputes r_k with another retriever for the same
candidates (the paper's PCED-Sparse / -Dense / -ColBERT).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pced.documents import Candidate, Document
from pced.options import AskOptions
from pced.retrieval.base import BaseRetriever, Hit
from pced.retrieval.rerankers import Reranker
from pced.retrieval.scores import fuse, normalize_reranker

DEFAULT_TOP_K = AskOptions.top_k

__all__ = ["Candidate", "DEFAULT_TOP_K", "rank_given", "relevances", "rescore", "retrieve"]


def retrieve(query: str, retriever: BaseRetriever, top_n: int = AskOptions.top_n,
             reranker: Reranker | None = None, top_k: int | None = DEFAULT_TOP_K,
             documents: Sequence[Document] | None = None) -> list[Candidate]:
    """Top-``top_k`` candidates for ``query`` out of the retriever's top-``top_n``.

    Without a reranker the order is the retriever's. With one, the candidates are ordered (and
    cut to ``top_k``) by the reranker logit, as in the paper's retrieve-then-rerank pipeline,
    while ``relevance`` is the fused prior. ``documents`` (the indexed corpus, in index order)
    default to those the retriever indexed in this process; a loaded index must be given them
    to rerank (without them a candidate's document carries only its id).
    """
    hits = retriever.search(query, top_n)
    docs = documents if documents is not None else retriever.documents
    if reranker is None:
        candidates = [_candidate(h, docs, None) for h in hits]
    else:
        if docs is None:
            raise ValueError("reranking needs the document texts: pass documents=")
        logits = reranker.score(query, [docs[h.index].render() for h in hits]) if hits else []
        candidates = [_candidate(h, docs, float(z)) for h, z in zip(hits, logits, strict=True)]
        # Stable sort: equal logits keep the retriever's order.
        candidates.sort(key=lambda c: -c.rerank_score)
    return candidates if top_k is None else candidates[:top_k]


def _candidate(hit: Hit, documents: Sequence[Document] | None, logit: float | None) -> Candidate:
    parts = {"retrieval": hit.score, "r_ret": hit.relevance}
    relevance = hit.relevance
    if logit is not None:
        r_rer = float(normalize_reranker(logit))
        parts.update(rerank=logit, r_rer=r_rer)
        relevance = float(fuse(hit.relevance, r_rer))
    parts.update(hit.parts)
    document = documents[hit.index] if documents is not None else Document(hit.doc_id, "")
    return Candidate(document, relevance, parts, index=hit.index)


def rank_given(query: str, retriever: BaseRetriever, rows: Sequence[int], documents: Sequence[Document],
               reranker: Reranker | None = None) -> list[Candidate]:
    """The corpus rows ``rows`` (all of them), scored against ``query`` and ranked best first:
    by relevance, or by the reranker logit when there is one (ties keep the order of ``rows``)."""
    rows = list(rows)
    if not rows:
        return []
    raw = np.asarray(retriever.scores(query), dtype=np.float64)[rows]
    r_ret = np.asarray(retriever.normalize(raw), dtype=np.float64)
    scores = [{"retrieval": float(s), "r_ret": float(r)} for s, r in zip(raw, r_ret)]
    relevance, order_by = r_ret, r_ret
    if reranker is not None:
        logits = np.asarray(reranker.score(query, [documents[r].render() for r in rows]), dtype=np.float64)
        r_rer = normalize_reranker(logits)
        relevance, order_by = fuse(r_ret, r_rer), logits
        for entry, z, r in zip(scores, logits, r_rer):
            entry.update(rerank=float(z), r_rer=float(r))
    order = np.argsort(-order_by, kind="stable")
    return [Candidate(documents[rows[j]], float(relevance[j]), scores[j], index=rows[j]) for j in order]


def rescore(candidates: Sequence[Candidate], retriever: BaseRetriever, name: str,
            raw_scores: np.ndarray) -> list[Candidate]:
    """The same candidates with r_k from ``retriever``, whose raw scores of the whole corpus for the
    question are ``raw_scores`` (fused with the reranker's r_rer when a candidate has one); each keeps
    its old scores and gains ``name`` (raw score) and the new ``r_ret``."""
    raw = np.asarray(raw_scores, dtype=np.float64)[[c.index for c in candidates]]
    r_ret = np.asarray(retriever.normalize(raw), dtype=np.float64)
    out = []
    for c, s, r in zip(candidates, raw, r_ret):
        relevance = float(r if c.r_rer is None else fuse(r, c.r_rer))
        out.append(Candidate(c.document, relevance, {**c.scores(), name: float(s), "r_ret": float(r)}, index=c.index))
    return out


def relevances(candidates: Sequence[Candidate]) -> np.ndarray:
    """The decoder's relevance vector ``r_1..r_k`` in candidate order."""
    return np.array([c.relevance for c in candidates], dtype=np.float64)
