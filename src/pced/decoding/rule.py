"""The retrieval-aware contrastive rule of PCED (paper §3), on plain tensors.

The rule does not know where logits come from: it takes the amateur's scores ``s0 [V]``, the
contextual experts' scores ``s [N, V]`` and their relevances ``r [N]``, and returns one token
and the expert that won it. Any engine (every backend, ``pced.backend``) drives it.

Per step, for every contextual expert k (after the optional log-softmax of ``score_space``)::

    s_hat_k = (1 + beta_k) * s_k - beta_k * s0 + prior_k

prior (``prior_term``; l_k = log(clip(r_k, 1e-8, 1 - 1e-8)) over the question's current experts):

- ``log`` (paper): prior_k = gamma * l_k.
- ``standardized``: prior_k = gamma * (l_k - max_j l_j) / max(std(l), SPREAD_FLOOR), std over the
  experts (population): gamma logits per standard deviation below the best expert. Scale-free:
  r -> c * r and r -> r**c (c > 0) leave it unchanged (inside the clip), so one gamma means the
  same gate for BM25, dense, hybrid or reranker relevances, whose log r spreads differ by orders
  of magnitude. Equal relevances (and a single expert) give 0: no gating. It is
  recomputed from the current r every step, so decode-time relevance changes (``set_relevance``)
  and experts that join (``add_expert``) re-standardize it.

Aggregation into one vocabulary score ``a[v]`` (greedy picks argmax a, sampling draws from softmax(a/T)):

- ``max`` (paper): a[v] = max_k s_hat_k[v]; the winner is the lowest k attaining a[token].
  Ties between tokens go to the lowest token id, between experts to the lowest expert index.
- ``moe``: p_k = softmax(s_hat_k), w = softmax(prior) (with the log prior w_k ∝ r_k^gamma);
  a[v] = log sum_k w_k p_k[v]. (The prior_k shift of s_hat_k cancels inside a softmax,
  so the prior enters through w; both aggregations use the same ``prior_term``.)
- ``poe``: a[v] = log_softmax(sum_k w_k log p_k[v]), the normalized weighted product.
  For moe/poe the winner is argmax_k w_k p_k[token], unless the amateur's own probability
  softmax(s0)[token] exceeds every p_k[token]: then the token owes more to the model prior than
  to any document and the amateur (index -1) is reported.

beta:
- ``"dynamic"`` (paper, AdaCAD): beta_k = JSD(softmax(s_k) || softmax(s0)) at the first generated
  step (natural log, summed over the vocabulary, so 0 <= beta_k <= ln 2), frozen afterwards.
- ``"elementwise"``: the authors' library (langchain-pced 0.2.0, ``core/decode_cb.py``: ``if
  current_beta is None: current_beta = get_jsd(...).clamp(0, 1.0)``): for every vocabulary entry v,
  beta_k[v] = clamp(0.5 p_k[v] log(p_k[v]/m[v]) + 0.5 p0[v] log(p0[v]/m[v]), 0, 1) with
  m = (p_k + p0)/2, i.e. the JSD's element-wise terms, a per-token beta; like the dynamic beta it
  is computed at the first generated step and frozen afterwards.
- a float: fixed beta for every expert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import UserError
# the settings, read by everything that configures the rule (re-exported: pced.decoding.rule.RuleConfig)
from .rule_config import (AGGREGATIONS, AMATEUR, BETA_MODES, MAX_BETA, MAX_GAMMA, PRIORS, R_MAX, R_MIN,  # noqa: F401
                          SCORE_SPACES, SPREAD_FLOOR, Beta, RuleConfig)


def js_divergence(expert_logits: torch.Tensor, amateur_logits: torch.Tensor) -> torch.Tensor:
    """JSD(softmax(s_k) || softmax(s0)) per expert, natural log, summed over the vocabulary: [N]."""
    return jsd_terms(expert_logits, amateur_logits).sum(dim=-1)


def jsd_terms(expert_logits: torch.Tensor, amateur_logits: torch.Tensor) -> torch.Tensor:
    """Element-wise JSD terms 0.5 p log(p/m) + 0.5 q log(q/m), [N, V]; 0 log 0 = 0."""
    log_p = torch.log_softmax(expert_logits.float(), dim=-1)
    log_q = torch.log_softmax(amateur_logits.float(), dim=-1).expand_as(log_p)
    p, q = log_p.exp(), log_q.exp()
    log_m = torch.logaddexp(log_p, log_q) - math.log(2.0)
    terms = 0.5 * p * (log_p - log_m) + 0.5 * q * (log_q - log_m)
    return torch.nan_to_num(terms, nan=0.0)


def learned_beta(mode: str, expert_scores: torch.Tensor, amateur_scores: torch.Tensor) -> torch.Tensor:
    """beta from one step's scores: ``dynamic`` [N] (the JSD), ``elementwise`` [N, V] (its terms, clamped to [0, 1])."""
    if mode == "dynamic":
        return js_divergence(expert_scores, amateur_scores)
    return jsd_terms(expert_scores, amateur_scores).clamp(0.0, 1.0)


def _clipped_log(relevance: torch.Tensor) -> torch.Tensor:
    return torch.log(relevance.double().clamp(R_MIN, R_MAX))


def log_prior(relevance: torch.Tensor) -> torch.Tensor:
    return _clipped_log(relevance).float()


def prior_term(relevance: torch.Tensor, gamma: float, mode: str = "log") -> torch.Tensor:
    """The prior added to each expert's scores, [N] float32 on the relevance's device (see the
    module docstring): gamma * log r (``log``), or gamma times log r standardized within the
    question (``standardized``: 0 for the best expert, 0 for all when they are equally relevant)."""
    if mode == "log":
        return gamma * log_prior(relevance)
    log_r = _clipped_log(relevance)
    if log_r.numel() < 2:  # one expert: nothing to compare it with
        return torch.zeros_like(log_r, dtype=torch.float32)
    spread = log_r.std(correction=0).clamp_min(SPREAD_FLOOR)
    return (gamma * (log_r - log_r.max()) / spread).float()


def to_score_space(scores: torch.Tensor, space: str) -> torch.Tensor:
    scores = scores.float()
    return torch.log_softmax(scores, dim=-1) if space == "logprobs" else scores


def calibrate(
    expert_scores: torch.Tensor,
    amateur_scores: torch.Tensor,
    beta: torch.Tensor,
    gamma: float,
    relevance: torch.Tensor,
    prior: str = "log",
    prior_values: torch.Tensor | None = None,
) -> torch.Tensor:
    """s_hat [N, V] from expert scores [N, V], amateur [V], beta [N] or [N, V], relevance [N];
    ``prior`` is the mode of ``prior_term``, ``prior_values`` its result when already computed.

    The result lives on the scores' device: beta and the prior follow them there (a CPU relevance
    vector beside CUDA logits is the normal case)."""
    beta = beta.to(expert_scores.device)
    if beta.dim() == 1:
        beta = beta[:, None]
    contrast = (1.0 + beta) * expert_scores - beta * amateur_scores[None, :]
    values = prior_term(relevance, gamma, prior) if prior_values is None else prior_values  # (precomputed: the rule's cache)
    return contrast + values.to(expert_scores.device)[:, None]


@dataclass
class Choice:
    token: int
    winner: int  # index into the contextual experts, or AMATEUR (-1)
    scores: torch.Tensor  # the aggregated vocabulary scores a[v] the token was chosen from


def column_of(scores: torch.Tensor, token) -> torch.Tensor:
    """``scores[..., token]`` for an int or a tensor token, read on the device (plain indexing with a
    0-d tensor would convert it to a Python int first)."""
    index = torch.as_tensor(token, device=scores.device).view(1)
    return scores.index_select(-1, index).squeeze(-1)


def aggregate(
    s_hat: torch.Tensor,
    amateur_scores: torch.Tensor,
    relevance: torch.Tensor,
    config: RuleConfig,
    prior_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, "callable"]:
    """Aggregated vocabulary scores a [V] and a function token -> winning expert index. The token is
    a 0-d tensor (or an int) and so is the winner: nothing is read back from the scores' device.
    ``prior_values``: ``prior_term``'s result on that device, when already computed."""
    if config.aggregation == "max":
        best = s_hat.max(dim=0).values

        def winner(token):  # argmax returns the first maximal index: the lowest expert on ties
            return torch.argmax(column_of(s_hat, token))

        return best, winner
    if prior_values is None:
        prior_values = prior_term(relevance, config.gamma, config.prior)
    weights = torch.softmax(prior_values.to(s_hat.device), dim=0)
    log_weights = torch.log(weights)
    log_p = torch.log_softmax(s_hat, dim=-1)
    if config.aggregation == "moe":
        scores = torch.logsumexp(log_p + log_weights[:, None], dim=0)
    else:
        scores = torch.log_softmax((weights[:, None] * log_p).sum(dim=0), dim=-1)
    amateur_log_p = torch.log_softmax(amateur_scores.float(), dim=-1)

    def winner(token):
        column = column_of(log_p, token)
        return torch.where(column_of(amateur_log_p, token) > column.max(), AMATEUR, torch.argmax(log_weights + column))

    return scores, winner


class ContrastiveRule:
    """Stateful per generation: holds the frozen dynamic betas after the first step."""

    def __init__(self, config: RuleConfig, relevance: torch.Tensor):
        self.config = config
        self.relevance = relevance.float()
        self.beta: torch.Tensor | None = None
        self.last_s_hat: torch.Tensor | None = None
        # Host-side state, so that a GPU step reads nothing back to decide: whether a joined expert
        # still needs its dynamic beta, and the prior term on the scores' device (None: recompute)
        self._beta_pending = False
        self._prior: torch.Tensor | None = None
        if not isinstance(config.beta, str):
            self.beta = torch.full((len(relevance),), float(config.beta))

    def add_expert(self, relevance: float) -> None:
        """An expert joins mid-answer (its row was appended last): a dynamic beta is computed at the
        first step it takes part in, then frozen, as the others' were at theirs."""
        self.relevance = torch.cat([self.relevance, self.relevance.new_tensor([relevance])])
        self._prior = None
        if self.beta is not None:
            learned = self.config.beta in BETA_MODES  # dynamic or element-wise: NaN until its first step
            value = float("nan") if learned else float(self.config.beta)
            self.beta = torch.cat([self.beta, self.beta.new_full((1, *self.beta.shape[1:]), value)])
            self._beta_pending = learned

    def set_relevance(self, relevance: torch.Tensor) -> None:
        """Decode-time relevance: new r_k for the experts, from the next step on."""
        if relevance.shape != self.relevance.shape:
            raise UserError(f"{relevance.shape[0]} relevances for {self.relevance.shape[0]} experts")
        self.relevance = relevance.float()
        self._prior = None

    def betas(self) -> list[float]:
        """One beta per expert (for the element-wise variant: its mean over the vocabulary)."""
        if self.beta is None:
            return []
        return [float(b) for b in (self.beta if self.beta.dim() == 1 else self.beta.mean(dim=-1))]

    def scores(self, logits: torch.Tensor) -> tuple[torch.Tensor, "callable"]:
        """logits [N+1, V], row 0 the amateur -> aggregated scores [V] and the winner function."""
        amateur = to_score_space(logits[0], self.config.score_space)
        if logits.shape[0] == 1:  # no documents: the amateur alone decides
            return amateur, lambda token: AMATEUR
        experts = to_score_space(logits[1:], self.config.score_space)
        if self.config.beta in BETA_MODES and self.beta is None:  # the first generated step: frozen from here on
            self.beta = learned_beta(self.config.beta, experts, amateur)
        elif self._beta_pending:  # experts that joined mid-answer, at the first step they take part in
            pending = torch.isnan(self.beta.reshape(len(self.beta), -1)[:, 0])
            self.beta = self.beta.clone()
            rows = learned_beta(self.config.beta, experts[pending.to(experts.device)], amateur)
            self.beta[pending] = rows.to(self.beta.device)
            self._beta_pending = False
        if self.beta.device != experts.device:  # a fixed beta: moved once, not at every step
            self.beta = self.beta.to(experts.device)
        if self._prior is None or self._prior.device != experts.device:
            self._prior = prior_term(self.relevance, self.config.gamma, self.config.prior).to(experts.device)
        s_hat = calibrate(experts, amateur, self.beta, self.config.gamma, self.relevance, self.config.prior, self._prior)
        self.last_s_hat = s_hat  # per-expert calibrated scores, for traces
        return aggregate(s_hat, amateur, self.relevance, self.config, self._prior)

    def support_at(self, token: torch.Tensor) -> torch.Tensor:
        """Each expert's calibrated score s_hat_k[token] at the latest step, [N] on the scores' device
        (empty without experts)."""
        if self.last_s_hat is None:
            return torch.zeros(0, device=token.device)
        return column_of(self.last_s_hat, token)

    def support(self, token: int) -> list[float]:
        """``support_at`` read back as floats."""
        return [] if self.last_s_hat is None else self.last_s_hat[:, token].tolist()

    def choose(self, logits: torch.Tensor) -> Choice:
        """Greedy choice: argmax of the aggregated scores (lowest token id on ties)."""
        scores, winner = self.scores(logits)
        token = torch.argmax(scores)
        return Choice(token=int(token), winner=int(winner(token)), scores=scores)
