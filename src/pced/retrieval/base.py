"""The common shape of every retriever: ``index(documents)``, then ``search(query, top_n)``.

A retriever owns one scoring function over the whole corpus (``scores_many``) and one map from
its raw scores to relevance in (0, 1) (``normalize``); ranking, top-n capping and the ``Hit``
records are shared here so that BM25, MiniLM, BGE-M3 and hybrids rank identically.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from pced.documents import Document
from pced.options import AskOptions
from pced.retrieval.storage import load_json, save_json

DEFAULT_TOP_N = AskOptions.top_n  # the paper's candidate pool per query
IDS_FILE = "doc_ids.json"
QUERY_CHUNK = 32  # queries scored at once: bounds the [queries, corpus] score matrix


@dataclass(frozen=True)
class Hit:
    """One retrieved document: its position in the indexed corpus, raw score and relevance.

    ``parts`` holds the raw score of every signal that went into ``score`` (one entry for a
    plain retriever, one per component for a hybrid), so a caller can report them all.
    """

    index: int
    doc_id: str
    score: float
    relevance: float
    parts: Mapping[str, float] = field(default_factory=dict)


def top_indices(scores: np.ndarray, top_n: int) -> np.ndarray:
    """Indices of the ``top_n`` highest scores, best first; ties keep corpus order (stable)."""
    scores = np.asarray(scores)
    top_n = max(0, min(int(top_n), scores.shape[0]))
    return np.argsort(-scores, kind="stable")[:top_n]


class BaseRetriever:
    """Shared ranking logic; subclasses implement ``_index_texts``, ``scores_many``, ``normalize``,
    ``save``, ``load`` and ``describe``."""

    kind: ClassVar[str] = ""
    name: str = ""

    def __init__(self) -> None:
        self.doc_ids: list[str] = []
        # Kept only when indexed in this process: rerankers need the texts, and a loaded index
        # gets them from the document store instead of duplicating them on disk.
        self.documents: list[Document] | None = None

    def __len__(self) -> int:
        return len(self.doc_ids)

    # -- indexing -------------------------------------------------------------------------
    def index(self, documents: Sequence[Document]) -> BaseRetriever:
        """Build the index over ``documents`` (their ``render()``: title, then text)."""
        documents = list(documents)
        if not documents:
            raise ValueError("cannot index an empty corpus")
        ids = [d.id for d in documents]
        if len(set(ids)) != len(ids):
            raise ValueError("document ids must be unique")
        self._index_texts([d.render() for d in documents])
        self.doc_ids = ids
        self.documents = documents
        return self

    def _index_texts(self, texts: list[str]) -> None:
        raise NotImplementedError

    # -- scoring --------------------------------------------------------------------------
    def scores_many(self, queries: Sequence[str]) -> np.ndarray:
        """Raw scores ``[len(queries), len(corpus)]`` of every document for every query."""
        raise NotImplementedError

    def scores(self, query: str) -> np.ndarray:
        """Raw scores of every document for one query."""
        return self.scores_many([query])[0]

    def normalize(self, raw: np.ndarray) -> np.ndarray:
        """Map this retriever's raw scores to relevance in (0, 1)."""
        raise NotImplementedError

    def search(self, query: str, top_n: int = DEFAULT_TOP_N) -> list[Hit]:
        """The ``top_n`` best documents for ``query``, best first (capped by corpus size)."""
        return self.search_many([query], top_n)[0]

    def search_many(self, queries: Sequence[str], top_n: int = DEFAULT_TOP_N) -> list[list[Hit]]:
        """``search`` for several queries, scoring them in batches."""
        self._require_index()
        queries = list(queries)
        results: list[list[Hit]] = []
        for start in range(0, len(queries), QUERY_CHUNK):
            for raw in self.scores_many(queries[start : start + QUERY_CHUNK]):
                results.append(self.hits_from_scores(raw, top_n))
        return results

    def hits_from_scores(self, raw: np.ndarray, top_n: int) -> list[Hit]:
        """Rank one row of raw scores into ``Hit`` records."""
        idx = top_indices(raw, top_n)
        chosen = np.asarray(raw[idx], dtype=np.float64)
        rel = self.normalize(chosen)
        return [
            Hit(int(i), self.doc_ids[int(i)], float(s), float(r), {self.name: float(s)})
            for i, s, r in zip(idx, chosen, rel, strict=True)
        ]

    def _require_index(self) -> None:
        if not self.doc_ids:
            raise RuntimeError(f"{type(self).__name__} has no index: call index() or load() first")

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError


def save_doc_ids(directory: str | Path, doc_ids: Sequence[str]) -> None:
    save_json(Path(directory) / IDS_FILE, list(doc_ids))


def load_doc_ids(directory: str | Path) -> list[str]:
    return [str(i) for i in load_json(Path(directory) / IDS_FILE)]
