"""What the store's reader and writer agree on: the format, the settings, the documents file, and
where one generation of the store's state lives.

A store's state (documents.jsonl and the retriever indexes) is written as a new, complete
generation ``generations/<n>/`` that is never changed afterwards; ``manifest.json``, replaced
atomically last, names the generation readers use. A reader reads the manifest once and then only
files of that generation, so it sees the old state or the new one, never a mix. Stores written
before generations keep their state at the top level (generation 0) until their next index run.
"""

from __future__ import annotations

import json
import re
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
    return int(manifest.get("generation", 0))


def state_dir(root: Path, manifest: dict) -> Path:
    """Where the manifest's generation keeps documents.jsonl and the retriever indexes."""
    n = generation(manifest)
    return root / GENERATIONS_DIR / str(n) if n else root


def legacy_chunked(manifest: dict) -> list[str]:
    """The owners of chunks a store wrote before chunks recorded their source (generation 0 only)."""
    return [] if generation(manifest) else list(manifest.get("chunked", []))


def write_documents(documents: list[Document], path: Path, caches: dict[str, tuple[str, int]] | None = None) -> None:
    """documents.jsonl; ``caches`` (id -> (content hash, tokens)) records what names each document's
    cache files and how many tokens they hold, so that the store's metadata commands read them
    without a tokenizer."""
    caches = caches or {}

    def record(d: Document) -> dict:
        cache = {"cache": caches[d.id][0], "tokens": caches[d.id][1]} if d.id in caches else {}
        return {"id": d.id, "title": d.title, "text": d.text, **({"source": d.source} if d.source else {}), **cache}

    atomic_write_lines(path, (json.dumps(record(d), ensure_ascii=False) + "\n" for d in documents))


def read_documents(path: Path, chunked: list[str] = (), caches: dict | None = None) -> list[Document]:
    """The documents of a store; ``chunked`` (the manifest's list) names the owners of chunks
    written before chunks recorded their source ("id#3"); ``caches``, when given, is filled with the
    recorded (content hash, tokens) of each document that has them. A line that is not a whole
    record (a file cut short, edited by hand) is a ``StoreError`` naming the file and the line."""
    chunked = set(chunked)

    def source(record: dict) -> str:
        if "source" in record:
            return record["source"]
        legacy = LEGACY_CHUNK.match(record["id"])
        return legacy.group(1) if legacy and legacy.group(1) in chunked else ""

    documents = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                documents.append(Document(str(record["id"]), str(record["text"]), str(record.get("title") or ""),
                                          str(source(record))))
                if caches is not None and "cache" in record:
                    caches[documents[-1].id] = (str(record["cache"]), int(record["tokens"]))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                what = f"missing field {exc}" if isinstance(exc, KeyError) else getattr(exc, "msg", None) or str(exc)
                raise StoreError(f"{path}:{number}: not a whole document record ({what}): the file is damaged or cut "
                                 "short; re-run pced index") from None
    return documents


def recover(root: Path) -> None:
    """Undo a retriever swap that a killed index run interrupted (safe for readers)."""
    recover_directory(root / RETRIEVERS_DIR)
