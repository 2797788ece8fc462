"""The contrastive rule on hand-made logits."""

import math

import numpy as np
import pytest
import torch

from pced.rule import AMATEUR, ContrastiveRule, RuleConfig, calibrate, js_divergence


def reference_jsd(p_logits, q_logits):
    p = np.exp(p_logits - np.logaddexp.reduce(p_logits))
    q = np.exp(q_logits - np.logaddexp.reduce(q_logits))
    m = (p + q) / 2
    kl = lambda a, b: float(np.sum(np.where(a > 0, a * np.log(a / b), 0.0)))
    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


def test_dynamic_beta_matches_float64_jsd_and_is_frozen():
    rng = np.random.default_rng(0)
    amateur = rng.normal(size=50)
    experts = rng.normal(size=(3, 50)) * np.array([[0.1], [1.0], [4.0]])
    logits = torch.tensor(np.vstack([amateur, experts]), dtype=torch.float32)
    rule = ContrastiveRule(RuleConfig(beta="dynamic", gamma=0.0), torch.tensor([0.5, 0.5, 0.5]))
    rule.choose(logits)
    expected = [reference_jsd(experts[k], amateur) for k in range(3)]
    assert rule.betas() == pytest.approx(expected, abs=1e-6)
    assert all(0 <= b <= math.log(2) for b in rule.betas())
    assert expected[0] < expected[1] < expected[2]
    # frozen after the first step: other logits do not change beta
    rule.choose(torch.randn(4, 50))
    assert rule.betas() == pytest.approx(expected, abs=1e-6)
    assert js_divergence(logits[1:2], logits[1]).item() == pytest.approx(0.0, abs=1e-7)


def test_calibration_formula():
    s = torch.tensor([[2.0, 1.0], [0.0, 3.0]])
    s0 = torch.tensor([1.0, 1.0])
    r = torch.tensor([0.5, 0.25])
    out = calibrate(s, s0, torch.tensor([0.5, 1.0]), 2.0, r)
    expected = torch.tensor(
        [[1.5 * 2 - 0.5 + 2 * math.log(0.5), 1.5 - 0.5 + 2 * math.log(0.5)], [0 - 1 + 2 * math.log(0.25), 6 - 1 + 2 * math.log(0.25)]]
    )
    assert torch.allclose(out, expected, atol=1e-6)


def test_gamma_gates_a_confident_but_irrelevant_expert():
    amateur = torch.zeros(4)
    relevant = torch.tensor([0.0, 3.0, 0.0, 0.0])
    distractor = torch.tensor([5.0, 0.0, 0.0, 0.0])  # highest raw logit, low relevance
    logits = torch.stack([amateur, relevant, distractor])
    r = torch.tensor([0.9, 0.05])
    ungated = ContrastiveRule(RuleConfig(beta=0.0, gamma=0.0), r).choose(logits)
    assert (ungated.token, ungated.winner) == (0, 1)
    gated = ContrastiveRule(RuleConfig(beta=0.0, gamma=2.5), r).choose(logits)
    assert (gated.token, gated.winner) == (1, 0)


def test_relevance_is_clipped_so_zero_and_one_are_finite():
    logits = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    choice = ContrastiveRule(RuleConfig(beta=0.0, gamma=2.5), torch.tensor([1.0, 0.0])).choose(logits)
    assert torch.isfinite(choice.scores).all()
    assert (choice.token, choice.winner) == (0, 0)


def test_max_moe_poe_differ_as_defined():
    # Expert 0 is sharp on token 0; expert 1 is spread between tokens 1 and 2; expert 2 likes token 1.
    amateur = torch.zeros(3)
    e0 = torch.tensor([4.0, 0.0, 0.0])
    e1 = torch.tensor([0.0, 3.0, 3.0])
    e2 = torch.tensor([0.0, 3.5, 0.0])
    logits = torch.stack([amateur, e0, e1, e2])
    r = torch.tensor([0.5, 0.5, 0.5])
    mx = ContrastiveRule(RuleConfig(beta=0.0, gamma=0.0, aggregation="max"), r).choose(logits)
    assert (mx.token, mx.winner) == (0, 0)
    moe = ContrastiveRule(RuleConfig(beta=0.0, gamma=0.0, aggregation="moe"), r).choose(logits)
    p = torch.softmax(torch.stack([e0, e1, e2]), dim=-1).mean(dim=0)
    assert moe.token == int(torch.argmax(p)) == 1
    assert torch.allclose(moe.scores, torch.log(p), atol=1e-6)
    assert moe.winner == 2  # the largest weighted contribution to token 1
    poe = ContrastiveRule(RuleConfig(beta=0.0, gamma=0.0, aggregation="poe"), r).choose(logits)
    logp = torch.log_softmax(torch.stack([e0, e1, e2]), dim=-1).mean(dim=0)
    assert torch.allclose(poe.scores, torch.log_softmax(logp, dim=-1), atol=1e-6)
    assert poe.token == int(torch.argmax(logp))


def test_moe_weights_follow_relevance_to_the_power_gamma():
    amateur = torch.zeros(2)
    logits = torch.stack([amateur, torch.tensor([2.0, 0.0]), torch.tensor([0.0, 2.0])])
    r = torch.tensor([0.8, 0.2])
    choice = ContrastiveRule(RuleConfig(beta=0.0, gamma=2.0, aggregation="moe"), r).choose(logits)
    w = r**2 / (r**2).sum()
    p = w[:, None] * torch.softmax(logits[1:], dim=-1)
    assert torch.allclose(choice.scores, torch.log(p.sum(dim=0)), atol=1e-6)


def test_amateur_can_win_only_without_experts_or_under_soft_aggregation():
    amateur = torch.tensor([0.0, 6.0, 0.0])
    e = torch.tensor([0.0, 1.0, 1.2])
    logits = torch.stack([amateur, e])
    r = torch.tensor([0.9])
    assert ContrastiveRule(RuleConfig(beta=0.0, gamma=0.0), r).choose(logits).winner == 0
    moe = ContrastiveRule(RuleConfig(beta=0.0, gamma=0.0, aggregation="moe"), r).choose(logits)
    assert moe.token == 2 and moe.winner == 0
    amateur_token = ContrastiveRule(RuleConfig(beta=0.0, gamma=0.0, aggregation="moe"), r).choose(
        torch.stack([amateur, torch.tensor([0.0, 1.3, 1.2])])
    )
    assert amateur_token.token == 1 and amateur_token.winner == AMATEUR
    alone = ContrastiveRule(RuleConfig(), torch.zeros(0)).choose(amateur[None])
    assert (alone.token, alone.winner) == (1, AMATEUR)


def test_ties_are_deterministic():
    logits = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    for _ in range(3):
        choice = ContrastiveRule(RuleConfig(beta=0.0, gamma=0.0), torch.tensor([0.5, 0.5])).choose(logits)
        assert (choice.token, choice.winner) == (0, 0)


def test_elementwise_beta_and_logprob_space():
    amateur = torch.tensor([0.0, 1.0, 2.0])
    expert = torch.tensor([3.0, 0.0, 0.0])
    logits = torch.stack([amateur, expert])
    rule = ContrastiveRule(RuleConfig(beta="elementwise", gamma=0.0), torch.tensor([0.5]))
    choice = rule.choose(logits)
    p, q = torch.softmax(expert, 0), torch.softmax(amateur, 0)
    m = (p + q) / 2
    beta = (0.5 * p * torch.log(p / m) + 0.5 * q * torch.log(q / m)).clamp(0, 1)
    expected = (1 + beta) * expert - beta * amateur
    assert torch.allclose(choice.scores, expected, atol=1e-6)
    lp = ContrastiveRule(RuleConfig(beta=0.0, gamma=0.0, score_space="logprobs"), torch.tensor([0.5])).choose(logits)
    assert torch.allclose(lp.scores, torch.log_softmax(expert, 0), atol=1e-6)


@pytest.mark.parametrize(
    "kwargs", [dict(beta="sometimes"), dict(aggregation="mean"), dict(score_space="probs"), dict(gamma=-1.0), dict(gamma=float("nan"))]
)
def test_bad_configuration_is_refused(kwargs):
    with pytest.raises(ValueError):
        RuleConfig(**kwargs)


def test_prune_candidates_keeps_competitive_priors():
    import math

    from pced.documents import Document
    from pced.documents import Candidate
    from pced.pipeline import prune_candidates

    cands = [Candidate(Document(str(i), "t"), r, {}) for i, r in enumerate([0.9, 0.5, 0.8, 0.01])]
    assert [c.document.id for c in prune_candidates(cands, 2.5, max_experts=2)] == ["0", "2"]
    margin = 2.5 * (math.log(0.9) - math.log(0.5)) + 1e-9
    assert [c.document.id for c in prune_candidates(cands, 2.5, margin=margin)] == ["0", "1", "2"]
    assert [c.document.id for c in prune_candidates(cands, 2.5)] == ["0", "1", "2", "3"]


def test_rule_computes_on_the_device_of_the_logits_whatever_the_relevance_device():
    # "meta" tensors carry a device and shapes but no data: any CPU/other-device mix-up raises here,
    # as it would between CPU relevances and CUDA logits
    experts, amateur = torch.randn(3, 11, device="meta"), torch.randn(11, device="meta")
    relevance = torch.tensor([0.9, 0.5, 0.2])
    for beta in (torch.tensor([0.1, 0.2, 0.3]), torch.rand(3, 11)):
        s_hat = calibrate(experts, amateur, beta, 2.5, relevance)
        assert s_hat.device.type == "meta" and s_hat.shape == (3, 11)
    for aggregation in ("moe", "poe"):
        rule = ContrastiveRule(RuleConfig(beta=0.5, aggregation=aggregation), relevance)
        scores, _ = rule.scores(torch.randn(4, 11, device="meta"))
        assert scores.device.type == "meta"
