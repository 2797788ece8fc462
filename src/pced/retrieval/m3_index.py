"""Corpus indexes over BGE-M3's three scoring modes (the paper's Sparse / Dense / ColBERT).

One encoder pass fills every requested mode; ``mode`` picks which one ranks, and the others ride
along in each ``Hit.parts`` so all three relevance signals of the paper are available for the
same candidates (``with_mode`` switches the ranking mode without re-encoding). On disk:

* dense: ``m3_dense.npy`` ``[docs, hidden]`` float32;
* sparse: CSR arrays ``m3_sparse_indptr.npy`` / ``_ids.npy`` / ``_weights.npy``;
* colbert: all token vectors ``m3_colbert_vecs.npy`` ``[tokens, dim]`` (float16 by default,
  as FlagEmbedding computes them in fp16 on GPU; a float32 copy would double the largest file)
  plus ``m3_colbert_offsets.npy`` marking where each document's vectors start.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError
from pced.retrieval._local_models import local_model_dir
from pced.retrieval.base import (
    DEFAULT_TOP_N,
    QUERY_CHUNK,
    BaseRetriever,
    Hit,
    load_doc_ids,
    save_doc_ids,
    top_indices,
)
from pced.retrieval.bge_m3 import COLBERT_HEAD, MODES, SPARSE_HEAD, BGEM3Encoder, M3Embeddings
from pced.retrieval.scores import normalize_dense, normalize_sparse
from pced.retrieval.storage import (
    library_versions,
    load_array,
    model_fingerprint,
    read_manifest,
    save_array,
    write_manifest,
)

TYPE = "bge-m3"
_COLBERT_CHUNK_TOKENS = 32768  # document vectors scored at once: bounds the temporary sim matrix


class BGEM3Retriever(BaseRetriever):
    """BGE-M3 retrieval from a local checkpoint directory, ranking by ``mode``."""

    def __init__(self, model_path: str | os.PathLike, mode: str = "dense",
                 modes: Sequence[str] | None = None, name: str | None = None, device: str = "cpu",
                 dtype: Any = None, batch_size: int = 16, max_length: int = 512,
                 query_max_length: int = 512, colbert_dtype: str = "float16") -> None:
        super().__init__()
        self.modes = tuple(dict.fromkeys(modes or (mode,)))
        if mode not in self.modes or not set(self.modes) <= set(MODES):
            raise UserError(f"mode {mode!r} must be one of modes {self.modes} (subset of {MODES})")
        self.mode = mode
        self.kind = mode  # "dense" | "sparse" | "colbert"
        self.name = name or f"bge-m3-{mode}"
        self.model_path = str(local_model_dir(model_path))
        self.encoder_args = {"device": device, "dtype": dtype, "batch_size": batch_size,
                             "max_length": max_length, "query_max_length": query_max_length}
        self.colbert_dtype = colbert_dtype
        self.arrays: dict[str, np.ndarray] = {}
        self._encoder: BGEM3Encoder | None = None
        self._sparse_doc_of: np.ndarray | None = None

    @property
    def encoder(self) -> BGEM3Encoder:
        if self._encoder is None:
            self._encoder = BGEM3Encoder(self.model_path, **self.encoder_args)
        return self._encoder

    def with_mode(self, mode: str) -> BGEM3Retriever:
        """The same index (shared arrays and model) ranking by another stored mode."""
        if mode not in self.modes:
            raise UserError(f"mode {mode!r} was not indexed (indexed: {self.modes})")
        other = copy.copy(self)
        other.mode, other.kind, other.name = mode, mode, f"bge-m3-{mode}"
        return other

    # -- indexing -------------------------------------------------------------------------
    def _index_texts(self, texts: list[str]) -> None:
        emb = self.encoder.encode(texts, self.modes)
        arrays: dict[str, np.ndarray] = {}
        if emb.dense is not None:
            arrays["dense"] = emb.dense
        if emb.lexical is not None:
            lengths = [len(d) for d in emb.lexical]
            arrays["sparse_indptr"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            arrays["sparse_ids"] = np.array([t for d in emb.lexical for t in sorted(d)], dtype=np.int64)
            arrays["sparse_weights"] = np.array([d[t] for d in emb.lexical for t in sorted(d)],
                                                dtype=np.float32)
        if emb.colbert is not None:
            lengths = [len(c) for c in emb.colbert]
            arrays["colbert_offsets"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            arrays["colbert_vecs"] = np.concatenate(emb.colbert).astype(self.colbert_dtype)
        self.arrays = arrays
        self._sparse_doc_of = None

    # -- scoring --------------------------------------------------------------------------
    def mode_scores(self, queries: Sequence[str]) -> dict[str, np.ndarray]:
        """Raw scores ``[queries, docs]`` for every indexed mode, from one query encoding."""
        self._require_index()
        q = self.encoder.encode_queries(list(queries), self.modes)
        return {mode: self._score_mode(mode, q) for mode in self.modes}

    def scores_many(self, queries: Sequence[str]) -> np.ndarray:
        self._require_index()
        return self._score_mode(self.mode, self.encoder.encode_queries(list(queries), (self.mode,)))

    def _score_mode(self, mode: str, q: M3Embeddings) -> np.ndarray:
        if mode == "dense":
            return q.dense @ np.asarray(self.arrays["dense"]).T
        if mode == "sparse":
            return np.stack([self._sparse_scores(lw) for lw in q.lexical])
        return np.stack([self._colbert_scores(vecs) for vecs in q.colbert])

    def _sparse_scores(self, query: dict[int, float]) -> np.ndarray:
        """Lexical matching score of one query against every document (vectorised CSR)."""
        indptr, ids = self.arrays["sparse_indptr"], np.asarray(self.arrays["sparse_ids"])
        n_docs = len(indptr) - 1
        if not query or len(ids) == 0:
            return np.zeros(n_docs, dtype=np.float32)
        if self._sparse_doc_of is None:
            self._sparse_doc_of = np.repeat(np.arange(n_docs), np.diff(indptr))
        q_ids = np.array(sorted(query), dtype=np.int64)
        q_w = np.array([query[t] for t in q_ids], dtype=np.float32)
        pos = np.minimum(np.searchsorted(q_ids, ids), len(q_ids) - 1)
        contrib = np.where(q_ids[pos] == ids, q_w[pos] * np.asarray(self.arrays["sparse_weights"]), 0.0)
        return np.bincount(self._sparse_doc_of, weights=contrib, minlength=n_docs).astype(np.float32)

    def _colbert_scores(self, query_vecs: np.ndarray) -> np.ndarray:
        """Mean-over-query-vectors of max-sim against every document, in bounded chunks."""
        offsets, vecs = self.arrays["colbert_offsets"], self.arrays["colbert_vecs"]
        n_docs = len(offsets) - 1
        out = np.empty(n_docs, dtype=np.float32)
        q = np.asarray(query_vecs, dtype=np.float32).T
        start = 0
        while start < n_docs:
            limit = np.searchsorted(offsets, offsets[start] + _COLBERT_CHUNK_TOKENS, side="right") - 1
            end = min(max(limit, start + 1), n_docs)
            sims = np.asarray(vecs[offsets[start] : offsets[end]], dtype=np.float32) @ q
            best = np.maximum.reduceat(sims, offsets[start:end] - offsets[start], axis=0)
            out[start:end] = best.mean(axis=1)
            start = end
        return out

    def normalize(self, raw: np.ndarray) -> np.ndarray:
        return normalize_sparse(raw) if self.mode == "sparse" else normalize_dense(raw)

    def search_many(self, queries: Sequence[str], top_n: int = DEFAULT_TOP_N) -> list[list[Hit]]:
        """Rank by ``mode``; every hit also carries the raw score of each other indexed mode."""
        self._require_index()
        queries, results = list(queries), []
        for start in range(0, len(queries), QUERY_CHUNK):
            by_mode = self.mode_scores(queries[start : start + QUERY_CHUNK])
            for row, raw in enumerate(by_mode[self.mode]):
                idx = top_indices(raw, top_n)
                rel = self.normalize(raw[idx].astype(np.float64))
                results.append([
                    Hit(int(i), self.doc_ids[int(i)], float(raw[i]), float(r),
                        {f"bge-m3-{m}": float(by_mode[m][row, i]) for m in self.modes})
                    for i, r in zip(idx, rel, strict=True)])
        return results

    # -- persistence ----------------------------------------------------------------------
    def save(self, directory: str | os.PathLike) -> None:
        """Write the arrays, ids and manifest into ``directory`` (other files are left alone)."""
        self._require_index()
        for key, array in self.arrays.items():
            save_array(Path(directory) / f"m3_{key}.npy", array)
        save_doc_ids(directory, self.doc_ids)
        write_manifest(directory, TYPE, kind=self.kind, name=self.name, count=len(self),
                       params=self._params(), arrays=sorted(self.arrays), describe=self.describe())

    @classmethod
    def load(cls, directory: str | os.PathLike, model_path: str | os.PathLike | None = None,
             mode: str | None = None, device: str = "cpu", mmap: bool = True) -> BGEM3Retriever:
        """Open a saved index (arrays memory-mapped); ``mode`` may pick another indexed mode."""
        manifest = read_manifest(directory, TYPE)
        params = dict(manifest["params"], device=device)
        if model_path is not None:
            params["model_path"] = model_path
        if mode is not None and mode != params["mode"]:
            params["mode"] = mode
        else:
            params["name"] = manifest["name"]  # keep a custom name; another mode gets its own
        retriever = cls(**params)
        retriever.arrays = {key: load_array(Path(directory) / f"m3_{key}.npy", mmap=mmap)
                            for key in manifest["arrays"]}
        retriever.doc_ids = load_doc_ids(directory)
        return retriever

    def _params(self) -> dict[str, Any]:
        args = {k: v for k, v in self.encoder_args.items() if k not in ("device", "dtype")}
        return {"model_path": self.model_path, "mode": self.mode, "modes": list(self.modes),
                "colbert_dtype": self.colbert_dtype, **args}

    def describe(self) -> dict[str, Any]:
        """Index settings and model identity, without loading the model."""
        model_dir = Path(self.model_path)
        heads = {stem: any((model_dir / f"{stem}{ext}").is_file() for ext in (".safetensors", ".pt"))
                 for stem in (COLBERT_HEAD, SPARSE_HEAD)}
        return {"type": TYPE, "kind": self.kind, "name": self.name, "modes": list(self.modes),
                "model": self.model_path, "fingerprint": model_fingerprint(model_dir),
                "heads": heads, "colbert_dtype": self.colbert_dtype,
                "max_length": self.encoder_args["max_length"],
                "query_max_length": self.encoder_args["query_max_length"],
                "versions": library_versions("transformers", "torch", "tokenizers")}
