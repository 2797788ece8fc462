"""Building and extending a store (the write path; one writer at a time).

Indexing is incremental and safe to interrupt: KV files are content-addressed and atomic, so a
re-run skips what is stored; retriever indexes are built in a staging folder and swapped in;
documents.jsonl and the manifest are replaced atomically at the end. Opening checks that the
retriever indexes cover exactly the stored documents, so a half-finished run is reported, not used.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from .. import __version__
from ..corpus import chunk_corpus
from ..documents import Document
from ..generator import Generator
from ..fs import TEMP_PREFIX, atomic_write_json, staging_dir, sweep_temporaries, swap_directory
from ..llm import LoadedModel, load_model
from .layout import (DOCUMENTS, FORMAT, MANIFEST, RETRIEVERS_DIR, IndexSettings, StoreError, read_documents, recover,
                     write_documents)
from .lock import LOCK_FILE, writer_lock
from .reader import DocumentStore


def index_store(corpus: list[Document], root: str | os.PathLike, settings: IndexSettings = IndexSettings(),
                llm: LoadedModel | None = None, progress: bool = True,
                encode_kv: bool = True) -> tuple[DocumentStore, dict]:
    """Create or extend the store at ``root`` with ``corpus``; returns the opened store and a report.

    ``encode_kv=False`` builds the retrieval indexes only: a document's KV cache is then
    encoded the first time it is retrieved (content-addressed, so later uses read it).
    For a large corpus of which few documents are ever asked about. One writer at a time: a
    second ``index_store`` on the same ``root`` waits for the first, then extends what it wrote."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise StoreError(f"{root} is not a directory")
    with writer_lock(root):
        return _index_locked(corpus, root, settings, llm, progress, encode_kv)


def remove_documents(root: str | os.PathLike, doc_ids: list[str], llm: LoadedModel | None = None) -> tuple[DocumentStore, dict]:
    """Remove documents (each with its chunks, KV caches and retrieval index entries) from the store
    at ``root``: the indexing path with nothing added, under the same writer lock, so the retrieval
    indexes are rebuilt (dense embeddings of the others reused) and swapped in atomically. Readers
    that opened the store before keep answering from what they loaded. An id the store does not hold
    is a ``StoreError`` before anything changes."""
    root = Path(root)
    if not (root / MANIFEST).is_file():
        raise StoreError(f"{root} is not a pced store (no manifest.json)")
    with writer_lock(root):
        settings = IndexSettings(**json.loads((root / MANIFEST).read_text())["settings"])
        return _index_locked([], root, settings, llm, False, False, remove=list(doc_ids))


def _index_locked(corpus: list[Document], root: Path, settings: IndexSettings, llm: LoadedModel | None,
                  progress: bool, encode_kv: bool, remove: list[str] = ()) -> tuple[DocumentStore, dict]:
    from ..retrieval.compose import build_indexes, describe_indexes

    previous = _previous(root, settings)
    removed = _removed_ids(previous, remove) if remove else set()  # unknown ids fail before any change
    recover(root)
    sweep_temporaries(root)  # a killed run's staging folders and files; this run is the one writer
    llm = llm or load_model(settings.model_path)
    if previous is not None:
        previous.check_model(llm)
    generator = Generator(llm, settings.template, root / "kv", settings.storage_dtype)
    generator.caches.remove_stale_temporaries()
    limit = settings.document_token_limit(llm.max_context)
    corpus, chunked = chunk_corpus(corpus, lambda text: len(generator.builder.encode(text)), limit)
    merged, added, updated = merge_documents(previous.documents if previous else [], corpus)
    merged = [d for d in merged if d.id not in removed]
    if remove and not merged:
        raise StoreError(f"{root}: removing {', '.join(remove)} would leave the store empty; delete the directory instead")
    started = time.perf_counter()
    if encode_kv:
        generator.caches.add([d.render() for d in merged], progress=progress)
    kv_s = time.perf_counter() - started
    started = time.perf_counter()
    base = root / RETRIEVERS_DIR
    with staging_dir(base) as staging:
        reuse = (previous.retriever("dense"), previous.documents) if previous and not settings.bge_m3 else None
        build_indexes(staging, merged, settings.bge_m3, settings.dense_model, reuse)
        swap_directory(staging, base)
    retrieval_s = time.perf_counter() - started
    write_documents(merged, root / DOCUMENTS)
    manifest = {
        "format": FORMAT,
        "pced_version": __version__,
        "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": asdict(settings),
        "model": {"name": llm.name, "path": llm.path, "fingerprint": llm.fingerprint, "tokenizer_hash": llm.tokenizer_hash},
        "template_hash": generator.builder.digest(),
        "documents": len(merged),
        "chunked": sorted(set((previous.manifest.get("chunked", []) if previous else []) + chunked) - set(remove)),
        "retrievers": describe_indexes(base, settings.bge_m3),
    }
    atomic_write_json(root / MANIFEST, manifest)
    # caches of documents the store no longer holds (replaced texts, a killed run's leftovers)
    orphans = generator.caches.remove_unreferenced(generator.caches.digests([d.render() for d in merged]))
    report = {"documents": len(merged), "added": added, "updated": updated, "chunked": chunked,
              "kv_encoded": generator.caches.last_encoded if encode_kv else 0, "kv_s": kv_s, "retrieval_index_s": retrieval_s,
              "kv_orphans_removed": orphans, "removed": sorted(removed)}
    return DocumentStore.open(root, generator=generator), report


def _removed_ids(previous: DocumentStore | None, requested: list[str]) -> set[str]:
    """The stored ids (documents and their chunks) of the requested documents."""
    from .inventory import group_documents

    groups = group_documents(previous.documents if previous else [], set(previous.manifest.get("chunked", [])) if previous else set())
    stored = {d.id for d in previous.documents} if previous else set()
    missing = [i for i in requested if i not in groups and i not in stored]
    if missing:
        raise StoreError(f"no document {', '.join(map(repr, missing))} in the store (pced store list shows the ids)")
    return {d.id for i in requested for d in groups.get(i, [])} | (set(requested) & stored)


def _previous(root: Path, settings: IndexSettings) -> DocumentStore | None:
    """The store already at ``root`` (its settings must match), or None for a new one."""
    if (root / MANIFEST).is_file():
        old = json.loads((root / MANIFEST).read_text())
        if IndexSettings(**old["settings"]).identity() != settings.identity():
            raise StoreError(
                f"{root} was built with {IndexSettings(**old['settings']).identity()}; this run asks for "
                f"{settings.identity()}: use another --out or the same model/retriever settings"
            )
        return DocumentStore(root, old, read_documents(root / DOCUMENTS))
    if root.exists() and any(p for p in root.iterdir() if p.name not in ("kv", RETRIEVERS_DIR, LOCK_FILE)
                             and not p.name.startswith(TEMP_PREFIX)):
        raise StoreError(f"{root} exists and is not a pced store; choose an empty or new --out directory")
    return None


def merge_documents(old: list[Document], new: list[Document]) -> tuple[list[Document], int, int]:
    """Old documents in their order, replaced where an id comes again with new text, then the new ones."""
    incoming = {d.id: d for d in new}
    merged, updated = [], 0
    for d in old:
        if d.id in incoming:
            replacement = incoming.pop(d.id)
            updated += replacement != d
            merged.append(replacement)
        else:
            merged.append(d)
    added = [d for d in new if d.id in incoming]
    return merged + added, len(added), updated
