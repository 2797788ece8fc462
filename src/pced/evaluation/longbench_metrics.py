"""LongBench's answer metrics (``metrics.py`` of THUDM/LongBench), re-implemented.

Kept apart from :mod:`pced.evaluation.metrics` only for size; that module re-exports these
and registers them. Every function scores ONE gold string; LongBench reports the max over golds.
Chinese variants (jieba tokenization) are not implemented: the paper uses the English subsets.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence

from pced.evaluation.normalize import normalize_answer_squad, token_f1

__all__ = [
    "classification_score",
    "code_sim_score",
    "count_score",
    "qa_f1_score",
    "retrieval_score",
    "rouge_l",
    "rouge_score",
]



def qa_f1_score(prediction: str, ground_truth: str) -> float:
    """LongBench ``qa_f1_score``: token F1 after SQuAD normalization."""
    return token_f1(normalize_answer_squad(prediction).split(),
                     normalize_answer_squad(ground_truth).split())


def _lcs_words(reference: list[str], candidate: list[str]) -> list[str]:
    """The words of one longest common subsequence, chosen with the ``rouge`` package's
    backtracking tie-break (which matters, because ROUGE-L there counts distinct words)."""
    n, m = len(reference), len(candidate)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        ref_word, row, prev = reference[i - 1], table[i], table[i - 1]
        for j in range(1, m + 1):
            if ref_word == candidate[j - 1]:
                row[j] = prev[j - 1] + 1
            else:
                row[j] = max(prev[j], row[j - 1])
    words: list[str] = []
    i, j = n, m
    while i > 0 and j > 0:  # iterative: the package recurses and dies on long sentences
        if reference[i - 1] == candidate[j - 1]:
            words.append(reference[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    words.reverse()
    return words


def _rouge_sentences(text: str) -> list[str]:
    # The package splits on "." and keeps every non-empty piece, even one of only spaces,
    # which then contributes the empty-string "word"; reproduced on purpose.
    return [" ".join(piece.split()) for piece in text.split(".") if len(piece) > 0]


def rouge_l(prediction: str, ground_truth: str) -> dict[str, float]:
    """ROUGE-L (summary level) exactly as ``rouge.Rouge().get_scores`` (pltrdy ``rouge``
    1.0.1, ``exclusive=True``) computes it; returns ``{"f", "p", "r"}``.

    Texts are split into sentences on "."; words are whitespace tokens, case-sensitive.
    With the package's default ``exclusive=True`` counts are over DISTINCT words:
    n / m = distinct words of prediction / reference, and the overlap is the number of
    distinct words in the union of LCS(ref_sentence, pred_sentence) over all sentence pairs.
    P = overlap/n, R = overlap/m, F = 2PR/(P+R+1e-8). Raises ValueError on an empty side.
    """
    hyp = _rouge_sentences(prediction)
    ref = _rouge_sentences(ground_truth)
    if not hyp or not ref:
        raise ValueError("ROUGE needs at least one sentence on each side")
    hyp_words = [w for s in hyp for w in s.split(" ")]
    ref_words = [w for s in ref for w in s.split(" ")]
    union: set[str] = set()
    for ref_sentence in ref:
        ref_tokens = ref_sentence.split(" ")
        for hyp_sentence in hyp:
            union.update(_lcs_words(ref_tokens, hyp_sentence.split(" ")))
    overlap = len(union)
    recall = overlap / len(set(ref_words))
    precision = overlap / len(set(hyp_words))
    f = 2.0 * (precision * recall) / (precision + recall + 1e-8)
    return {"f": f, "p": precision, "r": recall}


def rouge_score(prediction: str, ground_truth: str) -> float:
    """LongBench ``rouge_score``: ROUGE-L F, 0.0 where the package would raise (empty text)."""
    try:
        return rouge_l(prediction, ground_truth)["f"]
    except ValueError:
        return 0.0


def _fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy ``fuzz.ratio`` (pure-Python backend): round(100 * SequenceMatcher.ratio()),
    i.e. round(100 * 2M/T) with M matched characters and T the total length; 100 for equal
    strings (even two empty ones), else 0 if either string is empty."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def code_sim_score(prediction: str, ground_truth: str) -> float:
    """LongBench ``code_sim_score``: similarity of the first code line of the prediction.

    The first line (after leading newlines) that contains none of "`", "#", "//" (the
    official check is *contains*, not *starts with*: it skips fences and comments) is compared
    with the gold next line by fuzz.ratio / 100; "" if there is no such line.
    """
    candidate = ""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            candidate = line
            break
    return _fuzz_ratio(candidate, ground_truth) / 100


def classification_score(prediction: str, ground_truth: str, all_classes: Sequence[str]) -> float:
    """LongBench ``classification_score`` (TREC, LSHT).

    Every class name occurring in the prediction is a match; matches that are a proper
    substring of the gold label are dropped; the score is 1/#matches if the gold is among
    them, else 0. The drop loop removes from the list while iterating it, as the official code
    does, so an element right after a removed one is not examined; kept for comparability.
    (The official "no match -> closest class by difflib" branch is unreachable there, since
    it tests ``list != 0``; so it is here.)
    """
    matches = [name for name in all_classes if name in prediction]
    for term in matches:
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def count_score(prediction: str, ground_truth: str) -> float:
    """LongBench ``count_score`` (passage_count): share of the numbers in the prediction that
    equal the gold count."""
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(1 for n in numbers if n == str(ground_truth)) / len(numbers)


def retrieval_score(prediction: str, ground_truth: str) -> float:
    """LongBench ``retrieval_score`` (passage_retrieval_en): share of the numbers in the
    prediction equal to the gold "Paragraph N" id."""
    found = re.findall(r"Paragraph (\d+)", ground_truth)
    if not found:
        return 0.0
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(1 for n in numbers if n == found[0]) / len(numbers)


