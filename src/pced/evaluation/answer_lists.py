"""Answer lists: gold answers as a list, and Python-list literals in model output parsed as LOFT
does (shared by the multi-value metrics and LOFT's ICL parsing)."""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Sequence


def as_answer_list(answers: str | Sequence[str]) -> list[str]:
    return [answers] if isinstance(answers, str) else [str(a) for a in answers]


# --------------------------------------------------------------------------- LOFT


def escape_single_quotes(text: str) -> str:
    """LOFT ``utils.extract_prediction._escape_single_quotes``: ``devil's`` -> ``devil\\'s``."""
    return re.sub(r"([a-zA-Z0-9])'([a-zA-Z0-9])", r"\1\\'\2", text)


def literal_eval_quietly(literal: str) -> object:
    with warnings.catch_warnings():  # e.g. SyntaxWarning on "\d" inside a string item
        warnings.simplefilter("ignore")
        return ast.literal_eval(literal)


def parse_list_literal(text: str, *, keep_empty: bool = False) -> list[str] | None:
    """Parse the ``[...]`` span (first "[" to last "]") of ``text`` as a Python list, with
    LOFT's escaping of in-word apostrophes ("the devil's sleep"); None when it does not parse.

    Items are ``str``-ed and stripped; blank items are dropped unless ``keep_empty`` (LOFT
    keeps them, and :func:`split_answer_list` does so for its LOFT-style multi-value lists).
    """
    start, end = text.find("["), text.rfind("]")
    if start == -1 or end < start:
        return None
    try:
        value = literal_eval_quietly(escape_single_quotes(text[start:end + 1]))
    except Exception:  # noqa: BLE001 - LOFT catches everything here too
        return None
    if not isinstance(value, (list, tuple)):
        return None
    items = [str(v).strip() for v in value]
    return items if keep_empty else [item for item in items if item]
