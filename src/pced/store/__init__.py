"""DocumentStore: one directory holding everything of a corpus.

    manifest.json        models, versions and settings (written last: a store without it is not built)
    documents.jsonl      the documents, in index order
    retrievers/          sparse + dense indexes (BM25 + MiniLM by default, or BGE-M3 with modes)
    kv/                  the per-document KV caches (pced.kv.store)

Two paths: ``reader`` opens, validates and retrieves (many readers at once); ``writer`` indexes,
chunks, merges, encodes and swaps (one writer). ``layout`` is what both agree on.
"""

from .layout import FORMAT, IndexSettings, StoreError


def __getattr__(name: str):
    # the read and write paths load transformers; a command that only needs the settings (argument
    # parsing, refusing bad input) does not wait for it
    if name == "DocumentStore":
        from .reader import DocumentStore

        return DocumentStore
    if name == "index_store":
        from .writer import index_store

        return index_store
    raise AttributeError(f"module 'pced.store' has no attribute {name!r}")


__all__ = ["DocumentStore", "FORMAT", "IndexSettings", "StoreError", "index_store"]
