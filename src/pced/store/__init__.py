"""DocumentStore: one directory holding everything of a corpus.

    manifest.json        models, versions and settings (written last: a store without it is not built)
    documents.jsonl      the documents, in index order
    retrievers/          sparse + dense indexes (BM25 + MiniLM by default, or BGE-M3 with modes)
    kv/                  the per-document KV caches (pced.kv.store)

Two paths: ``reader`` opens, validates and retrieves (many readers at once); ``writer`` indexes,
chunks, merges, encodes and swaps (one writer). ``layout`` is what both agree on.
"""

from .layout import FORMAT, IndexSettings, StoreError
from .reader import DocumentStore
from .writer import index_store, remove_documents

__all__ = ["DocumentStore", "FORMAT", "IndexSettings", "StoreError", "index_store", "remove_documents"]
