"""BM25 lexical retrieval on top of ``bm25s`` (sparse kind).

bm25s precomputes every document's BM25 contribution per term into a sparse matrix, so a
query is a handful of row sums: fast on a CPU, no model, and its own save/load memory-maps the
matrix. Raw BM25 scores are unbounded and non-negative, so relevance uses the paper's arctan
map (``normalize_sparse``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pced.fs import staging_dir
from pced.retrieval.base import BaseRetriever, load_doc_ids, save_doc_ids
from pced.retrieval.scores import normalize_sparse
from pced.retrieval.storage import library_versions, move_files_into, read_manifest, write_manifest

TYPE = "bm25"


def _bm25s():
    """bm25s, quiet: it sets its logger to DEBUG on import, so with a handler on the root logger
    (pced index and eval set one up) every index printed "Building index from IDs objects"."""
    import bm25s

    logging.getLogger("bm25s").setLevel(logging.WARNING)
    return bm25s
_BM25_SUBDIR = "bm25s"


class BM25Retriever(BaseRetriever):
    """Okapi BM25 (bm25s "lucene" variant) over lower-cased words, English stopwords removed."""

    kind = "sparse"

    def __init__(self, k1: float = 1.5, b: float = 0.75, method: str = "lucene",
                 stopwords: str | None = "en", name: str = "bm25") -> None:
        super().__init__()
        self.name = name
        self.k1, self.b, self.method, self.stopwords = k1, b, method, stopwords
        self._bm25: Any = None
        self.progress = False  # bm25s's own bars while indexing (named by bm25s: tokenize, count, score)

    def _tokenize(self, texts: list[str], return_ids: bool) -> Any:
        bm25s = _bm25s()

        return bm25s.tokenize(texts, stopwords=self.stopwords or None, return_ids=return_ids,
                              show_progress=False)

    def _index_texts(self, texts: list[str]) -> None:
        bm25s = _bm25s()

        bm25 = bm25s.BM25(k1=self.k1, b=self.b, method=self.method)
        bars = self.progress and len(texts) >= 1000  # a few documents take no time to show
        tokens = bm25s.tokenize(texts, stopwords=self.stopwords or None, return_ids=True, show_progress=bars)
        bm25.index(tokens, show_progress=bars)
        self._bm25 = bm25

    def scores_many(self, queries: Sequence[str]) -> np.ndarray:
        self._require_index()
        out = np.zeros((len(queries), len(self.doc_ids)), dtype=np.float32)
        for row, tokens in enumerate(self._tokenize(list(queries), return_ids=False)):
            # bm25s rejects queries with no known term; those score 0 everywhere.
            ids = self._bm25.get_tokens_ids(tokens)
            if ids:
                out[row] = self._bm25.get_scores_from_ids(ids)
        return out

    def normalize(self, raw: np.ndarray) -> np.ndarray:
        return normalize_sparse(raw)

    def save(self, directory: str | os.PathLike) -> None:
        """Write the index into ``directory`` (other files there are left alone)."""
        self._require_index()
        directory = Path(directory)
        with staging_dir(directory / _BM25_SUBDIR) as tmp:
            self._bm25.save(str(tmp), show_progress=False)
            move_files_into(tmp, directory / _BM25_SUBDIR)
        save_doc_ids(directory, self.doc_ids)
        write_manifest(directory, TYPE, kind=self.kind, name=self.name, count=len(self),
                       params=self._params(), describe=self.describe())

    @classmethod
    def load(cls, directory: str | os.PathLike, mmap: bool = True) -> BM25Retriever:
        """Open a saved index; the score matrix is memory-mapped unless ``mmap=False``."""
        bm25s = _bm25s()

        manifest = read_manifest(directory, TYPE)
        retriever = cls(name=manifest["name"], **manifest["params"])
        retriever._bm25 = bm25s.BM25.load(str(Path(directory) / _BM25_SUBDIR), mmap=mmap,
                                          show_progress=False)
        retriever.doc_ids = load_doc_ids(directory)
        return retriever

    def _params(self) -> dict[str, Any]:
        return {"k1": self.k1, "b": self.b, "method": self.method, "stopwords": self.stopwords}

    def describe(self) -> dict[str, Any]:
        return {"type": TYPE, "kind": self.kind, "name": self.name, **self._params(),
                "tokenizer": "bm25s.tokenize (lower-case, \\w\\w+ words)",
                "versions": library_versions("bm25s", "numpy")}
