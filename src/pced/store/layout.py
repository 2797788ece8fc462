"""What the store's reader and writer agree on: the format, the settings, the documents file."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..documents import Document
from ..errors import DataError
from ..fs import atomic_write_lines, recover_directory
from ..options import DEFAULT_STORAGE_DTYPE, EMBEDDED, is_embedded

FORMAT = 1
MANIFEST = "manifest.json"
DOCUMENTS = "documents.jsonl"
RETRIEVERS_DIR = "retrievers"


class StoreError(DataError):
    """A store that cannot be opened or extended as asked (reported as one line)."""

    code = "damaged_store"


@dataclass
class IndexSettings:
    """What a store is built with; changing any of these needs a new store."""

    model: str = EMBEDDED
    dense_model: str | None = None  # sentence-transformers path (default: packaged MiniLM)
    bge_m3: str | None = None  # local BGE-M3: replaces BM25/MiniLM with its sparse/dense/ColBERT modes
    reranker: str | None = None  # local cross-encoder / bge-reranker path, applied at ask time
    template: str = "rag"
    storage_dtype: str = DEFAULT_STORAGE_DTYPE
    max_doc_tokens: int = 1024

    def identity(self) -> dict:
        """The fields an existing store must share (max_doc_tokens and reranker may change)."""
        return {k: v for k, v in asdict(self).items() if k not in ("reranker", "max_doc_tokens")}

    def document_token_limit(self, max_context: int | None) -> int:
        """Tokens one document (or chunk) may have: ``max_doc_tokens``, and room in the window for
        the prefix, the question and an answer."""
        return min(self.max_doc_tokens, max(64, (max_context or 10**9) - 512))

    @property
    def model_path(self) -> str | None:
        """The ``load_model`` argument: None for the embedded model."""
        return None if is_embedded(self.model) else self.model


def write_documents(documents: list[Document], path: Path) -> None:
    atomic_write_lines(path, (json.dumps({"id": d.id, "title": d.title, "text": d.text}, ensure_ascii=False) + "\n"
                              for d in documents))


def read_documents(path: Path) -> list[Document]:
    with open(path, encoding="utf-8") as handle:
        return [Document(r["id"], r["text"], r.get("title", "")) for r in map(json.loads, handle) if r]


def recover(root: Path) -> None:
    """Undo a retriever swap that a killed index run interrupted (safe for readers)."""
    recover_directory(root / RETRIEVERS_DIR)
