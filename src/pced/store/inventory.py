"""What a store holds, read without loading the model: documents (with their chunks), tokens, the
state of each KV cache, and bytes by part (text, retrieval, caches). ``pced store list / show /
stats`` print these; removing goes through the writer (``pced.store.writer.remove_documents``).

A document longer than the store's ``max_doc_tokens`` is stored as chunks ``id#1``, ``id#2`` ...
(``manifest["chunked"]`` names the documents split so): ``owner_of`` maps a stored id to the
document it belongs to, the one place that knows.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..documents import Document
from .layout import DOCUMENTS, MANIFEST, RETRIEVERS_DIR, state_dir

KV_DIR = "kv"  # the store's KVStore root (pced.kv.store): prefix.safetensors, kv/<h[:2]>/<h>.safetensors


def owner_of(doc_id: str, chunked: set[str]) -> str:
    """The document a stored id belongs to: ``X`` for a chunk ``X#n`` of a chunked ``X``, else itself."""
    base, sep, number = doc_id.rpartition("#")
    return base if sep and number.isdigit() and base in chunked else doc_id


def group_documents(documents: list[Document], chunked: set[str]) -> dict[str, list[Document]]:
    """Owner id -> its stored documents (one, or its chunks in order), in store order."""
    groups: dict[str, list[Document]] = {}
    for document in documents:
        groups.setdefault(document.source or owner_of(document.id, chunked), []).append(document)
    return groups


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
    path: Path
    tokens: int  # the document's context tokens (what its cache holds)

    @property
    def bytes(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    @property
    def encoded(self) -> bool:
        return self.path.is_file()


@dataclass
class Inventory:
    """One store's documents and caches; ``builder`` (a ``PromptBuilder``) names each cache file."""

    root: Path
    manifest: dict
    documents: list[Document]
    builder: object
    _caches: dict[str, CacheState] = field(default_factory=dict)

    @classmethod
    def open(cls, store) -> "Inventory":
        """From a ``DocumentStore``: its tokenizer and template only (no model weights)."""
        return cls(store.root, store.manifest, store.documents, prompt_builder(store))

    @property
    def chunked(self) -> set[str]:
        return set(self.manifest.get("chunked", []))

    def groups(self) -> dict[str, list[Document]]:
        return group_documents(self.documents, self.chunked)

    def cache(self, document: Document) -> CacheState:
        if document.id not in self._caches:
            from ..kv.format import content_hash

            context = self.builder.context_text([document.render()])
            digest = content_hash(context)
            path = self.root / KV_DIR / "kv" / digest[:2] / f"{digest}.safetensors"
            self._caches[document.id] = CacheState(digest, path, len(self.builder.encode(context)))
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
                         "cache_bytes": c.bytes, "cache_file": str(c.path.relative_to(self.root)), "text": d.text}
                        for d, c in ((d, self.cache(d)) for d in parts)]
        return row

    def stats(self) -> dict:
        """Documents, tokens and bytes by part; the KV budget's counters when the store has a budget."""
        rows = self.rows()
        state = state_dir(self.root, self.manifest)  # the generation the manifest names
        parts = {"text": tree_bytes(state / DOCUMENTS) + tree_bytes(self.root / MANIFEST),
                 "retrieval": tree_bytes(state / RETRIEVERS_DIR),
                 "caches": tree_bytes(self.root / KV_DIR) + sum(tree_bytes(d) for d in self.root.glob("llamacpp-*"))}
        stats = {"documents": len(rows), "stored_chunks": len(self.documents), "tokens": sum(r["tokens"] for r in rows),
                 "caches_encoded": sum(r["encoded"] for r in rows), "bytes": {**parts, "total": sum(parts.values())}}
        budget = kv_budget_stats(self.root, self.manifest)
        if budget is not None:
            stats["kv_budget"] = budget
            for states in sorted(self.root.glob("llamacpp-*")):  # llama.cpp's states, each directory its own budget
                stats[f"{states.name}_budget"] = kv_budget_stats(self.root, self.manifest, states)
        return stats


def kv_budget_stats(root: Path, manifest: dict, directory: Path | None = None) -> dict | None:
    """Hook for the store's KV budget: its size and its hit / miss / eviction counters, or None for a
    store without a budget. Read defensively from the manifest (``kv_budget_gb``, under ``settings``
    or top level) and a JSON counters file in the kv directory, whatever its exact name, so that a
    store written by another version never breaks ``pced store stats``. ``directory``: another cache
    directory of the store (llama.cpp's ``llamacpp-<cache type>/``) instead of ``kv/``."""
    settings = manifest.get("settings", {}) if isinstance(manifest.get("settings"), dict) else {}
    budget = manifest.get("kv_budget_gb", settings.get("kv_budget_gb"))
    if budget is None:
        return None
    out: dict = {"budget_gb": budget}
    for name in ("budget.json", "kv_budget.json", "usage.json", "stats.json"):
        path = (directory or root / KV_DIR) / name
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
    from ..prompts import TEMPLATES, PromptBuilder

    path = store.settings.model_path
    folder = embedded_model_dir() if path is None else Path(path).expanduser()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return PromptBuilder(tokenizer, TEMPLATES[store.settings.template])
