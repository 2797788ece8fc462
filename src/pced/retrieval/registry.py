"""Open any saved index by its manifest, and build the embedded default retriever.

A store only needs ``load_retriever(dir)``: the ``type`` field of ``retriever.json`` names the
class, so the store never hard-codes which retriever it was built with.
"""

from __future__ import annotations

import os
from typing import Any

from pced.retrieval.base import BaseRetriever
from pced.retrieval.storage import read_manifest


def _classes() -> dict[str, type]:
    from pced.retrieval.dense import TYPE as DENSE
    from pced.retrieval.dense import DenseRetriever
    from pced.retrieval.hybrid import TYPE as HYBRID
    from pced.retrieval.hybrid import HybridRetriever
    from pced.retrieval.m3_index import TYPE as M3
    from pced.retrieval.m3_index import BGEM3Retriever
    from pced.retrieval.sparse import TYPE as BM25
    from pced.retrieval.sparse import BM25Retriever

    return {BM25: BM25Retriever, DENSE: DenseRetriever, M3: BGEM3Retriever, HYBRID: HybridRetriever}


def load_retriever(directory: str | os.PathLike, **kwargs: Any) -> BaseRetriever:
    """Open the index saved in ``directory`` (keyword arguments go to that class's ``load``)."""
    kind = read_manifest(directory)["type"]
    classes = _classes()
    if kind not in classes:
        raise ValueError(f"{directory}: unknown retriever type {kind!r}")
    cls = classes[kind]
    if getattr(cls, "composite", False):
        return cls.load(directory, load_component=load_retriever, **kwargs)
    return cls.load(directory, **kwargs)


def default_retriever() -> BaseRetriever:
    """The embedded default for ``pced index``: BM25 + packaged MiniLM, harmonic-mean fused.

    Chosen from ``experiments/retrieval_recall.py`` on HotpotQA (994 passages, 100 questions): the
    hybrid has the best recall@8 and recall@90 of the three embedded options (numbers in the
    module docstring of ``tests/test_retrieval_recall.py``) and runs offline on a CPU.
    """
    from pced.retrieval.dense import DenseRetriever
    from pced.retrieval.hybrid import HybridRetriever
    from pced.retrieval.sparse import BM25Retriever

    return HybridRetriever(BM25Retriever(), DenseRetriever())
