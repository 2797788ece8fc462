"""Loops: an answer that starts repeating itself back to back ends there, the repeat cut off.

Small models fall into loops ("a suburb of Ashwood City, a suburb of Ashwood City, ..." to the
token limit). ``LoopGuard`` watches the tokens of one answer as they are chosen: a span of at
least ``min_span`` tokens followed by the same span, or a span of 2 or more tokens three times
in a row, is a loop, if it holds a letter and more than one distinct token: digits and
punctuation repeat in numbers ("1,000,000,000"), a token repeats in "000". The answer then
keeps one copy and ends. A span repeated only once and
shorter than ``min_span`` is not a loop: names repeat ("Bora Bora"), and the embedded model
sometimes writes a short phrase twice and then the answer ("The Little Couple: The Little Couple:
September 19, 2017"); ``docs/results.md`` measures the threshold on every stored answer.

Tokens are compared by a key, not an id, so that the same word with and without its leading
space is the same token (``key_of``): a loop that starts the answer ("Kenji Fujimori Kenji
Fujimori ...", the first without a space) is then cut between two words, not inside one.

The guard is a stop rule, not a change to the scores: the tokens before the cut are the ones the
answer had without it, and it runs wherever the loop sees the chosen tokens (every backend,
vLLM's included). Because a loop is only certain once its second copy is complete, the loop
holds back the tokens that may yet turn out to be a repeat (``held``) and streams them once the
repeat breaks; the stream is therefore always exactly the final answer.
"""

from __future__ import annotations

import numpy as np

SHORT_SPAN = 2  # spans below min_span count as a loop at three copies, but never a single token ("0 0 0")


def key_of(tokenizer, token: int) -> str:
    """What a token is compared by: its text without surrounding whitespace, or the text itself
    when it is only whitespace. A token that decodes to an incomplete character keeps its id:
    different byte tokens all read as U+FFFD and must not look alike."""
    text = tokenizer.decode([token], skip_special_tokens=False)
    if "\ufffd" in text:
        return f"#{token}"
    return text.strip() or text


class LoopGuard:
    """The loop detector of one answer. ``push`` each chosen token's key; when it returns True the
    answer loops and ``keep`` is how many of its tokens stay. ``held`` is how many of the last
    tokens a loop found later could still cut off (stream only the ones before them)."""

    def __init__(self, min_span: int, capacity: int):
        if min_span < SHORT_SPAN:
            raise ValueError(f"min_span must be at least {SHORT_SPAN}, got {min_span}")
        self.min_span = min_span
        self.codes: dict[str, int] = {}
        self.letters: list[bool] = []  # by code: whether the token holds a letter
        self.tokens = np.empty(capacity, dtype=np.int64)
        # runs[p - 1]: how many tokens in a row, ending at the last one, equal the token p before them
        self.runs = np.zeros(capacity, dtype=np.int64)
        periods = np.arange(1, capacity + 1)
        self.periods = periods
        self.needed = np.where(periods >= min_span, periods, 2 * periods)  # repeats that make a loop
        self.needed[periods < SHORT_SPAN] = capacity + 1  # never
        self.length = 0
        self.keep: int | None = None

    def push(self, key: str) -> bool:
        code = self.codes.setdefault(key, len(self.codes))
        if code == len(self.letters):
            self.letters.append(any(char.isalpha() for char in key))
        n = self.length
        if n == len(self.tokens):
            raise ValueError("LoopGuard: more tokens than its capacity")
        if n:
            same = self.tokens[:n][::-1] == code  # the token 1, 2, ..., n before this one
            self.runs[:n] = np.where(same, self.runs[:n] + 1, 0)
        self.tokens[n] = code
        self.length = n + 1
        for period in np.flatnonzero(self.runs[:n] >= self.needed[:n]) + 1:
            if self.is_loop(period):
                self.keep = self.length - int(self.runs[period - 1])
                return True
        return False

    def is_loop(self, period: int) -> bool:
        span = self.tokens[self.length - period : self.length]
        return len(set(span.tolist())) > 1 and any(self.letters[code] for code in span.tolist())

    @property
    def held(self) -> int:
        """Tokens at the end that a loop completing later would cut off (0 when nothing repeats)."""
        n = self.length - 1
        if n < SHORT_SPAN:
            return 0
        return int(self.runs[SHORT_SPAN - 1 : n].max(initial=0))
