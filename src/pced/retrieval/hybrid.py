"""Sparse + dense hybrid retrieval fused by the paper's harmonic mean (or, as measured
alternatives, their mean or reciprocal rank fusion: ``retrieval.scores.FUSIONS``).

BM25 catches rare exact terms (names, dates) that a small bi-encoder blurs; the bi-encoder
catches paraphrases BM25 misses. The candidate pool is the union of both top-N lists, and
each candidate's relevance is ``fuse(r_sparse, r_dense)``. Both components can score any
document, so a candidate found by only one list still gets the other's real score rather than
a default.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError
from pced.documents import Document
from pced.retrieval.base import DEFAULT_TOP_N, QUERY_CHUNK, BaseRetriever, Hit, top_indices
from pced.retrieval.scores import FUSIONS, clip_relevance, fuse, fuse_mean, fuse_rrf
from pced.retrieval.storage import read_manifest, write_manifest

TYPE = "hybrid"


class HybridRetriever(BaseRetriever):
    """Union of a sparse and a dense retriever's top-N, ranked by the fused relevance."""

    kind = "hybrid"
    composite = True  # its load opens its components through the registry

    def __init__(self, sparse: BaseRetriever, dense: BaseRetriever, name: str | None = None,
                 fusion: str = FUSIONS[0]) -> None:
        super().__init__()
        if fusion not in FUSIONS:
            raise UserError(f"fusion must be one of {', '.join(FUSIONS)}, got {fusion!r}")
        self.sparse, self.dense, self.fusion = sparse, dense, fusion
        self.name = name or f"{sparse.name}+{dense.name}"
        if sparse.doc_ids and dense.doc_ids:
            self._adopt_ids()

    def _adopt_ids(self) -> None:
        if self.sparse.doc_ids != self.dense.doc_ids:
            raise UserError("hybrid components index different corpora")
        self.doc_ids = list(self.sparse.doc_ids)

    def index(self, documents: Sequence[Document]) -> HybridRetriever:
        documents = list(documents)
        self.sparse.index(documents)
        self.dense.index(documents)
        self._adopt_ids()
        self.documents = documents
        return self

    def component_scores(self, queries: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Raw ``[queries, docs]`` scores of the sparse and the dense component."""
        return self.sparse.scores_many(queries), self.dense.scores_many(queries)

    def scores_many(self, queries: Sequence[str]) -> np.ndarray:
        """Fused relevance of every document (what the hybrid ranks by)."""
        s, d = self.component_scores(queries)
        if self.fusion == "rrf":  # ranks are per query
            return np.stack([self._fuse(a, b) for a, b in zip(s, d, strict=True)]) if len(s) else np.zeros((0, len(self)))
        return self._fuse(s, d)

    def _fuse(self, sparse_raw: np.ndarray, dense_raw: np.ndarray) -> np.ndarray:
        """Fused relevance of the documents whose raw scores are given ([docs] for one query, or
        [queries, docs] for harmonic and mean; ranks for ``rrf`` are taken among one query's documents)."""
        if self.fusion == "rrf":
            return fuse_rrf(sparse_raw, dense_raw)
        combine = fuse if self.fusion == "harmonic" else fuse_mean
        return combine(self.sparse.normalize(sparse_raw), self.dense.normalize(dense_raw))

    def normalize(self, raw: np.ndarray) -> np.ndarray:
        return clip_relevance(raw)  # the fused score already is a relevance

    def search_many(self, queries: Sequence[str], top_n: int = DEFAULT_TOP_N) -> list[list[Hit]]:
        self._require_index()
        queries, results = list(queries), []
        for start in range(0, len(queries), QUERY_CHUNK):
            sparse_raw, dense_raw = self.component_scores(queries[start : start + QUERY_CHUNK])
            for s, d in zip(sparse_raw, dense_raw, strict=True):
                results.append(self._fuse_hits(s, d, top_n))
        return results

    def _fuse_hits(self, sparse_raw: np.ndarray, dense_raw: np.ndarray, top_n: int) -> list[Hit]:
        pool = np.union1d(top_indices(sparse_raw, top_n), top_indices(dense_raw, top_n))
        # rrf: ranks in the whole corpus, as scores_many gives them, so search and rescoring agree
        fused = self._fuse(sparse_raw, dense_raw)[pool] if self.fusion == "rrf" else \
            self._fuse(sparse_raw[pool], dense_raw[pool])
        order = top_indices(fused, top_n)
        return [
            Hit(int(pool[k]), self.doc_ids[int(pool[k])], float(fused[k]), float(fused[k]),
                {self.sparse.name: float(sparse_raw[pool[k]]), self.dense.name: float(dense_raw[pool[k]])})
            for k in order
        ]

    def save(self, directory: str | os.PathLike) -> None:
        """Components go to ``sparse/`` and ``dense/`` subdirectories; manifest last."""
        self._require_index()
        self.sparse.save(Path(directory) / "sparse")
        self.dense.save(Path(directory) / "dense")
        write_manifest(directory, TYPE, kind=self.kind, name=self.name, count=len(self),
                       describe=self.describe())

    @classmethod
    def load(cls, directory: str | os.PathLike, load_component: Callable[..., BaseRetriever],
             **kwargs: Any) -> HybridRetriever:
        """Open both components with ``load_component`` (the registry's ``load_retriever``, which
        passes itself; ``kwargs`` go to the dense component's ``load``)."""
        manifest = read_manifest(directory, TYPE)
        sparse = load_component(Path(directory) / "sparse")
        dense = load_component(Path(directory) / "dense", **kwargs)
        return cls(sparse, dense, name=manifest["name"])

    def describe(self) -> dict[str, Any]:
        return {"type": TYPE, "kind": self.kind, "name": self.name, "fusion": self.fusion,
                "pool": "union of component top-N", "sparse": self.sparse.describe(),
                "dense": self.dense.describe()}
