"""PCED on a serving engine's batch: the group decision, in plain torch (no vLLM import).

A PCED question is N+1 requests of the engine, one *group*: member 0 the amateur
(prefix + question), member k the expert of document k (prefix + document_k + question). Every
engine step hands the logits processor one row per scheduled request. For each group this module

- forces every row that lags behind the group's *tape* (the tokens already chosen for it) to its
  next tape token, so a member scheduled late catches up on exactly what the others saw;
- at the frontier (rows that need the next new token) runs the PCED rule over the members present
  (``batch.decide``: every group of the step in one batched computation), appends the chosen token
  to the tape and forces every frontier row to it.

A frontier step with every member present is *complete*: the same computation as the transformers
backend's step. One with members missing (not scheduled in this step, preempted) is *degraded*
(see ``batch``) and counted as such. Forcing = every logit of the row set to -inf but the chosen
token's, which holds the row's carrier (``channel``): the amateur's row the step's winner, an
expert's row its beta. One masked write for all rows, and one read of the device per step: the
decided tokens and winners, which the tape (on the host) needs.

The group states live in the processor, in whichever process vLLM runs it (with tensor
parallelism, one copy per rank, each deciding the same from the same logits): a ``GroupTable``
opens a group when its first member arrives, from that request's ``extra_args`` alone, and keeps
it while any member is in the batch. vLLM removes a request from its batch when it finishes and
also when it is only left unscheduled for a step or preempted (``v1/worker/gpu_model_runner.py:
1213-1233``), so a group whose members all left is parked, not dropped: the most recent
``PARKED_GROUPS`` are kept for members that come back.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

import torch

from ...decoding.rule import BETA_MODES, RuleConfig, prior_term
from . import channel
from .batch import Job, decide

PCED_KEY = "pced"  # SamplingParams.extra_args[PCED_KEY] = GroupMember.to_args()
PARKED_GROUPS = 1024  # groups whose members all left the batch, kept for those that come back


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
    config: RuleConfig
    relevance: torch.Tensor  # [N] float32, on the host
    tape: list[int] = field(default_factory=list)
    winners: list[int] = field(default_factory=list)  # expert index per tape token, AMATEUR = -1
    records: list[float] = field(default_factory=list)  # the amateur's carrier per tape token
    beta: torch.Tensor | None = None  # [N] or [N, V], frozen (or fixed), on the logits' device
    carrier: torch.Tensor | None = None  # [N] float32: what each expert's row carries
    degraded: int = 0  # frontier steps decided without every member present
    complete: int = 0
    _priors: dict = field(default_factory=dict)

    @classmethod
    def start(cls, member: GroupMember) -> GroupState:
        state = cls(len(member.relevance) + 1, member.rule, torch.tensor(member.relevance, dtype=torch.float32))
        if member.rule.beta not in BETA_MODES:  # a fixed beta: known before any step
            state.freeze(torch.full((len(member.relevance),), float(member.rule.beta)))
        return state

    def freeze(self, beta: torch.Tensor) -> None:
        self.beta = beta
        self.carrier = (beta if beta.dim() == 1 else beta.mean(dim=-1)).to(torch.float32)

    def beta_of(self, experts: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The frozen betas of those experts, on the logits' device (moved there once)."""
        if self.beta.device != device:
            self.freeze(self.beta.to(device))
        if len(experts) == self.size - 1:
            return self.beta
        return self.beta.index_select(0, torch.tensor(experts, dtype=torch.long).to(device, non_blocking=True))

    def prior_of(self, experts: tuple[int, ...]) -> torch.Tensor:
        """The rule's prior over those experts ([n] float32, host): computed over the experts
        present, as the rule computes it over its current experts (a standardized prior depends on
        which they are)."""
        if experts not in self._priors:
            relevance = self.relevance[list(experts)]
            self._priors[experts] = prior_term(relevance, self.config.gamma, self.config.prior)
        return self._priors[experts]

    def betas(self) -> list[float]:
        return [] if self.carrier is None else self.carrier.tolist()


class GroupTable:
    """The groups of one logits processor: opened by their members' arrival, parked when every
    member has left the batch, dropped oldest first past ``parked`` parked groups."""

    def __init__(self, parked: int = PARKED_GROUPS) -> None:
        self.live: dict[str, GroupState] = {}
        self.rows: dict[str, int] = {}  # members of each live group in the batch
        self.parked: OrderedDict[str, GroupState] = OrderedDict()
        self.limit = parked

    def join(self, member: GroupMember) -> None:
        group = member.group
        if group not in self.live:
            self.live[group] = self.parked.pop(group, None) or GroupState.start(member)
        self.rows[group] = self.rows.get(group, 0) + 1

    def leave(self, member: GroupMember) -> None:
        group = member.group
        self.rows[group] -= 1
        if self.rows[group] == 0:
            del self.rows[group]
            self.parked[group] = self.live.pop(group)
            while len(self.parked) > self.limit:
                self.parked.popitem(last=False)

    def get(self, group: str) -> GroupState | None:
        return self.live.get(group)


def apply_groups(logits: torch.Tensor, rows: Iterable[Row], table: GroupTable) -> torch.Tensor:
    """Decide and force the tokens of every PCED group in one engine step (in place)."""
    by_group: dict[str, list[Row]] = {}
    for row in rows:
        by_group.setdefault(row.member.group, []).append(row)
    jobs: list[Job] = []
    lagging: list[tuple[Row, GroupState]] = []
    lost: list[int] = []
    for group, members in by_group.items():
        state = table.get(group)
        if state is None or any(row.generated > len(state.tape) for row in members):
            lost.extend(row.index for row in members)  # never expected: the question is failed, not the engine
            continue
        frontier = sorted((row for row in members if row.generated == len(state.tape)), key=lambda r: r.member.member)
        if frontier:
            amateur = frontier[0].index if frontier[0].member.member == 0 else None
            jobs.append(Job(state, amateur, [(r.member.member - 1, r.index) for r in frontier if r.member.member > 0]))
        lagging.extend((row, state) for row in members if row.generated < len(state.tape))
    if jobs:
        tokens, winners = decide(logits, jobs)
        degraded = torch.tensor([not job.complete for job in jobs]).to(logits.device, non_blocking=True)
        records = channel.record_values(winners, degraded)
    else:
        tokens = winners = records = None
    force(logits, jobs, tokens, records, lagging, lost)
    if jobs:  # the step's one read: the tape lives on the host
        decided = torch.cat([tokens, winners]).tolist()
        for job, token, winner in zip(jobs, decided[: len(jobs)], decided[len(jobs):]):
            state = job.state
            state.tape.append(token)
            state.winners.append(winner)
            state.records.append(channel.record_value(winner, not job.complete))
            if job.complete:
                state.complete += 1
            else:
                state.degraded += 1
    return logits


class _Pool:
    """Values for the forced rows: device tensors (kept there) and host scalars (one copy)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.parts: list[torch.Tensor] = []
        self.size = 0
        self.host: list = []
        self.dtype = dtype

    def tensor(self, values: torch.Tensor) -> int:
        """Add a device tensor; returns the index of its first element."""
        self.parts.append(values.to(self.dtype))
        self.size += len(values)
        return self.size - len(values)

    def scalar(self, value) -> int:
        self.host.append(value)
        return -len(self.host)  # resolved past the device tensors in ``pick``

    def pick(self, picks: list[int], device: torch.device) -> torch.Tensor:
        host = torch.tensor(self.host, dtype=self.dtype).to(device, non_blocking=True)
        index = [p if p >= 0 else self.size - p - 1 for p in picks]
        return torch.cat([*self.parts, host]).index_select(0, torch.tensor(index).to(device, non_blocking=True))


def force(logits: torch.Tensor, jobs: list[Job], tokens, records, lagging: list[tuple[Row, GroupState]],
          lost: list[int]) -> None:
    """Every logit of the rows -inf but the chosen token's, which holds the row's carrier. Decided
    tokens and carriers stay on the device; the rest come from the host, one copy each."""
    device = logits.device
    token_pool, value_pool = _Pool(torch.long), _Pool(torch.float32)
    rows, token_picks, value_picks = [], [], []
    carriers: dict[int, int] = {}  # id(state) -> where its experts' carriers start in value_pool
    decided = token_pool.tensor(tokens) if jobs else 0
    recorded = value_pool.tensor(records) if jobs else 0

    def carrier(state: GroupState, expert: int) -> int:
        if state.carrier is None:
            return value_pool.scalar(channel.UNKNOWN)
        if id(state) not in carriers:
            carriers[id(state)] = value_pool.tensor(state.carrier.to(device))
        return carriers[id(state)] + expert

    for position, job in enumerate(jobs):
        for member, row in ([(0, job.amateur)] if job.amateur is not None else []) + [(k + 1, r) for k, r in job.experts]:
            rows.append(row)
            token_picks.append(decided + position)
            value_picks.append(recorded + position if member == 0 else carrier(job.state, member - 1))
    for row, state in lagging:  # replays: the tape's token, and what it carried then (betas: now)
        rows.append(row.index)
        token_picks.append(token_pool.scalar(state.tape[row.generated]))
        member = row.member.member
        value_picks.append(value_pool.scalar(state.records[row.generated]) if member == 0 else carrier(state, member - 1))
    if lost:  # each row's own greedy token, carrying LOST: the question fails, the engine goes on
        own = token_pool.tensor(torch.argmax(logits.index_select(0, torch.tensor(lost).to(device)), dim=-1))
        rows.extend(lost)
        token_picks.extend(range(own, own + len(lost)))
        value_picks.extend(value_pool.scalar(channel.LOST) for _ in lost)
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)
    chosen, value = token_pool.pick(token_picks, device), value_pool.pick(value_picks, device)
    logits.index_fill_(0, index, float("-inf"))
    logits.index_put_((index, chosen), value.to(logits.dtype))
