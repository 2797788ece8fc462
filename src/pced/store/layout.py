"""What the store's reader and writer agree on: the format, the settings, the documents file, and
where one generation of the store's state lives.

A store's state (documents.jsonl and the retriever indexes) is written as a new, complete
generation ``generations/<n>/`` that is never changed afterwards; ``manifest.json``, replaced
atomically last, names the generation readers use. A reader reads the manifest once and then only
files of that generation, so it sees the old state or the new one, never a mix. Stores written
before generations keep their state at the top level (generation 0) until their next index run.
The manifest is read and checked by ``manifest``, documents.jsonl by ``records``.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import DataError
from ..fs import recover_directory
from ..options import DEFAULT_STORAGE_DTYPE, EMBEDDED, is_embedded

FORMAT = 1
MANIFEST = "manifest.json"
DOCUMENTS = "documents.jsonl"
RETRIEVERS_DIR = "retrievers"
GENERATIONS_DIR = "generations"
LEGACY_CHUNK = re.compile(r"^(.*)#(\d+)$")  # chunk ids before they were reserved ("id#3")


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
    kv_budget_gb: float | None = None  # keep the KV caches within this size (LRU; encoded on demand); None: all
    lazy_kv: bool = False  # KV caches encoded when a document is first retrieved (implied by a budget)

    def identity(self) -> dict:
        """The fields an existing store must share (chunk size, reranker, the model's folder and the
        cache policy may change; the model's identity is checked by fingerprint)."""
        return {k: v for k, v in asdict(self).items()
                if k not in ("reranker", "max_doc_tokens", "kv_budget_gb", "lazy_kv", "model")}

    @property
    def on_demand(self) -> bool:
        return self.lazy_kv or self.kv_budget_gb is not None

    def document_token_limit(self, max_context: int | None) -> int:
        """Tokens one document (or chunk) may have: ``max_doc_tokens``, and room in the window for
        the prefix, the question and an answer."""
        return min(self.max_doc_tokens, max(64, (max_context or 10**9) - 512))

    @property
    def model_path(self) -> str | None:
        """The ``load_model`` argument: None for the embedded model."""
        return None if is_embedded(self.model) else self.model


def generation(manifest: dict) -> int:
    """The generation a manifest names (checked to be a whole number: ``manifest.check_manifest``)."""
    return manifest.get("generation", 0)


def state_dir(root: Path, manifest: dict) -> Path:
    """Where the manifest's generation keeps documents.jsonl and the retriever indexes."""
    n = generation(manifest)
    return root / GENERATIONS_DIR / str(n) if n else root


def legacy_chunked(manifest: dict) -> list[str]:
    """The owners of chunks a store wrote before chunks recorded their source (generation 0 only)."""
    return [] if generation(manifest) else list(manifest.get("chunked", []))


def recover(root: Path) -> None:
    """Undo a retriever swap that a killed index run interrupted (safe for readers)."""
    recover_directory(root / RETRIEVERS_DIR)
