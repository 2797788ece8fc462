"""Citations from the trace: which documents each sentence of an answer is made of.

Every PCED token has a winner (a document, or the amateur). An answer is split into sentences;
a sentence cites each document that won at least ``CitationRule.min_share`` of its characters
(whitespace not counted; a token split across two sentences counts in each for the characters it
puts there). The amateur has no document, so it is never cited: its characters count in the
denominator, and a sentence the model wrote from no document cites nothing. Methods without
per-token attribution (all, single, ape, mapreduce: every doc_id null) cite nothing either.

Sentences: a rule, not a library. Answers are short generated English; nltk's punkt needs a
data download (no network at run time) and pysbd is a dependency for a handful of cases. The
rule: a sentence ends at a line break, or at ``.``, ``!``, ``?`` or ``…`` (with closing quotes or
brackets) followed by whitespace or the end, unless the period closes a known abbreviation
("Dr.", "e.g.", "U.S.") or a single capital initial ("J. R. R. Tolkien"), or the next word starts
in lower case ("approx. five"). Decimals ("3.5") never split: no whitespace follows their period.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

ABBREVIATIONS = frozenset("""
mr mrs ms dr prof sr jr st mt ft vs etc e.g i.e cf al approx ca no nos vol pp fig eq inc ltd co corp
jan feb mar apr jun jul aug sep sept oct nov dec u.s u.k u.n a.m p.m b.c a.d
""".split())
_END = re.compile(r"[.!?\u2026]+[\"'\u201d\u2019)\]]*(?=\s|$)|\n")
_WORD_BEFORE = re.compile(r"([\w]+(?:\.[\w]+)*)$")


@dataclass(frozen=True)
class CitationRule:
    """A sentence cites a document that won at least ``min_share`` of its non-space characters
    (the amateur is never cited). 0.2: a sentence stitched from two documents cites both, while a
    document that won a stray word or two of a longer sentence is not its source."""

    min_share: float = 0.2

    def __post_init__(self) -> None:
        if not 0 < self.min_share <= 1:
            raise ValueError(f"min_share must be in (0, 1], got {self.min_share}")


@dataclass
class Citation:
    start: int  # character offsets into the answer text: text == answer[start:end]
    end: int
    text: str
    doc_ids: list[str]  # most characters first

    def json(self) -> dict:
        return {"start": self.start, "end": self.end, "text": self.text, "doc_ids": self.doc_ids}


def _is_boundary(text: str, match: re.Match) -> bool:
    if match.group() == "\n":
        return True
    after = text[match.end():].lstrip()
    if after[:1].islower():
        return False
    if match.group().startswith(".") and len(match.group().rstrip("\"'\u201d\u2019)]")) == 1:
        word = _WORD_BEFORE.search(text, 0, match.start())
        if word and (word.group(1).lower() in ABBREVIATIONS or (len(word.group(1)) == 1 and word.group(1).isupper())):
            return False
    return True


def split_sentences(text: str) -> list[tuple[int, int]]:
    """(start, end) of each sentence, trimmed of surrounding whitespace; together they hold every
    non-space character of ``text``."""
    spans, start = [], 0
    for match in _END.finditer(text):
        if _is_boundary(text, match):
            _add(spans, text, start, match.end())
            start = match.end()
    _add(spans, text, start, len(text))
    return spans


def _add(spans: list, text: str, start: int, end: int) -> None:
    piece = text[start:end]
    if piece.strip():
        lead = len(piece) - len(piece.lstrip())
        spans.append((start + lead, start + len(piece.rstrip())))


def cite(text: str, pieces: Sequence[tuple[str, str | None]], rule: CitationRule = CitationRule()) -> list[Citation]:
    """One citation per sentence of ``text``; ``pieces``: (token text, winning doc_id or None) in
    order, whose texts concatenate to ``text``."""
    owners: list[str | None] = []  # the winner of each character
    for piece, doc_id in pieces:
        owners.extend([doc_id] * len(piece))
    owners = (owners + [None] * len(text))[: len(text)]
    citations = []
    for start, end in split_sentences(text):
        counts: dict[str | None, int] = {}
        for position in range(start, end):
            if not text[position].isspace():
                counts[owners[position]] = counts.get(owners[position], 0) + 1
        total = sum(counts.values())
        cited = [d for d, n in sorted(counts.items(), key=lambda item: -item[1])
                 if d is not None and n / total >= rule.min_share]
        citations.append(Citation(start, end, text[start:end], cited))
    return citations


def cite_answer(answer, rule: CitationRule = CitationRule()) -> list[Citation]:
    """Citations of a ``pced.text.answers.Answer`` from its trace."""
    return cite(answer.text, [(step.text, step.doc_id) for step in answer.trace], rule)


def sources(citations: Sequence[Citation]) -> list[str]:
    """Every cited doc_id once, in order of first citation: the numbering of markers [1], [2], ..."""
    return list(dict.fromkeys(d for c in citations for d in c.doc_ids))
