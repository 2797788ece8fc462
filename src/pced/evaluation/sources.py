"""Where an evaluation's candidates come from: the dataset's store (built once under the work dir)
and, per example, one ranked candidate list per top-k, the same for every method and setting."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from pced.options import EMBEDDED, EMBEDDED_NAME
from pced.documents import Candidate
from pced.evaluation.config import EvalConfig, EvalError
from pced.evaluation.datasets import Dataset, Example
from pced.retrieval.candidates import rescore



class CandidateSource:
    """Per example, one ranked candidate list per top-k, the same for every method."""

    def __init__(self, dataset: Dataset, store, config: EvalConfig):
        self.store, self.config = store, config
        self.corpus_mode = dataset.corpus is not None
        self.retriever = store.retriever(config.retriever)
        self.reranker = store.reranker(config.reranker) if config.reranker else None
        self.retriever.scores("warm-up")  # load lazy encoders now, not inside the first retrieval_s
        self.rows: dict[str, list[int]] = {}  # example doc id -> store rows (a long one's chunks)
        for row, doc in enumerate(store.documents):
            self.rows.setdefault(doc.owner, []).append(row)

    def candidates(self, example: Example, ks: Sequence[int],
                   relevances: Sequence[str | None] = (None,)) -> dict[tuple, list[Candidate]]:
        """{(k, relevance): candidates}: the same documents for every relevance source."""
        lists = self._lists(example, ks)
        out = {(k, None): found for k, found in lists.items()}
        for name in set(relevances) - {None}:
            retriever = self.store.retriever(name)
            raw = retriever.scores(example.question)
            out.update({(k, name): rescore(found, retriever, name, raw) for k, found in lists.items()})
        return out

    def _lists(self, example: Example, ks: Sequence[int]) -> dict[int, list[Candidate]]:
        if not self.corpus_mode:
            ranked = self._rank_own(example)
            return {k: ranked[:k] for k in ks}
        lists: dict[int, list[Candidate]] = {}
        by_pool: dict[int, list[int]] = {}
        for k in ks:  # one retrieval per candidate pool size; smaller k are its prefixes
            by_pool.setdefault(max(self.config.top_n, k), []).append(k)
        for top_n, group in by_pool.items():
            found = self._retrieve(example.question, max(group), top_n)
            lists.update({k: found[:k] for k in group})
        return lists

    def _rank_own(self, example: Example, query: str | None = None) -> list[Candidate]:
        from pced.retrieval.candidates import rank_given

        rows = list(dict.fromkeys(r for d in example.documents for r in self.rows.get(d.id, [])))
        # ties keep the example's document order
        return rank_given(query or example.question, self.retriever, rows, self.store.documents, self.reranker)

    def again(self, example: Example):
        """PCED's decode-time relevance ranks with ``query`` what the question's candidates came
        from: the whole store (corpus setting) or the example's own paragraphs."""
        if not self.corpus_mode:
            return lambda query: self._rank_own(example, query)
        return lambda query: self._retrieve(query, self.config.top_n, self.config.top_n)

    def _retrieve(self, query: str, top_k: int, top_n: int) -> list[Candidate]:
        """The store's ranking of ``query`` with this run's retriever and reranker."""
        return self.store.retrieve(query, self.config.retriever, top_k=top_k, top_n=top_n,
                                   rerank=self.reranker is not None, reranker_path=self.config.reranker)


def model_setting_of(config: EvalConfig, llm) -> str:
    if config.model:
        return str(Path(config.model).expanduser().resolve())
    return EMBEDDED if llm is None or llm.name == EMBEDDED_NAME else llm.path


def model_name(model_setting: str) -> str:
    return EMBEDDED_NAME if model_setting == EMBEDDED else Path(model_setting).name


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "dataset"


def prepare_store(config: EvalConfig, dataset: Dataset, llm, model_setting: str):
    """Open the dataset's store under the work dir, building or extending it when it lacks documents;
    its caches are kept as ``config.gpu_cache_gb`` says."""
    from pced.kv.tiers import CacheTiers

    store = _open_or_index(config, dataset, llm, model_setting)
    store.use_tiers(CacheTiers(gpu_cache_gb=config.gpu_cache_gb))
    return store


def _open_or_index(config: EvalConfig, dataset: Dataset, llm, model_setting: str):
    from pced.store import DocumentStore, IndexSettings, index_store

    template = "icl" if dataset.task == "icl" else "rag"
    settings = IndexSettings(model=model_setting, bge_m3=config.bge_m3, reranker=config.reranker,
                             template=template, storage_dtype=config.storage_dtype,
                             max_doc_tokens=config.max_doc_tokens)
    root = Path(config.work_dir) if config.work_dir else Path("runs") / "stores" / "-".join(
        [safe_name(dataset.name), dataset.setting or "default", model_name(model_setting), template]
        + (["m3"] if config.bge_m3 else []) + ([config.storage_dtype] if config.storage_dtype != "float16" else []))
    documents = dataset.corpus if dataset.corpus is not None else list(
        {d.id: d for e in dataset.examples for d in e.documents}.values())
    if not documents:
        raise EvalError(f"{dataset.name}: the loaded examples have no documents to use as experts")
    if (root / "manifest.json").is_file():
        store = DocumentStore.open(root, llm)
        stored = {d.owner for d in store.documents}
        if store.settings.identity() == settings.identity() and all(d.id in stored for d in documents):
            return store
    print(f"pced: indexing {len(documents)} documents into {root} (once; reused by later runs; a document's "
          f"KV cache is encoded the first time it is a candidate)", flush=True)
    store, report = index_store(documents, root, settings, llm, progress=config.progress, encode_kv=False)
    print(f"pced: store {root}: {report['documents']} documents, retrieval indexes built in "
          f"{report['retrieval_index_s']:.1f} s", flush=True)
    return store


