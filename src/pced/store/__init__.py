"""DocumentStore: one directory holding everything of a corpus.

    manifest.json        models, versions and settings (written last: a store without it is not built)
    documents.jsonl      the documents, in index order
    retrievers/          sparse + dense indexes (BM25 + MiniLM by default, or BGE-M3 with modes)
    kv/                  the per-document KV caches (pced.kv.store)

Two paths: ``reader`` opens, validates and retrieves (many readers at once); ``writer`` indexes,
chunks, merges, encodes and swaps (one writer). ``layout`` is what both agree on.
"""

from .layout import FORMAT, IndexSettings, StoreError

_LAZY = {"DocumentStore": "reader", "index_store": "writer", "remove_documents": "writer"}  # the model stack loads only when a store is used


def __getattr__(name: str):
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["DocumentStore", "FORMAT", "IndexSettings", "StoreError", "index_store", "remove_documents"]
