"""Sampling settings: how a token is chosen from the rule's scores and when an answer stops."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import UserError

# Ranges of the sampling settings. A temperature near 0 divides the scores into infinities, and
# below 0.01 it is greedy decoding in all but name (use 0); top_p below 0.01 keeps the best token alone.
MAX_NEW_TOKENS = 131_072  # no answer is longer; the model's window is checked when the model is known
TEMPERATURE = (0.01, 10.0)
MIN_TOP_P = 0.01


@dataclass(frozen=True)
class SamplingConfig:
    """Greedy unless temperature > 0; stops on EOS, any stop string, or max_new_tokens."""

    # The one default for answer length: pced ask/chat/generate (--max-new-tokens), the server
    # (max_tokens when a request leaves it out), pced eval. 32 tokens hold the short answers that
    # retrieval QA asks for (the evaluations in docs/results.md ran with it); longer is one flag away.
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks: generate exactly max_new_tokens (the loop guard is off too)
    no_repeat_ngram: int = 0  # n > 0: never complete an n-gram the answer already holds (0 = off)
    # The loop guard (pced.decoding.repetition): the answer ends where a span of loop_span tokens or more follows
    # itself, or a span of 2 or more comes three times in a row, keeping one copy (0 = off). On every
    # answer stored in docs/results (6,728), 6 cut 72 loops and changed no score; 5 and below cut a
    # short phrase the model repeats once before the answer, costing 9 correct answers.
    loop_span: int = 6

    def __post_init__(self) -> None:
        if not is_int(self.max_new_tokens) or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise UserError(f"max_new_tokens must be an integer between 1 and {MAX_NEW_TOKENS} (and fit the model's "
                            f"window), got {self.max_new_tokens!r}")
        if not is_number(self.temperature) or not (self.temperature == 0 or TEMPERATURE[0] <= self.temperature <= TEMPERATURE[1]):
            raise UserError(f"temperature must be 0 (greedy) or between {TEMPERATURE[0]:g} and {TEMPERATURE[1]:g}, "
                            f"got {self.temperature!r}")
        if not is_number(self.top_p) or not MIN_TOP_P <= self.top_p <= 1:
            raise UserError(f"top_p must be between {MIN_TOP_P:g} and 1, got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise UserError(f"top_k (sampling) must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise UserError(f"seed must be an integer between 0 and 2**63 - 1, got {self.seed!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise UserError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        if not is_int(self.no_repeat_ngram) or not 0 <= self.no_repeat_ngram <= MAX_NEW_TOKENS:
            raise UserError(f"no_repeat_ngram must be an integer >= 0 (0 = off), got {self.no_repeat_ngram!r}")
        if not is_int(self.loop_span) or not (self.loop_span == 0 or 2 <= self.loop_span <= MAX_NEW_TOKENS):
            raise UserError(f"loop_span must be 0 (off) or an integer of at least 2, got {self.loop_span!r}")


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A real, finite number (bools and NaN are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
