"""How a group's decisions travel from the logits processor (in vLLM's worker processes) to pced.

The processor forces every row of a group to the chosen token by setting every other logit to
-inf. The chosen token's own logit can then be any finite number without changing what the greedy
sampler picks, so the processor writes a *carrier* value there:

- the amateur's row (member 0) carries the step's record: who won the token, and whether the step
  was decided without every member present (``record_value``);
- the expert row of document k carries beta_k, the group's frozen beta for that expert (for the
  element-wise beta its mean over the vocabulary, what ``ContrastiveRule.betas`` reports), or
  ``UNKNOWN`` while no complete step has frozen the betas.

vLLM brings that number back unchanged. With ``logprobs_mode="processed_logits"`` a greedy batch
returns the logits after the logits processors as the "logprobs" (``v1/sample/sampler.py:264-274``;
a batch with random requests too: ``v1/sample/ops/topk_topp_sampler.py:328-331``, after dividing a
greedy row by a temperature of 1, ``sampler.py:236-239``), and ``logprobs=0`` asks for the sampled
token's alone, gathered as it is (``sampler.py:337-341``); Model Runner V2 gathers the same
(``v1/worker/gpu/sample/logprob.py:130-131``). The float32 array crosses from the engine core to pced's process
as raw bytes with its dtype (``v1/serial_utils.py:236-254``, decoded with ``np.frombuffer`` at
``:388-395``) and becomes a Python float through ``ndarray.tolist()``
(``v1/engine/logprobs.py:91-93``): a float32 converted to a double is exact. Every carrier is a
float32: a winner index is an integer far below 2**24 (exact), and a beta is the float32 the rule
computed (the transformers backend reports ``float()`` of the same float32), so the trace and the
betas arrive bit for bit. Each ``CompletionOutput.logprobs`` entry is aligned with its
``token_ids`` (also under ``RequestOutputKind.DELTA``: ``v1/engine/output_processor.py:444-451``).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ...decoding.rule import AMATEUR

UNKNOWN = -1.0  # an expert's carrier before the betas are frozen (a JSD, a clamp to [0, 1] or a fixed beta is >= 0)
LOST = math.inf  # every row of a group whose state the engine no longer has (never expected; the question fails)


class GroupLost(RuntimeError):
    """The engine decided a row without its group's state: the question cannot go on."""


def record_value(winner: int, degraded: bool) -> float:
    """The amateur's carrier for one token: winner + 1 (0 = the amateur won), negated minus one
    when the step was degraded, so the two cases never share a value."""
    code = winner - AMATEUR
    return float(-(code + 1) if degraded else code)


def record_values(winners: torch.Tensor, degraded: torch.Tensor) -> torch.Tensor:
    """``record_value`` on the device, for a step's decided groups (winners [G] long, degraded [G] bool)."""
    code = winners - AMATEUR
    return torch.where(degraded, -(code + 1), code).to(torch.float32)


def read_record(value: float) -> tuple[int, bool]:
    """(winner, degraded) from the amateur's carrier."""
    if not math.isfinite(value):
        raise GroupLost("the vLLM engine lost this question's group state (its rows were decided without it)")
    code = int(value)
    return (-code - 1 + AMATEUR, True) if code < 0 else (code + AMATEUR, False)


def degraded_steps(records: Sequence[float]) -> int:
    """How many of the amateur's carriers say their step was degraded."""
    return sum(1 for value in records if math.isfinite(value) and value < 0)


def read_betas(values: Sequence[float]) -> list[float]:
    """The group's betas from each expert's latest carrier ([] while they are not frozen)."""
    if any(not math.isfinite(v) for v in values):
        raise GroupLost("the vLLM engine lost this question's group state (its rows were decided without it)")
    if not values or any(v == UNKNOWN for v in values):
        return []
    return list(values)


def carriers(completion) -> list[float]:
    """The carrier of each new token of a ``CompletionOutput``: the chosen token's processed logit."""
    if completion.logprobs is None:
        return []
    return [float(entry[token].logprob) for token, entry in zip(completion.token_ids, completion.logprobs)]
