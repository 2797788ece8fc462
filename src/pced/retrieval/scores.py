"""Turn raw retrieval and reranker scores into relevance priors r in (0, 1).

PCED adds ``gamma * log(r_k)`` to expert k's logits (paper Eq. 2), so every relevance signal
must live on one common scale and must never be exactly 0 (log 0) or 1 (the prior would stop
discriminating). Appendix B of the paper gives the maps implemented here; each result is then
clipped to ``[EPS, 1 - EPS]``, the same range the decoder clips to.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

EPS = 1e-8


def clip_relevance(r: ArrayLike) -> np.ndarray:
    """Keep relevance strictly inside (0, 1) so that ``log r`` is finite and below 0."""
    return np.clip(np.asarray(r, dtype=np.float64), EPS, 1.0 - EPS)


def normalize_dense(s: ArrayLike) -> np.ndarray:
    """Cosine / ColBERT similarity in [-1, 1] -> (s + 1) / 2 (Appendix B, Eq. 6)."""
    s = np.asarray(s, dtype=np.float64)
    return clip_relevance((s + 1.0) / 2.0)


def normalize_sparse(s: ArrayLike) -> np.ndarray:
    """Non-negative unbounded lexical score -> 2/pi * atan(max(s, 0)) (Appendix B, Eq. 7).

    The arctan saturates smoothly, so large BM25 / lexical-weight scores stay ordered without
    one outlier flattening everything else (which max-scaling per query would do).
    """
    s = np.asarray(s, dtype=np.float64)
    return clip_relevance(2.0 / np.pi * np.arctan(np.maximum(s, 0.0)))


def normalize_reranker(z: ArrayLike) -> np.ndarray:
    """Cross-encoder logit -> sigmoid(z) (Appendix B, Eq. 8), computed without overflow.

    ``1 / (1 + exp(-z))`` overflows for very negative z; splitting by sign keeps every
    intermediate ``exp`` argument <= 0.
    """
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(-np.abs(z))
    sig = np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    return clip_relevance(sig)


def fuse(a: ArrayLike, b: ArrayLike) -> np.ndarray:
    """Harmonic mean ``2ab / (a + b + EPS)`` of two relevances (Appendix B, Eq. 9).

    The harmonic mean is dominated by the smaller input: a document must look relevant to both
    signals to get a high prior. The result is clipped like every other relevance.
    """
    a = clip_relevance(a)
    b = clip_relevance(b)
    return clip_relevance(2.0 * a * b / (a + b + EPS))


# -- fusing the hybrid's two sides (``pced.retrieval.hybrid``) ---------------------------------------
FUSIONS = ("harmonic", "mean", "rrf")
RRF_K = 60  # reciprocal rank fusion's constant (Cormack et al., 2009)


def fuse_mean(a: ArrayLike, b: ArrayLike) -> np.ndarray:
    """Arithmetic mean of two relevances: one side at 0 halves the other instead of vetoing it."""
    return clip_relevance(0.5 * (clip_relevance(a) + clip_relevance(b)))


def ranks(raw: ArrayLike) -> np.ndarray:
    """1-based rank of every entry, best (highest) first; ties share the better rank."""
    raw = np.asarray(raw, dtype=np.float64)
    order = np.argsort(-raw, kind="stable")
    sorted_raw = raw[order]
    first = np.r_[True, sorted_raw[1:] != sorted_raw[:-1]]
    rank_sorted = np.maximum.accumulate(np.where(first, np.arange(1, raw.size + 1), 0))
    out = np.empty(raw.size, dtype=np.int64)
    out[order] = rank_sorted
    return out


def fuse_rrf(sparse_raw: ArrayLike, dense_raw: ArrayLike, k: int = RRF_K) -> np.ndarray:
    """Reciprocal rank fusion of two rankings of the same documents, scaled to (0, 1]: 1 for a
    document first in both lists. Raw scores never meet, so no side's scale (BM25 0) can veto."""
    total = 1.0 / (k + ranks(sparse_raw)) + 1.0 / (k + ranks(dense_raw))
    return clip_relevance(total * (k + 1) / 2.0)
