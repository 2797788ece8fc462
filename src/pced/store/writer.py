"""Building and extending a store (the write path; one writer at a time).

Indexing is incremental and safe to interrupt: KV files are content-addressed and atomic, so a
re-run skips what is stored. The new state (documents.jsonl and the retriever indexes) is built as
a new generation folder and published by replacing manifest.json (``layout``); readers that opened
the previous generation keep reading it. What the new state no longer needs is swept one run
later: the generation before the previous one, and the caches neither the new nor the previous
state references, so no reader of either ever finds a file gone. ``rebuild`` replaces whatever state
the store had (a damaged manifest or document list) with the corpus given, keeping the caches it
still names.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

from .. import __version__
from ..backend import DEFAULT_BACKEND, get_backend
from ..corpus.reader import CHUNK_ID, chunk_corpus
from ..documents import Document
from ..errors import DataError
from ..fs import TEMP_PREFIX, atomic_write_json, staging_dir, sweep_temporaries
from ..kv.budget import GB, gb_to_bytes
from .layout import (DOCUMENTS, FORMAT, GENERATIONS_DIR, MANIFEST, RETRIEVERS_DIR, IndexSettings, StoreError, generation,
                     recover)
from .lock import CACHES_LOCK, LOCK_FILE, writer_lock
from .manifest import read_manifest
from .reader import DocumentStore, current_generation
from .retention import remove_unreferenced, sweep_generations
from .records import read_documents, write_documents

if TYPE_CHECKING:
    from ..llm import LoadedModel

LARGE_CORPUS_BYTES = 2 * GB  # above this estimate of the caches' size, pced index suggests on-demand encoding


def index_store(corpus: list[Document], root: str | os.PathLike, settings: IndexSettings = IndexSettings(),
                llm: LoadedModel | None = None, progress: bool = True, encode_kv: bool = True,
                backend: str = DEFAULT_BACKEND, backend_settings=None,
                rebuild: bool = False) -> tuple[DocumentStore, dict]:
    """Create or extend the store at ``root`` with ``corpus``; returns the opened store and a report.

    ``encode_kv=False`` (or ``settings.lazy_kv``, or a ``settings.kv_budget_gb``) builds the
    retrieval indexes only: a document's KV cache is then encoded the first time it is retrieved
    (content-addressed, so later uses read it), and with a budget the least recently used are
    evicted past it. For a large corpus of which few documents are ever asked about. One writer at
    a time: a second ``index_store`` on the same ``root`` waits for the first, then extends what it
    wrote. A budget set once is kept by later runs that give none.

    ``backend`` (with its ``backend_settings``): whose document caches to encode, into its cache
    directory (``Backend.cache_dir``); documents and retrieval indexes are shared, so one store may
    hold caches for several backends.

    ``rebuild``: the store holds ``corpus`` and nothing else afterwards, whatever its manifest and
    documents.jsonl held or however they are damaged; the caches that still match are kept."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise StoreError(f"{root} is not a directory")
    backend = get_backend(backend)
    with writer_lock(root):
        return _index_locked(corpus, root, settings, llm, progress, encode_kv, backend,
                             backend.settings(backend_settings), rebuild)


def remove_documents(root: str | os.PathLike, doc_ids: list[str], llm: LoadedModel | None = None) -> tuple[DocumentStore, dict]:
    """Remove documents (each with its chunks, KV caches and retrieval index entries) from the store
    at ``root``: the indexing path with nothing added, under the same writer lock, so the retrieval
    indexes are rebuilt (dense embeddings of the others reused) and swapped in atomically. Readers
    that opened the store before keep answering from what they loaded. An id the store does not hold
    is a ``StoreError`` before anything changes."""
    root = Path(root)
    if not os.path.lexists(root / MANIFEST):
        raise StoreError(f"{root} is not a pced store (no manifest.json)")
    with writer_lock(root):
        return _remove_locked(root, list(doc_ids), llm)


def _remove_locked(root: Path, remove: list[str], llm) -> tuple[DocumentStore, dict]:
    """No model is loaded: the documents' records name their cache files in every backend's folder
    (a store written before the records needs its tokenizer for that, still no weights); the dense
    index keeps the other documents' vectors."""
    previous = DocumentStore.open(root)
    removed = _removed_ids(previous, remove)  # unknown ids and chunk ids fail before any change
    merged = [d for d in previous.documents if d.id not in removed]
    if not merged:
        raise StoreError(f"{root}: removing {', '.join(remove)} would leave the store empty; delete the directory instead")
    _sweep_stale(root, previous)
    records = dict(previous.cache_records)
    unrecorded = [d for d in previous.documents if d.id not in records]
    if unrecorded:
        from .inventory import prompt_builder

        records.update(cache_records(prompt_builder(previous), unrecorded, {}, {}))
    number, retrieval_s, swept = _publish(root, previous, merged, previous.settings, previous.manifest["model"],
                                          previous.manifest.get("template_hash"), records, False,
                                          previous.manifest.get("kv_bytes_per_token"))
    orphans = remove_unreferenced(root, {records[d.id][0] for d in merged})
    report = {"documents": len(merged), "added": 0, "updated": 0, "chunked": [], "chunks_replaced": 0,
              "generation": number, "generations_swept": swept, "kv_encoded": 0, "kv_s": 0.0,
              "retrieval_index_s": retrieval_s, "kv_orphans_removed": orphans, "kv_evicted": 0, "estimate": None,
              "on_demand": previous.settings.on_demand, "removed": sorted(removed)}
    return DocumentStore.open(root, llm), report


def _index_locked(corpus: list[Document], root: Path, settings: IndexSettings, llm: LoadedModel | None,
                  progress: bool, encode_kv: bool, backend, backend_settings,
                  rebuild: bool) -> tuple[DocumentStore, dict]:
    from ..generator import Generator

    reserved = [d.id for d in corpus if not d.source and CHUNK_ID.search(d.id)]
    if reserved:
        raise StoreError(f"document id {reserved[0]!r} ends in '#chunk-<n>', which pced reserves for chunks; rename it")
    previous = _previous(root, settings, rebuild)
    if previous is not None and settings.kv_budget_gb is None:
        settings = replace(settings, kv_budget_gb=previous.settings.kv_budget_gb)
    settings = replace(settings, lazy_kv=settings.lazy_kv or not encode_kv)
    _sweep_stale(root, previous)
    llm = llm or backend.load_model(settings.model_path, backend_settings)
    generator = Generator(llm, settings.template, backend.cache_dir(root, backend_settings), settings.storage_dtype,
                          budget_bytes=gb_to_bytes(settings.kv_budget_gb), on_demand=settings.on_demand,
                          recorded_model_path=previous.manifest["model"].get("path") if previous else None,
                          backend=backend, settings=backend_settings)
    if previous is not None:
        previous.check_model(llm)
    generator.caches.remove_stale_temporaries()
    limit = settings.document_token_limit(llm.max_context)
    count_tokens = token_counter(generator.builder, [d.render() for d in corpus], progress)
    corpus, chunked = chunk_corpus(corpus, count_tokens, limit)
    merged, added, updated, replaced = merge_documents(previous.documents if previous else [], corpus)
    # a backend whose cache size is known only once a document is encoded has no estimate (Backend.cache_estimate)
    estimate = backend.cache_estimate(llm, settings.storage_dtype, [count_tokens(d.render()) for d in corpus])
    if progress and estimate is not None:
        print(describe_estimate(estimate, settings, len(corpus)), file=sys.stderr, flush=True)
    started = time.perf_counter()
    if not settings.on_demand:
        generator.caches.add([d.render() for d in merged], progress=progress)
    kv_s = time.perf_counter() - started
    old = {d.id: d for d in previous.documents} if previous else {}
    records = cache_records(generator.builder, merged, previous.cache_records if previous else {}, old)
    number, retrieval_s, swept = _publish(root, previous, merged, settings, llm.model_record(), generator.builder.digest(),
                                          records, progress, estimate["bytes_per_token"] if estimate else None)
    # caches of documents neither this state nor the previous one holds (a reader may still use the previous)
    keep = [d.render() for d in merged] + ([d.render() for d in previous.documents] if previous else [])
    orphans = remove_unreferenced(root, set(generator.caches.digests(keep)))
    evicted = generator.caches.budget.record(protect=()) if settings.kv_budget_gb is not None else 0
    report = {"documents": len(merged), "added": added, "updated": updated, "chunked": chunked,
              "chunks_replaced": replaced, "generation": number, "generations_swept": swept,
              "kv_encoded": 0 if settings.on_demand else generator.caches.last_encoded, "kv_s": kv_s,
              "retrieval_index_s": retrieval_s, "kv_orphans_removed": orphans, "kv_evicted": evicted,
              "estimate": estimate, "on_demand": settings.on_demand, "removed": []}
    return DocumentStore.open(root, generator=generator), report


def _sweep_stale(root: Path, previous: DocumentStore | None) -> None:
    """What killed runs left: a half swap of a store written before generations, staging folders
    and temporary files (this run is the one writer)."""
    if previous is None or not previous.generation:
        recover(root)
    sweep_temporaries(root)
    sweep_temporaries(root / GENERATIONS_DIR)


def cache_records(builder, documents: list[Document], known: dict, old: dict) -> dict[str, tuple[str, int]]:
    """id -> (content hash naming its cache files, tokens they hold) of ``documents``: ``known``
    (the previous generation's records) for those unchanged since (``old``: id -> its previous
    document), from ``builder`` for the others."""
    from ..kv.format import content_hash

    records = {}
    for d in documents:
        if d.id in known and old.get(d.id) == d:
            records[d.id] = known[d.id]
        else:
            context = builder.context_text([d.render()])
            records[d.id] = (content_hash(context), len(builder.encode(context)))
    return records


def _publish(root: Path, previous: DocumentStore | None, merged: list[Document], settings: IndexSettings,
             model_record: dict, template_hash: str | None, records: dict, progress: bool,
             kv_bytes_per_token) -> tuple[int, float, int]:
    """Build the next generation (retrieval indexes, documents.jsonl with the cache records), then
    publish it by replacing manifest.json, and sweep the generations no reader can use. Returns the
    generation's number, the seconds its indexes took and how many generations were swept."""
    from ..retrieval.compose import build_indexes, describe_indexes

    started = time.perf_counter()
    # a new or rebuilt store numbers past every folder, so that no reader's generation is reused
    number = generation(previous.manifest) + 1 if previous else 1 + max(_generation_folders(root), default=0)
    target = root / GENERATIONS_DIR / str(number)
    if target.exists():  # a killed run got this far; no manifest names it, so no reader uses it
        shutil.rmtree(target)
    with staging_dir(target) as staging:
        (staging / RETRIEVERS_DIR).mkdir()
        reuse = None
        if previous and not settings.bge_m3:
            try:
                reuse = (previous.retriever("dense"), previous.documents)
            except (DataError, OSError):  # a damaged dense index is built again, not reused
                reuse = None
        build_indexes(staging / RETRIEVERS_DIR, merged, settings.bge_m3, settings.dense_model, reuse, progress=progress)
        write_documents(merged, staging / DOCUMENTS, records)
        os.replace(staging, target)
    retrieval_s = time.perf_counter() - started
    manifest = {
        "format": FORMAT,
        "generation": number,
        "pced_version": __version__,
        "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": asdict(settings),
        "model": model_record,
        "template_hash": template_hash,
        "documents": len(merged),
        "chunked": sorted({d.source for d in merged if d.source}),
        "retrievers": describe_indexes(target / RETRIEVERS_DIR, settings.bge_m3),
        "kv_bytes_per_token": kv_bytes_per_token,
    }
    replaced = generation(previous.manifest) if previous else current_generation(root)
    atomic_write_json(root / MANIFEST, manifest)  # readers switch to the new generation here
    swept = sweep_generations(root, keep={number, number if replaced is None else replaced})
    return number, retrieval_s, swept


def token_counter(builder, texts: list[str], progress: bool):
    """``count_tokens(text)`` for chunking and the size estimate, each text tokenized once: the
    corpus's texts are counted first, under a progress bar (the first long phase of a large corpus)."""
    from tqdm.auto import tqdm

    counts: dict[str, int] = {}
    for text in tqdm(texts, desc="counting document tokens", unit="doc", disable=not progress or len(texts) < 1000,
                     mininterval=1.0):
        if text not in counts:
            counts[text] = len(builder.encode(text))

    def count_tokens(text: str) -> int:
        if text not in counts:
            counts[text] = len(builder.encode(text))
        return counts[text]

    return count_tokens


def describe_estimate(estimate: dict, settings: IndexSettings, documents: int) -> str:
    """The line ``pced index`` prints before it starts: what the caches will take, and what to do about it."""
    size = estimate["bytes"] / GB
    line = (f"pced: KV caches take {estimate['bytes_per_token'] / 1024:.1f} KiB per document token with this model "
            f"({settings.storage_dtype}): about {size:.2f} GiB for these {documents} documents "
            f"({estimate['tokens']} tokens)")
    if settings.kv_budget_gb is not None:
        return line + f"; encoded when first retrieved, kept within {settings.kv_budget_gb:g} GiB"
    if settings.on_demand:
        return line + "; encoded when first retrieved (--lazy-kv)"
    if estimate["bytes"] > LARGE_CORPUS_BYTES:
        return line + ("; to encode each document when it is first retrieved instead, and bound the disk used, "
                       "index with --kv-budget-gb GIB (or --lazy-kv)")
    return line


def _generation_folders(root: Path) -> list[int]:
    folder = root / GENERATIONS_DIR
    return [int(p.name) for p in folder.iterdir() if p.name.isdigit()] if folder.is_dir() else []


def _removed_ids(previous: DocumentStore | None, requested: list[str]) -> set[str]:
    """The stored ids (a document, or all its chunks) of the requested documents. A chunk's own id
    is refused: a document goes with all its chunks, never one of them (it would be left incomplete)."""
    from .inventory import group_documents

    documents = previous.documents if previous else []
    groups, stored = group_documents(documents), {d.id: d for d in documents}
    for doc_id in requested:
        if doc_id not in groups and doc_id in stored:
            owner = stored[doc_id].source
            raise StoreError(f"{doc_id!r} is a chunk of document {owner!r}; a document is removed with all its chunks: "
                             f"pced store remove STORE {owner!r}")
    missing = [i for i in requested if i not in groups]
    if missing:
        raise StoreError(f"no document {', '.join(map(repr, missing))} in the store (pced store list shows the ids)")
    return {d.id for i in requested for d in groups[i]}


def _previous(root: Path, settings: IndexSettings, rebuild: bool = False) -> DocumentStore | None:
    """The store already at ``root`` (its settings must match), or None for a new one or a rebuild.
    Its manifest and documents are read the way every command reads them (``read_manifest``,
    ``read_documents``): damage is one line naming the file, before anything is written."""
    if os.path.lexists(root / MANIFEST):
        if rebuild:
            return None
        old = read_manifest(root)
        if IndexSettings(**old["settings"]).identity() != settings.identity():
            raise StoreError(
                f"{root} was built with {IndexSettings(**old['settings']).identity()}; this run asks for "
                f"{settings.identity()}: use another --out or the same model/retriever settings"
            )
        records: dict = {}
        documents = read_documents(root, old, records)
        return DocumentStore(root, old, documents, cache_records=records)
    ours = ("kv", RETRIEVERS_DIR, GENERATIONS_DIR, LOCK_FILE, CACHES_LOCK)
    if root.exists() and any(p for p in root.iterdir() if p.name not in ours and not p.name.startswith(TEMP_PREFIX)):
        raise StoreError(f"{root} exists and is not a pced store; choose an empty or new --out directory")
    return None


def merge_documents(old: list[Document], new: list[Document]) -> tuple[list[Document], int, int, int]:
    """Old documents in their order, each one indexed again replaced with all its chunks (a document
    owns its chunks: none of the old ones survive), then the new ones. Returns the merged list and
    how many documents were added and updated, and how many old chunks were replaced."""
    incoming: dict[str, list[Document]] = {}
    for d in new:
        incoming.setdefault(d.owner, []).append(d)
    merged, updated, replaced, placed = [], 0, 0, set()
    old_groups: dict[str, list[Document]] = {}
    for d in old:
        old_groups.setdefault(d.owner, []).append(d)
    for d in old:
        owner = d.owner
        if owner not in incoming:
            merged.append(d)
        elif owner not in placed:
            placed.add(owner)
            updated += incoming[owner] != old_groups[owner]
            replaced += sum(1 for c in old_groups[owner] if c.source)
            merged.extend(incoming[owner])
    added = [owner for owner in incoming if owner not in placed]
    return merged + [d for owner in added for d in incoming[owner]], len(added), updated, replaced
