"""What a store holds, read without loading the model: documents (with their chunks), tokens, the
state of each document's caches (every backend's: ``pced.backend``), and bytes by part (text,
retrieval, caches). ``pced store list / show / stats`` print these; removing goes through the
writer (``pced.store.writer.remove_documents``).

A document longer than the store's ``max_doc_tokens`` is stored as chunks, each recording the
document it was split from (``Document.source``, written in documents.jsonl): the chunk relation is
read from that record, never inferred from how an id is spelled, so a document of the user's whose
id looks like a chunk's (``report#1`` beside a chunked ``report``) is a document of its own.

A document's cache counts as encoded when a regular file is at its name (``list``, ``stats``: no
file is read); ``show`` checks each file's bytes as ``pced verify`` does before it looks into the
tensors (header, sizes, identity, content hash, checksum: ``Backend.check_cache``), so a cut,
changed, swapped or foreign file, a FIFO or a link out of the store is reported damaged. Cache files
no document of the store names (what a killed index run leaves) are orphans: reported apart, never
counted as the store's data.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ..documents import Document
from ..fs import read_regular, vanished
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


def regular_size(path: Path) -> int | None:
    """The size of the regular file at ``path`` (a link is not followed), or None."""
    try:
        found = os.lstat(path)
    except OSError:  # absent, or removed while we look (a writer's temporary)
        return None
    return found.st_size if stat.S_ISREG(found.st_mode) else None


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files at or under ``path`` (links are not followed)."""
    if not path.is_dir() or path.is_symlink():
        return regular_size(path) or 0
    return sum(regular_size(Path(base) / name) or 0 for base, _, files in os.walk(path) for name in files)


@dataclass
class CacheState:
    digest: str
    places: list[tuple[object, Path, Path]]  # (backend, its cache directory, the document's file in it)
    tokens: int  # the document's context tokens (what its cache holds)

    @property
    def paths(self) -> list[Path]:
        return [path for _, _, path in self.places]

    @property
    def files(self) -> list[tuple[Path, int]]:
        """(path, bytes) of the regular files at the document's names."""
        return [(path, size) for path in self.paths if (size := regular_size(path)) is not None]

    def damage(self) -> list[str]:
        """One line per file at the document's names that is not a whole cache of it (checked as
        ``pced verify`` checks it before looking into the tensors: ``Backend.check_cache``)."""
        from ..errors import DataError

        lines = []
        for backend, directory, path in self.places:
            if not os.path.lexists(path):
                continue
            try:
                backend.check_cache(directory, path, self.digest)
            except NotImplementedError:  # a plug-in backend without the check: its files count as they are
                pass
            except OSError as exc:  # evicted or swept while we look (ESTALE: by another NFS client)
                if not vanished(exc):
                    raise
            except DataError as exc:
                lines.append(str(exc))
        return lines

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
            places = [(backend, directory, backend.cache_files(directory) / digest[:2] / f"{digest}.safetensors")
                      for backend, directory in self.directories]
            self._caches[document.id] = CacheState(digest, places, tokens)
        return self._caches[document.id]

    def referenced(self) -> set[str]:
        """The content hashes the store's documents name (their cache files' names)."""
        return {self.cache(d).digest for d in self.documents}

    def orphans(self) -> list[tuple[Path, int]]:
        """(path, bytes) of the cache files no document of the store names: a killed index run's, or
        a replaced document's kept one run for readers of the previous generation."""
        keep, found = self.referenced(), []
        for backend, directory in self.directories:
            for path in sorted(backend.cache_files(directory).glob("*/*.safetensors")):
                if path.stem not in keep:
                    found.append((path, regular_size(path) or 0))
        return found

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
        row["parts"] = []
        for d in parts:
            c = self.cache(d)
            damage = c.damage()
            state = "damaged" if damage else "encoded" if c.encoded else "not encoded (on first use)"
            row["parts"].append({"id": d.id, "tokens": c.tokens, "cache": state, "cache_damage": damage,
                                 "cache_bytes": c.bytes,
                                 "cache_files": [str(p.relative_to(self.root)) for p in c.paths if os.path.lexists(p)],
                                 "text": d.text})
        return row

    def stats(self) -> dict:
        """Documents, tokens and bytes by part; the KV budget's counters when the store has a budget."""
        rows = self.rows()
        state = state_dir(self.root, self.manifest)  # the generation the manifest names
        orphans = self.orphans()
        parts = {"text": tree_bytes(state / DOCUMENTS) + tree_bytes(self.root / MANIFEST),
                 "retrieval": tree_bytes(state / RETRIEVERS_DIR),
                 "caches": sum(tree_bytes(directory) for _, directory in self.directories)
                 - sum(size for _, size in orphans)}
        stats = {"documents": len(rows), "stored_chunks": len(self.documents), "tokens": sum(r["tokens"] for r in rows),
                 "caches_encoded": sum(r["encoded"] for r in rows), "bytes": {**parts, "total": sum(parts.values())},
                 "orphans": {"files": len(orphans), "bytes": sum(size for _, size in orphans)}}
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
            counters = json.loads(read_regular(path))
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
