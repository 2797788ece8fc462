"""Opening a store and asking it for candidates (the read path; many readers at once, no writes
except a document's KV cache encoded the first time it is retrieved from a ``--lazy-kv`` store)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..documents import Candidate, Document
from ..errors import UserError
from ..generator import Generator
from ..kv.tiers import CacheTiers
from ..llm import LoadedModel, load_model
from ..options import AskOptions
from .layout import DOCUMENTS, MANIFEST, RETRIEVERS_DIR, IndexSettings, StoreError, read_documents, recover
from .manifest import check_manifest


class DocumentStore:
    """Open with ``DocumentStore.open(dir)``; build or extend with ``pced.store.index_store``."""

    def __init__(self, root: Path, manifest: dict, documents: list[Document], llm: LoadedModel | None = None,
                 generator: Generator | None = None, tiers: CacheTiers = CacheTiers()):
        self.root, self.manifest, self.documents, self.tiers = root, manifest, documents, tiers
        self.settings = IndexSettings(**manifest["settings"])
        self._llm, self._generator, self._retrievers, self._reranker = llm, generator, {}, None

    @classmethod
    def open(cls, root: str | os.PathLike, llm: LoadedModel | None = None, generator: Generator | None = None,
             tiers: CacheTiers = CacheTiers()) -> "DocumentStore":
        """``tiers``: where document caches are kept between questions (``--gpu-cache-gb``)."""
        from ..retrieval.base import load_doc_ids
        from ..retrieval.compose import index_dirs

        root = Path(root)
        manifest_path = root / MANIFEST
        if not manifest_path.is_file():
            raise StoreError(f"{root} is not a pced store (no manifest.json); build it with pced index")
        recover(root)
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (ValueError, OSError) as exc:
            raise StoreError(f"{manifest_path}: not readable JSON ({exc}); re-run pced index") from exc
        try:
            documents = read_documents(root / DOCUMENTS)
        except (ValueError, OSError, KeyError, TypeError, AttributeError) as exc:
            raise StoreError(f"{root / DOCUMENTS}: damaged ({type(exc).__name__}: {exc}); re-run pced index") from exc
        check_manifest(manifest_path, manifest)
        store = cls(root, manifest, documents, llm if llm is not None else getattr(generator, "llm", None), generator, tiers)
        if store._llm is not None:
            store.check_model(store._llm)
        ids = [d.id for d in documents]
        for name in index_dirs(store.settings.bge_m3):
            if load_doc_ids(root / RETRIEVERS_DIR / name) != ids:
                raise StoreError(f"{root}: the {name} index does not match documents.jsonl (an interrupted pced index?); re-run it")
        return store

    def check_model(self, llm: LoadedModel) -> None:
        stored = self.manifest["model"]
        if stored["fingerprint"] != llm.fingerprint or stored["tokenizer_hash"] != llm.tokenizer_hash:
            raise StoreError(
                f"{self.root} was built with model {stored['name']} ({stored['fingerprint']}); "
                f"this run uses {llm.name} ({llm.fingerprint}): use the same --model or another store"
            )

    def use_tiers(self, tiers: CacheTiers) -> None:
        """Keep document caches as ``tiers`` says from now on (a new, empty device pool)."""
        self.tiers = tiers
        self._generator = None

    # -- components (loaded on first use) -------------------------------------------------------
    @property
    def llm(self) -> LoadedModel:
        if self._llm is None:
            self._llm = load_model(self.settings.model_path)
            self.check_model(self._llm)
        return self._llm

    @property
    def generator(self) -> Generator:
        if self._generator is None:
            self._generator = Generator(self.llm, self.settings.template, self.root / "kv", self.settings.storage_dtype,
                                  self.tiers)
        return self._generator

    def retriever(self, name: str = AskOptions.retriever):
        from ..retrieval.compose import open_retriever

        try:
            return open_retriever(self.root / RETRIEVERS_DIR, name, self.settings.bge_m3, self._retrievers)
        except UserError:  # a retriever this store was not built for: the question's fault
            raise
        except ValueError as exc:
            raise StoreError(str(exc)) from None

    def reranker(self, path: str | None = None):
        path = path or self.settings.reranker
        if path is None:
            return None
        if self._reranker is None or self._reranker[0] != path:
            from ..retrieval.rerankers import load_reranker

            self._reranker = (path, load_reranker(path))
        return self._reranker[1]

    # -- querying -------------------------------------------------------------------------------
    def retrieve(self, question: str, retriever: str = AskOptions.retriever, top_k: int = AskOptions.top_k,
                 top_n: int = AskOptions.top_n, rerank: bool = AskOptions.rerank,
                 reranker_path: str | None = None) -> list[Candidate]:
        from ..retrieval.candidates import retrieve

        return retrieve(question, self.retriever(retriever), top_n=max(top_n, top_k),
                        reranker=self.reranker(reranker_path) if rerank else None, top_k=top_k,
                        documents=self.documents)
