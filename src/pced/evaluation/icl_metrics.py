"""ICL exact match: LOFT's (``icl_em``, with ``extract_loft_prediction``) and our own variants
(``icl_em_pced``, ``icl_lenient``) for the paper's ``Output: ['...']`` answer format."""

from __future__ import annotations

import re
from collections.abc import Sequence

from pced.evaluation.answer_lists import as_answer_list, escape_single_quotes, literal_eval_quietly, parse_list_literal
from pced.evaluation.normalize import normalize_answer


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
                value = literal_eval_quietly(escape_single_quotes(literal))
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
    golds = [normalize_answer(piece) for t in as_answer_list(target) for piece in t.split(" ")]
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
        parsed = parse_list_literal(line)
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
    targets = as_answer_list(target)
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
