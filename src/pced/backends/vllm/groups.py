"""PCED on a serving engine's batch: the group decision, in plain torch (no vLLM import).

A PCED question is N+1 requests of the engine, one *group*: member 0 the amateur
(prefix + question), member k the expert of document k (prefix + document_k + question). Every
engine step hands the logits processor one row per scheduled request. For each group this module

- forces every row that lags behind the group's *tape* (the tokens already chosen for it) to its
  next tape token, so a member scheduled late catches up on exactly what the others saw;
- at the frontier (rows that need the next new token) runs the PCED rule (``pced.rule``) over the
  members present, appends the chosen token to the tape and forces every frontier row to it.

A frontier step with every member present is *complete*: the same computation as the transformers
backend's step. One with members missing (not scheduled in this step, preempted) is *degraded*:
the rule runs over the present experts (with their frozen betas when known; the mean of the
present experts stands in for a missing amateur) and the step is counted in ``degraded``.
Forcing = every logit of the row set to -inf but the chosen token's (0), so the engine's greedy
sampler emits the chosen token in every row of the group; one masked write per step for all rows.

The states live in a ``GroupRegistry`` that the engine owns: the caller opens a group before its
requests are submitted and closes it when the answer ends. Rows of a group that is not open (closed
while a step was in flight, before the engine processed the abort) are left as they are: those
requests are being aborted and their tokens are read by no one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

import torch

from ...rule import AMATEUR, ContrastiveRule, RuleConfig

PCED_KEY = "pced"  # SamplingParams.extra_args[PCED_KEY] = GroupMember.to_args()


@dataclass(frozen=True)
class GroupMember:
    """What one request carries (in ``SamplingParams.extra_args``) to join its group."""

    group: str
    member: int  # 0 = amateur, k = the expert of the k-th candidate
    relevance: tuple[float, ...]  # r_1..r_N of the group's experts
    rule: RuleConfig

    def to_args(self) -> dict:
        r = self.rule
        return {PCED_KEY: {"group": self.group, "member": self.member, "relevance": list(self.relevance),
                           "rule": {"beta": r.beta, "gamma": r.gamma, "aggregation": r.aggregation,
                                    "score_space": r.score_space, "prior": r.prior}}}

    @classmethod
    def from_args(cls, extra_args: dict | None) -> GroupMember | None:
        spec = (extra_args or {}).get(PCED_KEY)
        if spec is None:
            return None
        try:
            member = cls(str(spec["group"]), int(spec["member"]), tuple(float(r) for r in spec["relevance"]),
                         RuleConfig(**spec["rule"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed pced request arguments: {exc}") from None
        if not 0 <= member.member <= len(member.relevance):
            raise ValueError(f"pced member {member.member} outside its group of {len(member.relevance) + 1}")
        return member


class Row(NamedTuple):
    """One logits row of a step: its index in the batch, its group member, tokens it has generated."""

    index: int
    member: GroupMember
    generated: int


@dataclass
class GroupState:
    """One question's decisions so far: the tape, who won each token, the frozen betas."""

    size: int  # N + 1 requests
    rule: ContrastiveRule
    tape: list[int] = field(default_factory=list)
    winners: list[int] = field(default_factory=list)  # expert index per tape token, AMATEUR = -1
    degraded: int = 0  # frontier steps decided without every member present
    complete: int = 0

    @classmethod
    def start(cls, member: GroupMember) -> GroupState:
        return cls(len(member.relevance) + 1, ContrastiveRule(member.rule, torch.tensor(member.relevance)))

    def betas(self) -> list[float]:
        return self.rule.betas()


def decide(state: GroupState, frontier: dict[int, torch.Tensor]) -> tuple[int, int]:
    """The next token and its winner from the frontier rows' logits {member: [V]}."""
    experts = sorted(m for m in frontier if m > 0)
    if len(frontier) == state.size:
        choice = state.rule.choose(torch.stack([frontier[m] for m in range(state.size)]))
        return choice.token, choice.winner
    if not experts:  # only the amateur is here: it decides alone, as PCED does without documents
        return int(torch.argmax(frontier[0])), AMATEUR
    amateur = frontier[0] if 0 in frontier else torch.stack([frontier[m] for m in experts]).float().mean(dim=0)
    picked = torch.tensor([m - 1 for m in experts])
    sub = ContrastiveRule(state.rule.config, state.rule.relevance[picked])
    if state.rule.beta is not None:  # frozen (or fixed) betas of the experts present
        sub.beta = state.rule.beta[picked]
    choice = sub.choose(torch.stack([amateur] + [frontier[m] for m in experts]))
    return choice.token, AMATEUR if choice.winner == AMATEUR else experts[choice.winner] - 1


class GroupRegistry:
    """The open groups of one engine, shared by the caller's threads (open, close) and the engine's
    thread (the processor's step), under one lock."""

    def __init__(self) -> None:
        self._states: dict[str, GroupState] = {}
        self._lock = threading.Lock()

    def open(self, group: str, state: GroupState) -> GroupState:
        """Decide the group's rows from now on, into ``state``."""
        with self._lock:
            if group in self._states:
                raise ValueError(f"pced group {group} is already open")
            self._states[group] = state
        return state

    def close(self, group: str) -> GroupState | None:
        """Stop deciding the group's rows (a step already in flight leaves them as they are)."""
        with self._lock:
            return self._states.pop(group, None)

    def open_states(self, groups: Iterable[str]) -> dict[str, GroupState]:
        """The states of those groups that are open now."""
        with self._lock:
            return {g: self._states[g] for g in set(groups) if g in self._states}

    def __len__(self) -> int:
        with self._lock:
            return len(self._states)


def apply_groups(logits: torch.Tensor, rows: Iterable[Row], groups: GroupRegistry) -> torch.Tensor:
    """Decide and force the tokens of every open PCED group in one engine step (in place). The
    only reads of the device are the rule's own (one choice per group and step); the forcing is one
    masked write from host-built indices."""
    by_group: dict[str, list[Row]] = {}
    for row in rows:
        by_group.setdefault(row.member.group, []).append(row)
    states = groups.open_states(by_group)
    forced_rows: list[int] = []
    forced_tokens: list[int] = []
    for group, members in by_group.items():
        state = states.get(group)
        if state is None:  # closed (abandoned question) or never opened: not ours to decide any more
            continue
        frontier = {row.member.member: logits[row.index] for row in members if row.generated == len(state.tape)}
        if frontier:
            token, winner = decide(state, frontier)
            if len(frontier) == state.size:
                state.complete += 1
            else:
                state.degraded += 1
            state.tape.append(token)
            state.winners.append(winner)
        for row in members:  # lagging rows follow the tape; frontier rows take the token just chosen
            if row.generated >= len(state.tape):
                raise RuntimeError(f"pced group {group}: a row is ahead of its group's tape (state lost)")
            forced_rows.append(row.index)
            forced_tokens.append(state.tape[row.generated])
    if forced_rows:
        force_rows(logits, forced_rows, forced_tokens)
    return logits


def force_rows(logits: torch.Tensor, rows: list[int], tokens: list[int]) -> None:
    """Every logit of those rows -inf but the chosen token's (0): the greedy sampler emits it. The
    indices go to the device as one host-to-device copy each; nothing comes back."""
    index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
    chosen = torch.tensor(tokens, dtype=torch.long).to(logits.device, non_blocking=True)
    logits.index_fill_(0, index, float("-inf"))
    logits.index_put_((index, chosen), torch.zeros((), dtype=logits.dtype, device=logits.device))
