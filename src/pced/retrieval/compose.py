"""Which retrievers a store has, how they are built, and how they are opened by name.

A store built with BGE-M3 holds one ``m3`` index whose dense / sparse / ColBERT modes are the
retrievers (hybrid = its sparse + dense modes); otherwise it holds ``sparse`` (BM25) and
``dense`` (a sentence-transformers model, the packaged MiniLM by default), and hybrid fuses them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from ..errors import UserError
from pced.documents import Document
from pced.options import RETRIEVERS
from pced.retrieval.base import BaseRetriever


def index_dirs(bge_m3: str | None) -> list[str]:
    """The index folders under a store's ``retrievers/``."""
    return ["m3"] if bge_m3 else ["sparse", "dense"]


def hybrid_fusion(name: str) -> str:
    """hybrid -> the paper's harmonic mean; hybrid-mean / hybrid-rrf -> that fusion."""
    return name.partition("-")[2] or "harmonic"


def open_retriever(base: Path, name: str, bge_m3: str | None, opened: dict[str, BaseRetriever]) -> BaseRetriever:
    """Retriever ``name`` of the indexes in ``base``, memoised in ``opened``."""
    if name not in RETRIEVERS:
        raise UserError(f"unknown retriever {name!r}; choose one of {', '.join(RETRIEVERS)}")
    if name not in opened:
        from pced.retrieval.hybrid import HybridRetriever
        from pced.retrieval.registry import load_retriever

        if bge_m3:
            m3 = opened.get("m3") or load_retriever(base / "m3", model_path=bge_m3)
            opened["m3"] = m3
            opened[name] = HybridRetriever(m3.with_mode("sparse"), m3.with_mode("dense"), fusion=hybrid_fusion(name)) \
                if name.startswith("hybrid") else m3.with_mode(name)
        elif name == "colbert":
            raise UserError("the colbert retriever needs a store built with --bge-m3 PATH")
        elif name.startswith("hybrid"):
            opened[name] = HybridRetriever(open_retriever(base, "sparse", None, opened),
                                           open_retriever(base, "dense", None, opened), fusion=hybrid_fusion(name))
        else:
            opened[name] = load_retriever(base / name)
    return opened[name]


def build_indexes(target: Path, documents: Sequence[Document], bge_m3: str | None, dense_model: str | None,
                  previous: tuple[BaseRetriever, Sequence[Document]] | None = None, progress: bool = False) -> None:
    """Build every index of a store into ``target`` (a staging folder). ``previous`` (the old store's
    dense retriever and its documents) lets unchanged documents keep their embeddings. ``progress``:
    each phase named on stderr, with a bar where the library reports one."""

    def phase(text: str) -> None:
        if progress:
            print(f"pced: retrieval indexes: {text}", file=sys.stderr, flush=True)

    if bge_m3:
        from pced.retrieval.m3_index import BGEM3Retriever

        phase(f"BGE-M3 dense, sparse and ColBERT vectors of {len(documents)} documents ...")
        BGEM3Retriever(bge_m3, modes=("dense", "sparse", "colbert")).index(documents).save(target / "m3")
        return
    from pced.retrieval.dense import DenseRetriever
    from pced.retrieval.sparse import BM25Retriever

    phase(f"BM25 over {len(documents)} documents ...")
    sparse = BM25Retriever()
    sparse.progress = progress
    sparse.index(documents).save(target / "sparse")
    dense = DenseRetriever(dense_model)
    dense.progress = progress
    phase("loading the dense retriever's model ...")
    dense.index_reusing(documents, *(previous or (None, ())))
    dense.save(target / "dense")


def describe_indexes(base: Path, bge_m3: str | None) -> dict:
    from pced.retrieval.storage import read_manifest

    return {name: read_manifest(base / name).get("describe", {}) for name in index_dirs(bge_m3)}
