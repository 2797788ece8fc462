"""DocumentStore: one directory holding everything of a corpus.

    manifest.json        models, versions and settings (written last: a store without it is not built)
    documents.jsonl      the documents, in index order
    retrievers/          sparse + dense indexes (BM25 + MiniLM by default, or BGE-M3 with modes)
    kv/                  the per-document KV caches (pced.kvstore)

Indexing is incremental and safe to interrupt: KV files are content-addressed and atomic, so a
re-run skips what is stored; retriever indexes are built in a staging folder and swapped in;
documents.jsonl and the manifest are replaced atomically at the end. Opening checks that the
retriever indexes cover exactly the stored documents, so a half-finished run is reported, not used.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from . import __version__
from .documents import Document
from .engine import Candidate, Engine
from .kvstore import atomic_write_json, shareable
from .llm import LoadedModel, load_model
from .prompts import TEMPLATES, PromptBuilder

FORMAT = 1
RETRIEVERS = ("hybrid", "sparse", "dense", "colbert")


class StoreError(RuntimeError):
    """A store that cannot be opened or extended as asked (reported as one line)."""


@dataclass
class IndexSettings:
    """What a store is built with; changing any of these needs a new store."""

    model: str = "embedded"
    dense_model: str | None = None  # sentence-transformers path (default: packaged MiniLM)
    bge_m3: str | None = None  # local BGE-M3: replaces BM25/MiniLM with its sparse/dense/ColBERT modes
    reranker: str | None = None  # local cross-encoder / bge-reranker path, applied at ask time
    template: str = "rag"
    storage_dtype: str = "float16"
    max_doc_tokens: int = 1024

    def identity(self) -> dict:
        """The fields an existing store must share (max_doc_tokens and reranker may change)."""
        return {k: v for k, v in asdict(self).items() if k not in ("reranker", "max_doc_tokens")}


def _write_documents(documents: list[Document], path: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".jsonl", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            for d in documents:
                handle.write(json.dumps({"id": d.id, "title": d.title, "text": d.text}, ensure_ascii=False) + "\n")
        shareable(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _read_documents(path: Path) -> list[Document]:
    with open(path, encoding="utf-8") as handle:
        return [Document(r["id"], r["text"], r.get("title", "")) for r in map(json.loads, handle) if r]


class DocumentStore:
    """Open with ``DocumentStore.open(dir)``; build or extend with ``DocumentStore.index(...)``."""

    def __init__(self, root: Path, manifest: dict, documents: list[Document], llm: LoadedModel | None = None):
        self.root, self.manifest, self.documents = root, manifest, documents
        self.settings = IndexSettings(**manifest["settings"])
        self._llm, self._engine, self._retrievers, self._reranker = llm, None, {}, None

    # -- opening ------------------------------------------------------------------------------
    @classmethod
    def open(cls, root: str | os.PathLike, llm: LoadedModel | None = None) -> "DocumentStore":
        root = Path(root)
        manifest_path = root / "manifest.json"
        if not manifest_path.is_file():
            raise StoreError(f"{root} is not a pced store (no manifest.json); build it with pced index")
        _recover_retrievers(root)
        try:
            manifest = json.loads(manifest_path.read_text())
            documents = _read_documents(root / "documents.jsonl")
        except (json.JSONDecodeError, OSError, KeyError) as exc:
            raise StoreError(f"{root}: damaged store ({exc}); re-run pced index") from exc
        if manifest.get("format") != FORMAT:
            raise StoreError(f"{root}: store format {manifest.get('format')} is not supported (expected {FORMAT})")
        store = cls(root, manifest, documents, llm)
        if llm is not None:
            store._check_model(llm)
        ids = [d.id for d in documents]
        for name in store._index_dirs():
            from .retrieval.base import load_doc_ids

            if load_doc_ids(root / "retrievers" / name) != ids:
                raise StoreError(f"{root}: the {name} index does not match documents.jsonl (an interrupted pced index?); re-run it")
        return store

    def _check_model(self, llm: LoadedModel) -> None:
        stored = self.manifest["model"]
        if stored["fingerprint"] != llm.fingerprint or stored["tokenizer_hash"] != llm.tokenizer_hash:
            raise StoreError(
                f"{self.root} was built with model {stored['name']} ({stored['fingerprint']}); "
                f"this run uses {llm.name} ({llm.fingerprint}): use the same --model or another store"
            )

    def _index_dirs(self) -> list[str]:
        return ["m3"] if self.settings.bge_m3 else ["sparse", "dense"]

    # -- components ---------------------------------------------------------------------------
    @property
    def llm(self) -> LoadedModel:
        if self._llm is None:
            model = None if self.settings.model == "embedded" else self.settings.model
            self._llm = load_model(model)
            self._check_model(self._llm)
        return self._llm

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = Engine(self.llm, self.settings.template, self.root / "kv", self.settings.storage_dtype)
        return self._engine

    def retriever(self, name: str = "hybrid"):
        if name not in RETRIEVERS:
            raise StoreError(f"unknown retriever {name!r}; choose one of {', '.join(RETRIEVERS)}")
        if name not in self._retrievers:
            from .retrieval.hybrid import HybridRetriever
            from .retrieval.registry import load_retriever

            base = self.root / "retrievers"
            if self.settings.bge_m3:
                m3 = load_retriever(base / "m3", model_path=self.settings.bge_m3)
                self._retrievers[name] = (
                    HybridRetriever(m3.with_mode("sparse"), m3.with_mode("dense")) if name == "hybrid" else m3.with_mode(name)
                )
            elif name == "colbert":
                raise StoreError("the colbert retriever needs a store built with --bge-m3 PATH")
            elif name == "hybrid":
                self._retrievers[name] = HybridRetriever(self.retriever("sparse"), self.retriever("dense"))
            else:
                self._retrievers[name] = load_retriever(base / name)
        return self._retrievers[name]

    def reranker(self, path: str | None = None):
        path = path or self.settings.reranker
        if path is None:
            return None
        if self._reranker is None or self._reranker[0] != path:
            from .retrieval.rerankers import load_reranker

            self._reranker = (path, load_reranker(path))
        return self._reranker[1]

    # -- querying -------------------------------------------------------------------------------
    def retrieve(self, question: str, retriever: str = "hybrid", top_k: int = 8, top_n: int = 90,
                 rerank: bool = True, reranker_path: str | None = None) -> list[Candidate]:
        from .retrieval.candidates import retrieve

        found = retrieve(question, self.retriever(retriever), top_n=max(top_n, top_k),
                         reranker=self.reranker(reranker_path) if rerank else None, top_k=top_k,
                         documents=self.documents)
        return [Candidate(self.documents[c.index], c.relevance, c.scores()) for c in found]

    # -- building -------------------------------------------------------------------------------
    @classmethod
    def index(cls, corpus: list[Document], root: str | os.PathLike, settings: IndexSettings = IndexSettings(),
              llm: LoadedModel | None = None, progress: bool = True,
              encode_kv: bool = True) -> tuple["DocumentStore", dict]:
        """Create or extend the store at ``root`` with ``corpus``; returns the store and a report.

        ``encode_kv=False`` builds the retrieval indexes only: a document's KV cache is then
        encoded the first time it is retrieved (content-addressed, so later uses read it).
        For a large corpus of which few documents are ever asked about."""
        from .corpus import chunk_corpus

        root = Path(root)
        previous: DocumentStore | None = None
        if (root / "manifest.json").is_file():
            old = json.loads((root / "manifest.json").read_text())
            if IndexSettings(**old["settings"]).identity() != settings.identity():
                raise StoreError(
                    f"{root} was built with {IndexSettings(**old['settings']).identity()}; this run asks for "
                    f"{settings.identity()}: use another --out or the same model/retriever settings"
                )
            _recover_retrievers(root, clean=True)
            previous = cls(root, old, _read_documents(root / "documents.jsonl"))
        elif root.exists() and any(p for p in root.iterdir() if p.name not in ("kv", "retrievers") and not p.name.startswith((".tmp-", "retrievers."))):
            raise StoreError(f"{root} exists and is not a pced store; choose an empty or new --out directory")
        elif root.exists():
            _recover_retrievers(root, clean=True)  # a first build that was killed
        root.mkdir(parents=True, exist_ok=True)
        llm = llm or load_model(None if settings.model == "embedded" else settings.model)
        if previous is not None:
            previous._check_model(llm)
        builder = PromptBuilder(llm.tokenizer, TEMPLATES[settings.template])
        limit = min(settings.max_doc_tokens, max(64, (llm.max_context or 10**9) - 512))
        corpus, chunked = chunk_corpus(corpus, lambda text: len(builder._encode(text)), limit)
        merged, added, updated = _merge(previous.documents if previous else [], corpus)
        started = time.perf_counter()
        engine = Engine(llm, settings.template, root / "kv", settings.storage_dtype)
        engine.store.remove_stale_temporaries()  # a killed index run's; this run is the one writer
        if encode_kv:
            engine.store.add([d.render() for d in merged], progress=progress)
        kv_s = time.perf_counter() - started
        started = time.perf_counter()
        _build_retrievers(root, merged, settings, previous)
        retrieval_s = time.perf_counter() - started
        _write_documents(merged, root / "documents.jsonl")
        manifest = {
            "format": FORMAT,
            "pced_version": __version__,
            "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "settings": asdict(settings),
            "model": {"name": llm.name, "path": llm.path, "fingerprint": llm.fingerprint, "tokenizer_hash": llm.tokenizer_hash},
            "template_hash": builder.digest(),
            "documents": len(merged),
            "chunked": sorted(set((previous.manifest.get("chunked", []) if previous else []) + chunked)),
            "retrievers": _describe_retrievers(root, settings),
        }
        atomic_write_json(manifest, root / "manifest.json")
        report = {"documents": len(merged), "added": added, "updated": updated, "chunked": chunked,
                  "kv_encoded": engine.store.last_encoded if encode_kv else 0, "kv_s": kv_s, "retrieval_index_s": retrieval_s}
        store = cls.open(root, llm)
        store._engine = engine
        return store, report


def _merge(old: list[Document], new: list[Document]) -> tuple[list[Document], int, int]:
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


def _build_retrievers(root: Path, documents: list[Document], settings: IndexSettings, previous) -> None:
    staging = Path(tempfile.mkdtemp(prefix="retrievers.staging-", dir=root))
    try:
        if settings.bge_m3:
            from .retrieval.m3_index import BGEM3Retriever

            BGEM3Retriever(settings.bge_m3, modes=("dense", "sparse", "colbert")).index(documents).save(staging / "m3")
        else:
            from .retrieval.dense import DenseRetriever
            from .retrieval.sparse import BM25Retriever

            BM25Retriever().index(documents).save(staging / "sparse")
            dense = DenseRetriever(settings.dense_model)
            _index_dense_reusing(dense, documents, previous)
            dense.save(staging / "dense")
        target, old = root / "retrievers", root / f"retrievers.old-{os.getpid()}"
        if target.exists():
            os.replace(target, old)
        os.replace(staging, target)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _index_dense_reusing(dense, documents: list[Document], previous) -> None:
    """Embed only documents that are new or changed; reuse the stored vectors of the others."""
    reuse: dict[str, np.ndarray] = {}
    if previous is not None:
        old = previous.retriever("dense")
        old_docs = {d.id: d for d in previous.documents}
        for row, doc_id in enumerate(old.doc_ids):
            reuse[doc_id] = (old_docs.get(doc_id), row, old)
    fresh = [d for d in documents if d.id not in reuse or reuse[d.id][0] != d]
    vectors = dict(zip([d.id for d in fresh], dense.encode([d.render() for d in fresh], dense.document_prompt))) if fresh else {}
    rows = [vectors[d.id] if d.id in vectors else np.asarray(reuse[d.id][2].embeddings[reuse[d.id][1]]) for d in documents]
    dense.embeddings = np.stack(rows).astype(np.float32)
    dense.doc_ids = [d.id for d in documents]
    dense.documents = documents


def _describe_retrievers(root: Path, settings: IndexSettings) -> dict:
    from .retrieval.storage import read_manifest

    names = ["m3"] if settings.bge_m3 else ["sparse", "dense"]
    return {name: read_manifest(root / "retrievers" / name).get("describe", {}) for name in names}


def _recover_retrievers(root: Path, clean: bool = False) -> None:
    """Undo a retriever swap interrupted between its two renames; with ``clean`` (indexing, the
    single writer) also drop a killed run's staging folders and temporary files."""
    target = root / "retrievers"
    for old in root.glob("retrievers.old-*"):
        if not target.exists():
            os.replace(old, target)
        elif clean:
            shutil.rmtree(old, ignore_errors=True)
    if not clean:
        return
    for staging in root.glob("retrievers.staging-*"):
        shutil.rmtree(staging, ignore_errors=True)
    for stale in root.glob(".tmp-*"):  # documents.jsonl / manifest.json of a killed run
        stale.unlink(missing_ok=True)
