"""The PCED rule over every group of one engine step at once (plain torch, no vLLM import).

``decide(logits, jobs)`` takes the step's logits and, for each group that needs its next token, the
rows of the members present (a *job*), and returns the chosen tokens and their winners as device
tensors: nothing is read back here. Jobs that share a rule configuration and a shape (the number of
experts present, whether the amateur is) are one batched computation over ``[G, n, V]``; in a
server every question has the same rule and, whole, the same number of documents, so a step is
one computation whatever the number of groups.

The arithmetic is ``pced.decoding.rule``'s, operation for operation, with a leading group dimension: a
group's row of the batch is computed exactly as ``ContrastiveRule.choose`` computes it alone (the
reductions run over the same rows and the same axis), which ``tests/test_vllm_groups.py`` checks
for every rule setting. A degraded job (members missing) runs the rule over the experts present with
their frozen betas (or betas learned from this step, not frozen), the mean of the present experts'
logits standing in for a missing amateur, and the prior of the experts present.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...decoding.rule import AMATEUR, BETA_MODES, learned_beta, to_score_space


@dataclass
class Job:
    """One group's frontier in this step: the rows of the members that need the next token."""

    state: "GroupState"  # noqa: F821 - groups.GroupState (imported there; no cycle at run time)
    amateur: int | None  # the amateur's row, None when it is not scheduled at the frontier
    experts: list[tuple[int, int]]  # (expert index, row) of the experts present, by expert index

    @property
    def complete(self) -> bool:
        return self.amateur is not None and len(self.experts) == self.state.size - 1


def decide(logits: torch.Tensor, jobs: list[Job]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [G] and winners [G] (expert index, or AMATEUR) of the jobs, in their order, on the
    logits' device. Freezes the betas of a complete job that had none."""
    parts: dict[tuple, list[int]] = {}
    for position, job in enumerate(jobs):
        learning = job.state.beta is None and job.state.config.beta in BETA_MODES
        key = (job.state.config, len(job.experts), job.amateur is not None, learning)
        parts.setdefault(key, []).append(position)
    tokens, winners, order = [], [], []
    for (config, _, _, learning), positions in parts.items():
        token, winner = _decide_alike(logits, [jobs[p] for p in positions], config, learning)
        tokens.append(token)
        winners.append(winner)
        order.extend(positions)
    if len(parts) == 1:
        return tokens[0], winners[0]
    inverse = [0] * len(order)
    for place, position in enumerate(order):
        inverse[position] = place
    back = torch.tensor(inverse, dtype=torch.long).to(logits.device, non_blocking=True)
    return torch.cat(tokens).index_select(0, back), torch.cat(winners).index_select(0, back)


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return logits.index_select(0, torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True))


def _decide_alike(logits: torch.Tensor, jobs: list[Job], config, learning: bool):
    """One batched computation for jobs of one rule configuration and one shape."""
    device, vocab = logits.device, logits.shape[-1]
    count, present = len(jobs), len(jobs[0].experts)
    raw = _rows(logits, [row for job in jobs for _, row in job.experts]).view(count, present, vocab)
    if jobs[0].amateur is not None:
        amateur_raw = _rows(logits, [job.amateur for job in jobs])
    else:  # a missing amateur: the mean of the experts present stands in for it
        amateur_raw = raw.float().mean(dim=1)
    amateur = to_score_space(amateur_raw, config.score_space)
    if present == 0:  # no documents here: the amateur alone decides, as PCED does without documents
        token = torch.argmax(amateur, dim=-1)
        return token, torch.full_like(token, AMATEUR)
    experts = to_score_space(raw, config.score_space)
    picked = [tuple(k for k, _ in job.experts) for job in jobs]
    if learning:  # the first step these experts take part in: the rule's AdaCAD beta
        beta = learned_beta(config.beta, experts, amateur[:, None, :])
        for job, value in zip(jobs, beta):
            if job.complete:  # frozen from here on, as ContrastiveRule freezes it at its first step
                job.state.freeze(value.clone())
    else:
        beta = torch.stack([job.state.beta_of(keys, device) for job, keys in zip(jobs, picked)])
    prior = torch.stack([job.state.prior_of(keys) for job, keys in zip(jobs, picked)]).to(device, non_blocking=True)
    # rule.calibrate, with a group dimension in front
    if beta.dim() == 2:
        beta = beta[:, :, None]
    s_hat = (1.0 + beta) * experts - beta * amateur[:, None, :] + prior[:, :, None]
    index = torch.tensor(picked, dtype=torch.long).to(device, non_blocking=True)
    if config.aggregation == "max":  # rule.aggregate: the best expert per token; lowest expert on ties
        token = torch.argmax(s_hat.max(dim=1).values, dim=-1)
        column = s_hat.gather(2, token.view(count, 1, 1).expand(count, present, 1)).squeeze(2)
        return token, index.gather(1, torch.argmax(column, dim=1, keepdim=True)).squeeze(1)
    weights = torch.softmax(prior, dim=1)
    log_weights = torch.log(weights)
    log_p = torch.log_softmax(s_hat, dim=-1)
    if config.aggregation == "moe":
        scores = torch.logsumexp(log_p + log_weights[:, :, None], dim=1)
    else:
        scores = torch.log_softmax((weights[:, :, None] * log_p).sum(dim=1), dim=-1)
    token = torch.argmax(scores, dim=-1)
    amateur_log_p = torch.log_softmax(amateur.float(), dim=-1)
    column = log_p.gather(2, token.view(count, 1, 1).expand(count, present, 1)).squeeze(2)
    best = index.gather(1, torch.argmax(log_weights + column, dim=1, keepdim=True)).squeeze(1)
    amateur_column = amateur_log_p.gather(1, token.view(count, 1)).squeeze(1)
    return token, torch.where(amateur_column > column.max(dim=1).values, AMATEUR, best)
