"""The rule's settings (``RuleConfig``, the paper's defaults written once) and the names and ranges
they take, apart from the rule itself (``pced.decoding.rule``, which computes with torch): the command line,
the server's schemas and ``AskOptions`` read these without loading torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from ..errors import UserError

R_MIN, R_MAX = 1e-8, 1.0 - 1e-8
AMATEUR = -1
AGGREGATIONS = ("max", "moe", "poe")
SCORE_SPACES = ("logits", "logprobs")
BETA_MODES = ("dynamic", "elementwise")
PRIORS = ("log", "standardized")
# Standardized prior: the smallest spread of log r divided by. Differences below a thousandth of a
# nat are rounding, not evidence; the narrowest retriever we measured (BM25) spreads ~0.08 nats.
SPREAD_FLOOR = 1e-3
# Ranges of the rule's numbers. The dynamic beta is a JSD (at most ln 2) and the authors' element-wise
# one is clamped to [0, 1]: a fixed beta of 10 is already far past either; a gamma of 1000 lets the
# prior alone decide (the paper's is 2.5, SmolLM2's 32). Beyond them the scores overflow float32.
MAX_BETA = 10.0
MAX_GAMMA = 1000.0

Beta = Union[str, float]


@dataclass(frozen=True)
class RuleConfig:
    """The paper's defaults, written once."""

    beta: Beta = "dynamic"
    gamma: float = 2.5
    aggregation: str = "max"
    score_space: str = "logits"
    prior: str = "log"

    def __post_init__(self) -> None:
        if isinstance(self.beta, str) and self.beta not in BETA_MODES:
            raise UserError(f"beta must be a number or one of {', '.join(BETA_MODES)}, got {self.beta!r}")
        if not isinstance(self.beta, str) and (isinstance(self.beta, bool) or not isinstance(self.beta, (int, float))
                                               or not 0 <= self.beta <= MAX_BETA):
            raise UserError(f"beta must be {' or '.join(BETA_MODES)} or a number between 0 and {MAX_BETA:g}, got {self.beta!r}")
        if self.aggregation not in AGGREGATIONS:
            raise UserError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {self.aggregation!r}")
        if self.score_space not in SCORE_SPACES:
            raise UserError(f"score_space must be one of {', '.join(SCORE_SPACES)}, got {self.score_space!r}")
        if self.prior not in PRIORS:
            raise UserError(f"prior must be one of {', '.join(PRIORS)}, got {self.prior!r}")
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, (int, float)) or not 0 <= self.gamma <= MAX_GAMMA:
            raise UserError(f"gamma must be a number between 0 and {MAX_GAMMA:g}, got {self.gamma!r}")
