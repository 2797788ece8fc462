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

import ast
import re
import warnings
from collections import Counter
from collections.abc import Callable, Sequence

from pced.evaluation.longbench_metrics import (
    classification_score,
    code_sim_score,
    count_score,
    qa_f1_score,
    retrieval_score,
    rouge_l,
    rouge_score,
)
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

def _as_answer_list(answers: str | Sequence[str]) -> list[str]:
    return [answers] if isinstance(answers, str) else [str(a) for a in answers]


# --------------------------------------------------------------------------- LOFT


def subspan_em(prediction: str, gold_answers: str | Sequence[str]) -> float:
    """LOFT subspan EM: 1.0 if any normalized gold answer is a substring of the normalized
    prediction. This is the RAG metric of the paper; it forgives verbose answers."""
    pred = normalize_answer(prediction)
    golds = _as_answer_list(gold_answers)
    if not golds:
        return 0.0
    return max(1.0 if normalize_answer(g) in pred else 0.0 for g in golds)


def em(prediction: str, gold_answers: str | Sequence[str]) -> float:
    """LOFT exact match: the normalized prediction equals some normalized gold answer."""
    pred = normalize_answer(prediction)
    golds = _as_answer_list(gold_answers)
    if not golds:
        return 0.0
    return max(1.0 if normalize_answer(g) == pred else 0.0 for g in golds)


def loft_f1(prediction: str, gold_answers: str | Sequence[str]) -> float:
    """LOFT ``compute_f1``: best token F1 of the LOFT-normalized prediction over the golds."""
    pred_tokens = normalize_answer(prediction).split()
    golds = _as_answer_list(gold_answers)
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


def _escape_single_quotes(text: str) -> str:
    """LOFT ``utils.extract_prediction._escape_single_quotes``: ``devil's`` -> ``devil\\'s``."""
    return re.sub(r"([a-zA-Z0-9])'([a-zA-Z0-9])", r"\1\\'\2", text)


def _literal_eval_quietly(literal: str) -> object:
    with warnings.catch_warnings():  # e.g. SyntaxWarning on "\d" inside a string item
        warnings.simplefilter("ignore")
        return ast.literal_eval(literal)


def _parse_list_literal(text: str, *, keep_empty: bool = False) -> list[str] | None:
    """Parse the ``[...]`` span (first "[" to last "]") of ``text`` as a Python list, with
    LOFT's escaping of in-word apostrophes ("the devil's sleep"); None when it does not parse.

    Items are ``str``-ed and stripped; blank items are dropped unless ``keep_empty`` (LOFT
    keeps them, and :func:`split_answer_list` does so for its LOFT-style multi-value lists).
    """
    start, end = text.find("["), text.rfind("]")
    if start == -1 or end < start:
        return None
    try:
        value = _literal_eval_quietly(_escape_single_quotes(text[start:end + 1]))
    except Exception:  # noqa: BLE001 - LOFT catches everything here too
        return None
    if not isinstance(value, (list, tuple)):
        return None
    items = [str(v).strip() for v in value]
    return items if keep_empty else [item for item in items if item]


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
        parsed = _parse_list_literal(final[0], keep_empty=True)
    elif text.startswith("[") and text.endswith("]"):
        parsed = _parse_list_literal(text, keep_empty=True)
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

_QUOTES = "'\"`"


def _strip_quotes(text: str) -> str:
    text = text.strip()
    while text and text[0] in _QUOTES:
        text = text[1:].strip()
    while text and text[-1] in _QUOTES:
        text = text[:-1].strip()
    return text


def extract_loft_prediction(model_output: str) -> list:
    """LOFT's answer list of a generation: ``extract_prediction`` in LOFT's ``utils.py``
    (google-deepmind/loft), called by ``inference/models.py`` with ``answer_prefix="output"``
    for ICL (``run_inference.py``).

    Remove every "*" and "`", strip, split on "\\n"; the first line that contains both "[" and
    "]" is the answer line, whatever precedes it: the answer prefix ("output") is not required
    (LOFT only logs a warning without it) and its case does not matter. Its text from the first
    "[" to the last "]" is ``ast.literal_eval``-ed after escaping in-word apostrophes
    (``devil's`` -> ``devil\\'s``). Returns the parsed items; ``[]`` when no line has brackets
    or when the first one that does fails to parse (LOFT does not look at later lines then).
    """
    text = model_output.replace("*", "").replace("`", "")
    for line in text.strip().split("\n"):
        if "[" in line and "]" in line:
            literal = line[line.find("["):line.rfind("]") + 1].strip()
            try:
                value = _literal_eval_quietly(_escape_single_quotes(literal))
            except Exception:  # noqa: BLE001 - LOFT: ``except Exception`` -> preds stays []
                return []
            # text from "[" to "]" evaluates to a list, or to a tuple ("[1], [2]")
            return list(value) if isinstance(value, (list, tuple)) else [value]
    return []


def icl_em(prediction: str, target: str | Sequence[str]) -> float:
    """LOFT's ICL exact match, exactly (google-deepmind/loft).

    - Parsing: :func:`extract_loft_prediction` (LOFT ``utils.py`` ``extract_prediction``,
      ``answer_prefix="output"``). No parsable list, or an empty one, scores 0
      (``evaluation/icl.py`` ``IclEvaluation.evaluate``: ``if not pred_answers: em = 0.0``).
      So a bare ``(B)`` scores 0, and so does ``Output: [(B)]`` (not a Python literal).
    - Comparison (``IclEvaluation.evaluate`` with the "icl" config of
      ``evaluation/__init__.py``): only the FIRST item counts; it is normalized with LOFT's
      :func:`normalize_answer` (``utils.normalize_answers``) and compared with ``==``
      (``utils.compute_em``) to every gold, max over golds.
    - Golds (``run_evaluation.py``): LOFT's gold for an ICL example is
      ``target.split(" ")``, every piece normalized with :func:`normalize_answer`
      (``process_goldens``); a prediction equal to any one piece scores 1. Each string of
      ``target`` is treated as such a LOFT target (the pieces of all of them are pooled).

    LOFT quirk kept on purpose: :func:`normalize_answer` deletes the article "a", so the option
    "(A)" normalizes to "" and equals every prediction that normalizes to "" ("the", "()").
    Only deviation: a non-string first item (``Output: [12]``) is compared as ``str(item)``,
    as LOFT's RAG configs do with ``utils.convert_to_str``; LOFT's ICL config would raise
    TypeError there. pced's own, more forgiving variant is :func:`icl_em_pced`.
    """
    preds = extract_loft_prediction(prediction)
    if not preds:
        return 0.0
    answer = normalize_answer(str(preds[0]))
    golds = [normalize_answer(piece) for t in _as_answer_list(target) for piece in t.split(" ")]
    return max((1.0 if gold == answer else 0.0 for gold in golds), default=0.0)


def extract_icl_answer(prediction: str) -> str:
    """The answer inside the first ``Output: [...]`` of an ICL generation (ours; used by
    :func:`icl_em_pced`, not by LOFT's :func:`icl_em`).

    The paper's ICL system prompt makes the model answer ``Output: ['your_answer_here']``.
    Accepts ``Output: ['(A)']``, ``Output: [(A)]``, ``Output: ["Yes"]`` (the bracket span runs
    to the last "]" of that line, as LOFT's parser); of a list of several items the first is
    the answer (LOFT scores only the first). Without brackets the rest of the ``Output:`` line
    is the answer; with no ``Output:`` at all, the whole stripped prediction.
    """
    marker = prediction.find("Output:")
    if marker == -1:
        return _strip_quotes(prediction)
    rest = prediction[marker + len("Output:"):].strip()
    line = rest.split("\n", 1)[0].strip()
    if line.startswith("["):
        parsed = _parse_list_literal(line)
        if parsed:
            return _strip_quotes(parsed[0])
        end = line.rfind("]")
        return _strip_quotes(line[1:end] if end > 0 else line[1:])
    return _strip_quotes(line)


def _icl_normal_form(text: str) -> str:
    return " ".join(text.lower().split())


def icl_em_pced(prediction: str, target: str | Sequence[str]) -> float:
    """pced's own ICL exact match (ours, not LOFT's; it was ``icl_em`` before that became
    LOFT's): the :func:`extract_icl_answer` answer equals the target up to case and whitespace.

    Differs from LOFT's :func:`icl_em`: it looks for a case-sensitive ``Output:`` and, without
    one, scores the whole stripped prediction (a bare "(B)" scores 1 here, 0 in LOFT); an
    unparsable ``Output: [(B)]`` still yields "(B)"; and it does not use LOFT's
    :func:`normalize_answer`, which deletes the article "a" so that "(A)" normalizes to "" and
    equals any answer that normalizes to "" too. Quotes around the target are ignored.
    """
    answer = _icl_normal_form(extract_icl_answer(prediction))
    targets = _as_answer_list(target)
    return max((1.0 if answer == _icl_normal_form(_strip_quotes(t)) else 0.0 for t in targets),
               default=0.0)


_OPTION = re.compile(r"\([A-Z]\)")
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def icl_lenient(prediction: str, target: str | Sequence[str]) -> float:
    """Ours, not LOFT's: ICL exact match that forgives a missing ``Output: [...]`` wrapper
    (small models drop it).

    With ``Output:`` present this is :func:`icl_em_pced`. Without it, the answer is the first
    option label "(X)" of the prediction, else its first "yes"/"no" word, else the whole
    prediction: "(C) 12/25/1937" answers "(C)". Only the first candidate counts, so listing
    every option does not score. A secondary metric beside the strict, LOFT one (:func:`icl_em`),
    never a replacement.
    """
    if "Output:" in prediction:
        return icl_em_pced(prediction, target)
    found = _OPTION.search(prediction) or _YES_NO.search(prediction)
    return icl_em_pced(found.group(0) if found else prediction, target)


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
        raise ValueError("classification needs all_classes=[...] (from the example's metadata)")
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
        raise ValueError(f"unknown metric {metric_name!r}; known: {', '.join(METRICS)}") from None
    if first_line:
        prediction = prediction.lstrip("\n").split("\n")[0]
    return float(scorer(prediction, _as_answer_list(answers), **kwargs))
