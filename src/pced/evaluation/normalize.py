"""Answer normalization and token F1 shared by the LOFT, LongBench and HotpotQA metrics."""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from collections.abc import Sequence

__all__ = ["normalize_answer", "normalize_answer_squad", "token_f1"]

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)



def normalize_answer_squad(text: str) -> str:
    """SQuAD normalization (LongBench, HotpotQA): lower, drop ASCII punctuation, drop the
    articles a/an/the, collapse whitespace. No Unicode normalization, as in those scripts."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def normalize_answer(text: str) -> str:
    """LOFT normalization: Unicode NFD, then SQuAD normalization.

    NFD makes precomposed and decomposed spellings of the same accented word compare equal;
    it does not strip accents ("Taíno" still differs from "Taino"), exactly as LOFT.
    """
    return normalize_answer_squad(unicodedata.normalize("NFD", text))


def token_f1(pred_tokens: Sequence[str], gold_tokens: Sequence[str]) -> float:
    """SQuAD token F1 on already-normalized tokens (0 when nothing overlaps)."""
    common = Counter(pred_tokens) & Counter(gold_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)
