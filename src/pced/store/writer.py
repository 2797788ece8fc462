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
                encode_kv: bool = True, llamacpp=None) -> tuple[DocumentStore, dict]:
    """Create or extend the store at ``root`` with ``corpus``; returns the opened store and a report.

    ``encode_kv=False`` builds the retrieval indexes only: a document's KV cache is then
    encoded the first time it is retrieved (content-addressed, so later uses read it).
    For a large corpus of which few documents are ever asked about. One writer at a time: a
    second ``index_store`` on the same ``root`` waits for the first, then extends what it wrote.

    ``llamacpp`` (a ``LlamaSettings``): encode llama.cpp sequence states of the GGUF model instead
    of transformers caches (``STORE/llamacpp-<cache type>/`` beside ``kv/``; documents and retrieval
    indexes are shared, so one store may hold caches for both backends)."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise StoreError(f"{root} is not a directory")
    with writer_lock(root):
        return _index_locked(corpus, root, settings, llm, progress, encode_kv, llamacpp)


def _open_generator(root: Path, settings: IndexSettings, llm, llamacpp):
    """The model and cache writer of the backend that indexes: transformers, or llama.cpp's states."""
    if llamacpp is None:
        llm = llm or load_model(settings.model_path)
        return llm, Generator(llm, settings.template, root / "kv", settings.storage_dtype)
    from ..backends.llamacpp.generator import LlamaGenerator
    from ..backends.llamacpp.model import LlamaModel
    from ..backends.llamacpp.states import states_dir

    llm = llm or LlamaModel(settings.model_path, llamacpp)
    return llm, LlamaGenerator(llm, settings.template, states_dir(root, llamacpp.cache_type), llamacpp)


def _index_locked(corpus: list[Document], root: Path, settings: IndexSettings, llm: LoadedModel | None,
                  progress: bool, encode_kv: bool, llamacpp=None) -> tuple[DocumentStore, dict]:
    from ..retrieval.compose import build_indexes, describe_indexes

    previous = _previous(root, settings)
    recover(root)
    sweep_temporaries(root)  # a killed run's staging folders and files; this run is the one writer
    llm, generator = _open_generator(root, settings, llm, llamacpp)
    if previous is not None:
        previous.check_model(llm)
    generator.caches.remove_stale_temporaries()
    limit = settings.document_token_limit(llm.max_context)
    corpus, chunked = chunk_corpus(corpus, lambda text: len(generator.builder.encode(text)), limit)
    merged, added, updated = merge_documents(previous.documents if previous else [], corpus)
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
        "model": {"name": llm.name, "path": llm.path, "fingerprint": llm.fingerprint, "tokenizer_hash": llm.tokenizer_hash,
                  "backend": getattr(llm, "backend", "transformers")},
        "template_hash": generator.builder.digest(),
        "documents": len(merged),
        "chunked": sorted(set((previous.manifest.get("chunked", []) if previous else []) + chunked)),
        "retrievers": describe_indexes(base, settings.bge_m3),
    }
    atomic_write_json(root / MANIFEST, manifest)
    # caches of documents the store no longer holds (replaced texts, a killed run's leftovers)
    orphans = generator.caches.remove_unreferenced(generator.caches.digests([d.render() for d in merged]))
    report = {"documents": len(merged), "added": added, "updated": updated, "chunked": chunked,
              "kv_encoded": generator.caches.last_encoded if encode_kv else 0, "kv_s": kv_s, "retrieval_index_s": retrieval_s,
              "kv_orphans_removed": orphans}
    if llamacpp is None:
        return DocumentStore.open(root, generator=generator), report
    store = DocumentStore.open(root)
    store._llama = (llamacpp, generator)
    return store, report


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
