"""What a store holds, read without loading the model: documents (with their chunks), tokens, the
state of each document's caches (every backend's: ``pced.backend``), and bytes by part (text,
retrieval, caches). ``pced store list / show / stats`` print these; removing goes through the
writer (``pced.store.writer.remove_documents``).

A document longer than the store's ``max_doc_tokens`` is stored as chunks, each recording the
document it was split from (``Document.source``, written in documents.jsonl): the chunk relation is
read from that record, never inferred from how an id is spelled, so a document of the user's whose
id looks like a chunk's (``report#1`` beside a chunked ``report``) is a document of its own.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..documents import Document
from .layout import DOCUMENTS, MANIFEST, RETRIEVERS_DIR, state_dir

def group_documents(documents: list[Document]) -> dict[str, list[Document]]:
    """Owner id -> its stored documents (one, or its chunks in order), in store order."""
    groups: dict[str, list[Document]] = {}
    for document in documents:
        groups.setdefault(document.owner, []).append(document)
    return groups


def cache_directories(root: Path) -> list[tuple[object, Path]]:
    """(backend, directory) of every backend's caches in the store (``Backend.cache_dirs``)."""
    from ..backend import all_backends

    found, seen = [], set()
    for backend in all_backends():
        for directory in backend.cache_dirs(root):
            if directory.resolve() not in seen:
                seen.add(directory.resolve())
                found.append((backend, directory))
    return found


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for base, _, files in os.walk(path):
        for name in files:
            try:
                total += (Path(base) / name).stat().st_size
            except OSError:  # removed while we walk (a writer's temporary)
                pass
    return total


@dataclass
class CacheState:
    digest: str
    paths: list[Path]  # the document's cache file in each backend's cache directory of the store
    tokens: int  # the document's context tokens (what its cache holds)

    @property
    def files(self) -> list[tuple[Path, int]]:
        """(path, bytes) of the files that exist."""
        found = []
        for path in self.paths:
            try:
                found.append((path, path.stat().st_size))
            except OSError:
                pass
        return found

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.files)

    @property
    def encoded(self) -> bool:
        return bool(self.files)


@dataclass
class Inventory:
    """One store's documents and caches. Each document's cache files are named by the content hash
    documents.jsonl records; for a store written before those records, ``builder`` (a
    ``PromptBuilder``; None: the store's, from its tokenizer alone, loaded when first needed) names them."""

    root: Path
    manifest: dict
    documents: list[Document]
    builder: object = None
    _caches: dict[str, CacheState] = field(default_factory=dict)
    directories: list | None = None  # (backend, cache directory); None: every backend's in the store
    records: dict = field(default_factory=dict)  # id -> (content hash, tokens), as the store recorded them
    store: object = None

    def __post_init__(self) -> None:
        if self.directories is None:
            self.directories = cache_directories(self.root)

    @classmethod
    def open(cls, store) -> "Inventory":
        """From a ``DocumentStore``: its records, else its tokenizer and template (never model weights)."""
        return cls(store.root, store.manifest, store.documents, records=store.cache_records, store=store)

    def groups(self) -> dict[str, list[Document]]:
        return group_documents(self.documents)

    def cache(self, document: Document) -> CacheState:
        if document.id not in self._caches:
            if document.id in self.records:
                digest, tokens = self.records[document.id]
            else:  # written before the records: the prompt builder names it
                from ..kv.format import content_hash

                if self.builder is None:
                    self.builder = prompt_builder(self.store)
                context = self.builder.context_text([document.render()])
                digest, tokens = content_hash(context), len(self.builder.encode(context))
            paths = [backend.cache_files(directory) / digest[:2] / f"{digest}.safetensors"
                     for backend, directory in self.directories]
            self._caches[document.id] = CacheState(digest, paths, tokens)
        return self._caches[document.id]

    def row(self, owner: str, parts: list[Document]) -> dict:
        """One document: id, title, chunks, tokens and cache bytes over its chunks."""
        caches = [self.cache(d) for d in parts]
        return {"id": owner, "title": parts[0].title, "chunks": len(parts), "tokens": sum(c.tokens for c in caches),
                "cache_bytes": sum(c.bytes for c in caches), "encoded": sum(c.encoded for c in caches)}

    def rows(self) -> list[dict]:
        return [self.row(owner, parts) for owner, parts in self.groups().items()]

    def show(self, doc_id: str) -> dict:
        """Everything about one document (an owner id or one chunk's id); KeyError if absent."""
        groups = self.groups()
        parts = groups.get(doc_id) or [d for d in self.documents if d.id == doc_id]
        if not parts:
            raise KeyError(doc_id)
        row = self.row(doc_id, parts)
        row["text"] = " ".join(d.text for d in parts)
        row["parts"] = [{"id": d.id, "tokens": c.tokens, "cache": "encoded" if c.encoded else "not encoded (on first use)",
                         "cache_bytes": c.bytes, "cache_files": [str(p.relative_to(self.root)) for p, _ in c.files],
                         "text": d.text}
                        for d, c in ((d, self.cache(d)) for d in parts)]
        return row

    def stats(self) -> dict:
        """Documents, tokens and bytes by part; the KV budget's counters when the store has a budget."""
        rows = self.rows()
        state = state_dir(self.root, self.manifest)  # the generation the manifest names
        parts = {"text": tree_bytes(state / DOCUMENTS) + tree_bytes(self.root / MANIFEST),
                 "retrieval": tree_bytes(state / RETRIEVERS_DIR),
                 "caches": sum(tree_bytes(directory) for _, directory in self.directories)}
        stats = {"documents": len(rows), "stored_chunks": len(self.documents), "tokens": sum(r["tokens"] for r in rows),
                 "caches_encoded": sum(r["encoded"] for r in rows), "bytes": {**parts, "total": sum(parts.values())}}
        for _, directory in self.directories:  # each cache directory its own budget
            budget = kv_budget_stats(self.root, self.manifest, directory)
            if budget is not None:
                stats[f"{directory.name}_budget"] = budget
        return stats


def kv_budget_stats(root: Path, manifest: dict, directory: Path) -> dict | None:
    """Hook for a cache directory's budget: its size and its hit / miss / eviction counters, or None
    for a store without a budget. Read defensively from the manifest (``kv_budget_gb``, under
    ``settings`` or top level) and a JSON counters file in the directory, whatever its exact name, so
    that a store written by another version never breaks ``pced store stats``."""
    settings = manifest.get("settings", {}) if isinstance(manifest.get("settings"), dict) else {}
    budget = manifest.get("kv_budget_gb", settings.get("kv_budget_gb"))
    if budget is None:
        return None
    out: dict = {"budget_gb": budget}
    for name in ("budget.json", "kv_budget.json", "usage.json", "stats.json"):
        path = directory / name
        try:
            counters = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(counters, dict):
            out.update({k: v for k, v in counters.items() if k in ("hits", "misses", "evictions", "bytes")})
    return out


def prompt_builder(store):
    """The store's ``PromptBuilder`` from its tokenizer alone (loading a tokenizer takes a fraction of
    a second; the model's weights are not needed to name its cache files)."""
    from transformers import AutoTokenizer

    from ..llm import embedded_model_dir
    from ..text.prompts import TEMPLATES, PromptBuilder

    path = store.settings.model_path
    folder = embedded_model_dir() if path is None else Path(path).expanduser()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return PromptBuilder(tokenizer, TEMPLATES[store.settings.template])
