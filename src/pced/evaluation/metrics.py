"""Answer-quality metrics, re-implemented to the official definitions the paper reports.

Each scorer follows one reference implementation exactly, quirks included, because the point
is to produce numbers comparable with published ones:

- LOFT ``evaluation/utils.py`` / ``rag.py``: :func:`normalize_answer` (Unicode NFD first),
  :func:`subspan_em`, :func:`em`, :func:`loft_f1` and the QUEST/QAMParI multi-value scores
  (:func:`multi_answer_scores`).
- LOFT ICL (``utils.py`` ``extract_prediction`` + ``evaluation/icl.py`` ``IclEvaluation``):
  :func:`extract_loft_prediction`, :func:`icl_em`.
- LongBench ``metrics.py``: :func:`qa_f1_score`, :func:`rouge_score` (the ``rouge`` package's
  ROUGE-L F), :func:`code_sim_score` (fuzzywuzzy ``fuzz.ratio``), :func:`classification_score`,
  :func:`count_score`, :func:`retrieval_score`.
- HotpotQA ``hotpot_evaluate_v1.py``: :func:`hotpot_em`, :func:`hotpot_f1` (yes/no/noanswer rule).
- Ours (not a reference definition), for the paper's ICL answer format ``Output: ['...']``:
  :func:`extract_icl_answer`, :func:`icl_em_pced` (pced's ICL exact match before it was made
  LOFT's) and :func:`icl_lenient`.

:data:`METRICS` maps a metric name to a scorer with one uniform signature
``(prediction, answers, **kwargs) -> float in [0, 1]`` (best over the gold aliases, as every
reference does); :func:`score` is the entry point the evaluation runner uses.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence

from pced.errors import UserError
from pced.evaluation.longbench_metrics import (
    classification_score,
    code_sim_score,
    count_score,
    qa_f1_score,
    retrieval_score,
    rouge_l,
    rouge_score,
)
from pced.evaluation.answer_lists import as_answer_list, parse_list_literal
from pced.evaluation.icl_metrics import extract_icl_answer, extract_loft_prediction, icl_em, icl_em_pced, icl_lenient
from pced.evaluation.normalize import normalize_answer, normalize_answer_squad, token_f1

__all__ = [
    "METRICS",
    "classification_score",
    "code_sim_score",
    "count_score",
    "em",
    "extract_icl_answer",
    "extract_loft_prediction",
    "hotpot_em",
    "hotpot_f1",
    "hotpot_f1_precision_recall",
    "icl_em",
    "icl_em_pced",
    "icl_lenient",
    "loft_f1",
    "multi_answer_scores",
    "normalize_answer",
    "normalize_answer_squad",
    "qa_f1_score",
    "retrieval_score",
    "rouge_l",
    "rouge_score",
    "score",
    "split_answer_list",
    "subspan_em",
]

def subspan_em(prediction: str, gold_answers: str | Sequence[str]) -> float:
    """LOFT subspan EM: 1.0 if any normalized gold answer is a substring of the normalized
    prediction. This is the RAG metric of the paper; it forgives verbose answers."""
    pred = normalize_answer(prediction)
    golds = as_answer_list(gold_answers)
    if not golds:
        return 0.0
    return max(1.0 if normalize_answer(g) in pred else 0.0 for g in golds)


def em(prediction: str, gold_answers: str | Sequence[str]) -> float:
    """LOFT exact match: the normalized prediction equals some normalized gold answer."""
    pred = normalize_answer(prediction)
    golds = as_answer_list(gold_answers)
    if not golds:
        return 0.0
    return max(1.0 if normalize_answer(g) == pred else 0.0 for g in golds)


def loft_f1(prediction: str, gold_answers: str | Sequence[str]) -> float:
    """LOFT ``compute_f1``: best token F1 of the LOFT-normalized prediction over the golds."""
    pred_tokens = normalize_answer(prediction).split()
    golds = as_answer_list(gold_answers)
    if not golds:
        return 0.0
    return max(token_f1(pred_tokens, normalize_answer(g).split()) for g in golds)


def _max_bipartite_matching(adjacency: list[list[int]], n_right: int) -> int:
    """Size of a maximum matching (Kuhn's augmenting paths).

    LOFT solves the same 0/1 assignment with scipy's Hungarian solver; on a 0/1 matrix the
    best assignment's number of 1s is exactly the maximum matching size, so no scipy needed.
    """
    match_of_right = [-1] * n_right

    def augment(left: int, seen: list[bool]) -> bool:
        for right in adjacency[left]:
            if seen[right]:
                continue
            seen[right] = True
            if match_of_right[right] == -1 or augment(match_of_right[right], seen):
                match_of_right[right] = left
                return True
        return False

    return sum(augment(left, [False] * n_right) for left in range(len(adjacency)))


def multi_answer_scores(
    predicted_list: Sequence[str], gold_list: Sequence[str]
) -> dict[str, float]:
    """LOFT multi-value scores for list answers (QUEST, QAMParI), where EVERY gold is required.

    Definition (LOFT ``rag.MultiValueRagEvaluation``, plus P/R/F1 from the same alignment):
    both lists are normalized with :func:`normalize_answer` (LOFT's ``convert_to_str`` then
    ``normalize_answers``). Predicted items that normalize to "" ("the", "") are KEPT, as in
    LOFT: "" is a substring of every gold, so such an item matches any one gold. A gold g and a
    prediction p *match* when g is a substring of p or p of g. Golds and predictions are
    aligned one-to-one so that the number of matched pairs ``M`` is maximal.

    - ``subspan_em``: 1.0 iff every gold is aligned to a matching prediction (LOFT's
      ``compute_multi_value_subspan_em``; the headline QUEST metric).
    - ``precision`` = M / #predictions, ``recall`` = M / #golds, ``f1`` their harmonic mean.
    - ``em``: the sets of normalized strings are equal (LOFT ``compute_em_multi_value``).
    - ``coverage``: |set(preds) ∩ set(golds)| / #golds on exact normalized strings (LOFT).

    An empty prediction list scores 0 everywhere, as in LOFT. An empty gold list scores 0 too
    (LOFT divides by zero in ``compute_coverage`` there).
    """
    golds = [normalize_answer(str(g)) for g in gold_list]
    preds = [normalize_answer(str(p)) for p in predicted_list]
    zero = {"subspan_em": 0.0, "precision": 0.0, "recall": 0.0, "f1": 0.0, "em": 0.0,
            "coverage": 0.0}
    if not golds or not preds:
        return zero
    adjacency = [
        [j for j, p in enumerate(preds) if g in p or p in g] for g in golds
    ]
    matched = _max_bipartite_matching(adjacency, len(preds))
    precision = matched / len(preds)
    recall = matched / len(golds)
    f1 = 2 * precision * recall / (precision + recall) if matched else 0.0
    return {
        "subspan_em": 1.0 if matched == len(golds) else 0.0,
        "precision": precision,
        "recall": recall,
        "f1": f1,
        "em": 1.0 if set(golds) == set(preds) else 0.0,
        "coverage": len(set(preds) & set(golds)) / len(golds),
    }


_BULLET = re.compile(r"^\s*(?:[-*\u2022]|\d+[.)])\s+")


def split_answer_list(prediction: str) -> list[str]:
    """Turn a free-text answer into a list of answers for multi-answer scoring.

    LOFT's prompts make the model write ``Final Answer: ['a', 'b']`` and parse the first such
    line with ``ast.literal_eval`` (after dropping "*" and "`"); we do the same, and also accept
    a bare list literal. Items of a parsed list are kept even when blank, as LOFT keeps them
    (:func:`multi_answer_scores` then lets such an item match any gold, as LOFT does).
    Otherwise (the paper's "concise answer" prompt yields plain text) the text is split on
    newlines, semicolons and commas, dropping list bullets, quotes and empty pieces.
    """
    text = prediction.replace("*", "").replace("`", "").strip()
    lines = text.split("\n")
    final = [ln for ln in lines if "final answer" in ln.lower() and "[" in ln and "]" in ln]
    if final:
        parsed = parse_list_literal(final[0], keep_empty=True)
    elif text.startswith("[") and text.endswith("]"):
        parsed = parse_list_literal(text, keep_empty=True)
    else:
        parsed = None
    if parsed is not None:
        return parsed
    if final:
        text = final[0].split(":", 1)[-1]
    parts = re.split(r"[\n;,]", text)
    items = (_BULLET.sub("", part).strip().strip("'\"").strip() for part in parts)
    return [item for item in items if item]


# --------------------------------------------------------------------------- HotpotQA


def hotpot_em(prediction: str, ground_truth: str) -> float:
    """HotpotQA EM: SQuAD-normalized strings are equal."""
    same = normalize_answer_squad(prediction) == normalize_answer_squad(ground_truth)
    return 1.0 if same else 0.0


def hotpot_f1_precision_recall(prediction: str, ground_truth: str) -> tuple[float, float, float]:
    """HotpotQA ``f1_score``: (F1, precision, recall) with the yes/no/noanswer rule.

    If either side normalizes to "yes", "no" or "noanswer" and the two differ, all three
    are 0 (so "no" never gets partial credit against "no it was not").
    """
    pred = normalize_answer_squad(prediction)
    gold = normalize_answer_squad(ground_truth)
    special = ("yes", "no", "noanswer")
    if (pred in special or gold in special) and pred != gold:
        return 0.0, 0.0, 0.0
    pred_tokens, gold_tokens = pred.split(), gold.split()
    common = Counter(pred_tokens) & Counter(gold_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0, 0.0, 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall), precision, recall


def hotpot_f1(prediction: str, ground_truth: str) -> float:
    """HotpotQA answer F1 (see :func:`hotpot_f1_precision_recall`)."""
    return hotpot_f1_precision_recall(prediction, ground_truth)[0]


# --------------------------------------------------------------------------- ICL

# --------------------------------------------------------------------------- registry

Scorer = Callable[..., float]


def _best_over(fn: Callable[[str, str], float]) -> Scorer:
    """LongBench/HotpotQA score one gold at a time; the reported number is the max over golds."""

    def scorer(prediction: str, answers: Sequence[str], **_: object) -> float:
        return max((fn(prediction, str(a)) for a in answers), default=0.0)

    scorer.__doc__ = f"max over gold answers of {fn.__name__}"
    return scorer


def _classification(prediction: str, answers: Sequence[str], *, all_classes: Sequence[str]
                    | None = None, **_: object) -> float:
    if all_classes is None:
        raise UserError("classification needs all_classes=[...] (from the example's metadata)")
    return max((classification_score(prediction, str(a), all_classes) for a in answers),
               default=0.0)


def _multi(key: str) -> Scorer:
    def scorer(prediction: str, answers: Sequence[str], **_: object) -> float:
        return multi_answer_scores(split_answer_list(prediction), list(answers))[key]

    scorer.__doc__ = f"multi_answer_scores(split_answer_list(prediction), answers)['{key}']"
    return scorer


METRICS: dict[str, Scorer] = {
    "subspan_em": lambda prediction, answers, **_: subspan_em(prediction, answers),
    "em": lambda prediction, answers, **_: em(prediction, answers),
    "f1": lambda prediction, answers, **_: loft_f1(prediction, answers),
    "multi_answer_em": _multi("subspan_em"),
    "multi_answer_f1": _multi("f1"),
    "multi_answer_recall": _multi("recall"),
    "icl_em": lambda prediction, answers, **_: icl_em(prediction, answers),  # LOFT's, exactly
    "icl_em_pced": lambda prediction, answers, **_: icl_em_pced(prediction, answers),  # ours
    "icl_lenient": lambda prediction, answers, **_: icl_lenient(prediction, answers),  # ours
    "hotpot_em": _best_over(hotpot_em),
    "hotpot_f1": _best_over(hotpot_f1),
    "qa_f1": _best_over(qa_f1_score),
    "rouge": _best_over(rouge_score),
    "code_sim": _best_over(code_sim_score),
    "classification": _classification,
    "count": _best_over(count_score),
    "retrieval": _best_over(retrieval_score),
}


def score(metric_name: str, prediction: str, answers: str | Sequence[str], *,
          first_line: bool = False, **kwargs: object) -> float:
    """Score one prediction with the named metric, in [0, 1].

    ``answers`` are all gold aliases (or, for ``multi_answer_*``, all required answers).
    ``first_line=True`` keeps only the first line of the prediction, as LongBench's scorer
    does for trec/triviaqa/samsum/lsht. Extra keyword arguments (``all_classes``) go to the
    metrics that need them.
    """
    try:
        scorer = METRICS[metric_name]
    except KeyError:
        raise UserError(f"unknown metric {metric_name!r}; known: {', '.join(METRICS)}") from None
    if first_line:
        prediction = prediction.lstrip("\n").split("\n")[0]
    return float(scorer(prediction, as_answer_list(answers), **kwargs))
