"""Retrieval for PCED: find the candidate experts and turn scores into relevance priors r_k.

Pipeline (paper §3, Appendix B): a retriever ranks the corpus (BM25, a sentence-transformers
bi-encoder, BGE-M3 dense / sparse / ColBERT, or a BM25+dense hybrid); an optional cross-encoder
reranks the top-N; raw scores become relevance in (0, 1) and are fused by harmonic mean.

Heavy libraries (torch, transformers, sentence-transformers, bm25s) load only when a class
that needs them is first used, so importing ``pced.retrieval`` stays cheap for the CLI.
"""

from __future__ import annotations

import importlib
from typing import Any

from pced.retrieval.scores import (
    EPS,
    clip_relevance,
    fuse,
    normalize_dense,
    normalize_reranker,
    normalize_sparse,
)

_LAZY = {
    "Hit": "base", "BaseRetriever": "base", "top_indices": "base", "DEFAULT_TOP_N": "base",
    "BM25Retriever": "sparse",
    "DenseRetriever": "dense",
    "BGEM3Encoder": "bge_m3", "M3Embeddings": "bge_m3",
    "BGEM3Retriever": "m3_index",
    "HybridRetriever": "hybrid",
    "Reranker": "rerankers", "SequenceClassifierReranker": "rerankers",
    "CrossEncoderReranker": "rerankers", "load_reranker": "rerankers",
    "Candidate": "candidates", "retrieve": "candidates", "relevances": "candidates",
    "rank_given": "candidates", "rescore": "candidates",
    "DEFAULT_TOP_K": "candidates",
    "load_retriever": "registry", "default_retriever": "registry",
}

__all__ = ["EPS", "clip_relevance", "fuse", "normalize_dense", "normalize_reranker",
           "normalize_sparse", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"pced.retrieval.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'pced.retrieval' has no attribute {name!r}")
