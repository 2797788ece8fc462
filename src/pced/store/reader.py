"""Opening a store and asking it for candidates (the read path; many readers at once, no writes
except a document's KV cache encoded the first time it is retrieved from an on-demand store
(``--lazy-kv``, ``--kv-budget-gb``) and that store's cache counters).

A reader reads ``manifest.json`` once and then only the files of the generation it names
(``layout.state_dir``), which an index run never changes or removes while it is the current or
the previous one; ``DocumentStore.changed()`` tells a long-lived reader (the server) that a newer
generation was published. The caches its generators encode are written only for documents the
current generation holds (``retention``)."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from ..backend import DEFAULT_BACKEND, get_backend
from ..documents import Candidate, Document
from ..errors import UserError
from ..kv.tier_settings import CacheTiers
from ..options import AskOptions
from .layout import DOCUMENTS, RETRIEVERS_DIR, IndexSettings, StoreError, generation, recover, state_dir
from .manifest import read_manifest
from .records import read_documents
from .retention import CurrentDocuments

if TYPE_CHECKING:  # the model stack loads when a question is asked, not when a store is opened
    from ..generator import Generator
    from ..llm import LoadedModel

OPEN_ATTEMPTS = 3  # an index run published (and swept) two generations while this reader was opening one


class DocumentStore:
    """Open with ``DocumentStore.open(dir)``; build or extend with ``pced.store.index_store``."""

    def __init__(self, root: Path, manifest: dict, documents: list[Document], llm: LoadedModel | None = None,
                 generator: Generator | None = None, tiers: CacheTiers = CacheTiers(),
                 cache_records: dict[str, tuple[str, int]] | None = None):
        self.root, self.manifest, self.documents, self.tiers = root, manifest, documents, tiers
        # id -> (the content hash naming its cache files, tokens they hold), as documents.jsonl records them
        self.cache_records = cache_records if cache_records is not None else {}
        self.settings = IndexSettings(**manifest["settings"])
        self.state = state_dir(root, manifest)  # this generation's documents.jsonl and retrievers/
        self.generation = generation(manifest)
        recorded = {digest for digest, _ in self.cache_records.values()}
        self.cache_writes = CurrentDocuments(root, self.generation,
                                             recorded if len(self.cache_records) == len(documents) else None)
        self._retrievers, self._reranker = {}, None
        self._models: dict[tuple, object] = {}  # (backend's model key, path) -> its loaded model
        self._generators: dict[tuple, Generator] = {}  # (backend name, its settings) -> the store's generator
        if llm is not None:
            backend = get_backend(getattr(llm, "backend", DEFAULT_BACKEND))
            self._models[(backend.model_key(backend.settings(getattr(llm, "settings", None))), None)] = llm
        if generator is not None:
            self.adopt(generator)

    @classmethod
    def open(cls, root: str | os.PathLike, llm: LoadedModel | None = None, generator: Generator | None = None,
             tiers: CacheTiers = CacheTiers()) -> "DocumentStore":
        """``tiers``: where document caches are kept between questions (``--gpu-cache-gb``)."""
        from ..retrieval.base import load_doc_ids
        from ..retrieval.compose import index_dirs

        root = Path(root)
        for attempt in range(OPEN_ATTEMPTS):
            manifest = read_manifest(root)  # the one checked reader of manifest.json
            try:
                if not generation(manifest):
                    recover(root)  # a store written before generations: undo a killed run's half swap
                state = state_dir(root, manifest)
                records: dict = {}
                documents = read_documents(root, manifest, records)  # the one checked reader of documents.jsonl
                ids = [d.id for d in documents]
                settings = IndexSettings(**manifest["settings"])
                listed = {name: load_doc_ids(state / RETRIEVERS_DIR / name) for name in index_dirs(settings.bge_m3)}
            except (StoreError, ValueError, OSError, KeyError, TypeError, AttributeError) as exc:
                if attempt + 1 < OPEN_ATTEMPTS and generation(manifest) != current_generation(root):
                    continue  # the generation was swept meanwhile: read the newer one
                if isinstance(exc, StoreError):
                    raise
                # a retriever's id list: an index run rebuilds it from the documents
                raise StoreError(f"{root}: damaged store ({exc}); {reindex_advice(root)}") from exc
            break
        for name, listed_ids in listed.items():
            if listed_ids != ids:
                raise StoreError(f"{state / RETRIEVERS_DIR / name}: the {name} index lists {len(listed_ids)} documents, "
                                 f"not the {len(ids)} of {state / DOCUMENTS}: the index is damaged; "
                                 f"{reindex_advice(root)}")
        store = cls(root, manifest, documents, llm, generator, tiers, records)
        for model in store._models.values():
            store.check_model(model)
        return store

    def cache_stats(self) -> dict:
        """The KV caches without loading a model: on demand or not, budget (bytes or None), bytes and
        files held, and the counters persisted by every process that used them (hits, misses, evictions)."""
        from ..kv.budget import ByteBudget, gb_to_bytes

        kv = self.root / "kv"
        return {"on_demand": self.settings.on_demand,
                **ByteBudget(kv, kv / "kv", gb_to_bytes(self.settings.kv_budget_gb)).stats()}

    def changed(self) -> bool:
        """Whether an index run has published another generation since this one was opened."""
        return current_generation(self.root) != self.generation

    def reopen(self) -> "DocumentStore":
        """The store's current generation, with this one's models, generators and cache tiers."""
        fresh = DocumentStore.open(self.root, tiers=self.tiers)
        fresh._models, fresh._generators = dict(self._models), dict(self._generators)
        return fresh

    def check_model(self, llm: LoadedModel) -> None:
        """The model must be the one the store was indexed with; one of another backend's kind (a
        quantized file of the same model beside its torch weights) must have its tokenizer, since
        the documents were chunked with it, and each backend's cache directory pins its own weights."""
        stored = self.manifest["model"]
        if getattr(llm, "backend", DEFAULT_BACKEND) != stored.get("backend", DEFAULT_BACKEND):
            difference = None if stored["tokenizer_hash"] == llm.tokenizer_hash else "its tokenizer differs"
        else:
            difference = llm.model_difference(stored)
        if difference is not None:
            raise StoreError(
                f"{self.root} was built with model {stored['name']} ({stored['fingerprint']}); "
                f"this run uses {llm.name} ({llm.fingerprint}), and {difference}: use the same model or another store"
            )

    def use_tiers(self, tiers: CacheTiers) -> None:
        """Keep document caches as ``tiers`` says from now on (a new, empty device pool)."""
        self.tiers = tiers
        self._generators.clear()

    # -- components (loaded on first use) -------------------------------------------------------
    def model_for(self, backend=DEFAULT_BACKEND, settings=None, model: str | None = None, **load):
        """The model ``backend`` answers with: the store's (``model`` another file or folder, e.g. a
        GGUF with the store's tokenizer), loaded once per way of loading (``Backend.model_key``) and
        checked against the store. ``load``: device, dtype."""
        backend = get_backend(backend)
        settings = backend.settings(settings)
        slot = (backend.model_key(settings), model)
        if slot not in self._models:
            llm = backend.load_model(model or self.settings.model_path, settings, **load)
            self.check_model(llm)
            self._models[slot] = llm
        return self._models[slot]

    @property
    def llm(self) -> LoadedModel:
        """The default backend's model."""
        return self.model_for()

    def generator_for(self, backend=DEFAULT_BACKEND, settings=None, model: str | None = None) -> Generator:
        """The store's generator on ``backend``: its model, the store's template, and its caches in
        the store (``Backend.cache_dir``: each backend's folder, under the store's budget)."""
        from ..generator import Generator
        from ..kv.budget import gb_to_bytes

        backend = get_backend(backend)
        settings = backend.settings(settings)
        key = (backend.name, settings, model)
        if key not in self._generators:
            self._generators[key] = Generator(
                self.model_for(backend, settings, model), self.settings.template, backend.cache_dir(self.root, settings),
                self.settings.storage_dtype, self.tiers, budget_bytes=gb_to_bytes(self.settings.kv_budget_gb),
                on_demand=self.settings.on_demand, recorded_model_path=self.manifest["model"].get("path"),
                backend=backend, settings=settings)
            self._generators[key].guard_writes(self.cache_writes)
        return self._generators[key]

    def adopt(self, generator: Generator, model: str | None = None) -> None:
        """Answer with ``generator`` (its model and caches) on its backend from now on."""
        self._models.setdefault((generator.backend.model_key(generator.settings), model), generator.llm)
        self._generators[(generator.backend.name, generator.settings, model)] = generator
        generator.guard_writes(self.cache_writes)

    @property
    def generator(self) -> Generator:
        """The default backend's generator."""
        return self.generator_for()

    def retriever(self, name: str = AskOptions.retriever):
        from ..retrieval.compose import open_retriever

        try:
            return open_retriever(self.state / RETRIEVERS_DIR, name, self.settings.bge_m3, self._retrievers)
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


def reindex_advice(root: Path) -> str:
    """What repairs a store whose retrieval indexes are damaged: an index run rebuilds them from the
    stored documents."""
    return ("re-run pced index to rebuild its indexes from the stored documents: "
            f"pced index CORPUS --out {shlex.quote(str(root))}")


def current_generation(root: Path) -> int | None:
    """The generation the store's manifest names now; None if it cannot be read."""
    try:
        return generation(read_manifest(root))
    except (StoreError, OSError):
        return None
