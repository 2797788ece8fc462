"""Sampling settings: how a token is chosen from the rule's scores and when an answer stops."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingConfig:
    """Greedy unless temperature > 0; stops on EOS, any stop string, or max_new_tokens."""

    # The one default for answer length: pced ask/chat/generate (--max-new-tokens), the server
    # (max_tokens when a request leaves it out), pced eval. 32 tokens hold the short answers that
    # retrieval QA asks for (the evaluations in README "Results" ran with it); longer is one flag away.
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks: generate exactly max_new_tokens
    no_repeat_ngram: int = 0  # n > 0: never complete an n-gram the answer already holds (0 = off)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("need temperature >= 0, 0 < top_p <= 1 and top_k >= 0")
        if isinstance(self.no_repeat_ngram, bool) or not isinstance(self.no_repeat_ngram, int) or self.no_repeat_ngram < 0:
            raise ValueError(f"no_repeat_ngram must be an integer >= 0 (0 = off), got {self.no_repeat_ngram!r}")
