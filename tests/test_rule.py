"""The contrastive rule on hand-made logits."""

import math

import numpy as np
import pytest
import torch

from pced.decoding.rule import AMATEUR, ContrastiveRule, RuleConfig, aggregate, calibrate, js_divergence, prior_term

from helpers.experts import old_prior

TOLERANCE = dict(rtol=1e-6, atol=1e-6)  # float32 rounding of the same real number computed two ways


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


def test_log_prior_is_the_pre_change_formula_in_calibrate_and_weights():
    torch.manual_seed(0)
    experts, amateur, beta = torch.randn(4, 50), torch.randn(50), torch.rand(4)
    relevance = torch.tensor([0.91, 0.42, 1e-12, 0.999999999])  # one below and one above the clip
    expected = (1.0 + beta[:, None]) * experts - beta[:, None] * amateur[None, :] + old_prior(relevance, 2.5)[:, None]
    assert torch.equal(calibrate(experts, amateur, beta, 2.5, relevance), expected)
    assert torch.equal(calibrate(experts, amateur, beta, 2.5, relevance, "log"), expected)
    for aggregation in ("moe", "poe"):
        scores, _ = aggregate(expected, amateur, relevance, RuleConfig(gamma=2.5, aggregation=aggregation))
        weights = torch.softmax(old_prior(relevance, 2.5), dim=0)
        log_p = torch.log_softmax(expected, dim=-1)
        if aggregation == "moe":
            reference = torch.logsumexp(log_p + torch.log(weights)[:, None], dim=0)
        else:
            reference = torch.log_softmax((weights[:, None] * log_p).sum(dim=0), dim=-1)
        assert torch.equal(scores, reference)


def test_standardized_prior_is_the_formula_and_scale_free():
    r = torch.tensor([0.9, 0.7, 0.5, 0.2])
    log_r = np.log(r.double().numpy())
    expected = 3.0 * (log_r - log_r.max()) / log_r.std()  # numpy's std is the population one
    got = prior_term(r, 3.0, "standardized")
    assert got.dtype == torch.float32 and got[0] == 0.0
    torch.testing.assert_close(got, torch.from_numpy(expected).float(), **TOLERANCE)
    for c in (0.5, 2.0, 3.0):
        torch.testing.assert_close(prior_term(r ** c, 3.0, "standardized"), got, **TOLERANCE)  # r -> r^c
        torch.testing.assert_close(prior_term(r * (c / 3.0), 3.0, "standardized"), got, **TOLERANCE)  # r -> r * const
    # a reranker's sigmoid spreads log r over nats, BM25's over hundredths: the same gate either way
    assert not torch.allclose(prior_term(r ** 8, 3.0), prior_term(r, 3.0))


def test_standardized_prior_is_zero_for_one_expert_and_for_equal_relevances():
    assert torch.equal(prior_term(torch.tensor([0.3]), 2.5, "standardized"), torch.zeros(1))
    assert torch.equal(prior_term(torch.tensor([0.37] * 5), 2.5, "standardized"), torch.zeros(5))
    assert torch.equal(prior_term(torch.tensor([1e-12, 0.0]), 2.5, "standardized"), torch.zeros(2))  # both clipped
    experts, amateur = torch.randn(5, 40), torch.randn(40)
    beta = torch.full((5,), 0.3)
    plain = (1.0 + beta[:, None]) * experts - beta[:, None] * amateur[None, :]
    assert torch.equal(calibrate(experts, amateur, beta, 2.5, torch.tensor([0.37] * 5), "standardized"), plain + 0.0)


@pytest.mark.parametrize("aggregation", ["max", "moe", "poe"])
def test_every_aggregation_uses_the_same_standardized_term(aggregation):
    torch.manual_seed(1)
    experts, amateur, beta = torch.randn(3, 30), torch.randn(30), torch.rand(3)
    r = torch.tensor([0.8, 0.75, 0.3])
    config = RuleConfig(gamma=2.0, aggregation=aggregation, prior="standardized")
    prior = prior_term(r, 2.0, "standardized")
    s_hat = calibrate(experts, amateur, beta, 2.0, r, "standardized")
    assert torch.equal(s_hat, (1.0 + beta[:, None]) * experts - beta[:, None] * amateur[None, :] + prior[:, None])
    scores, winner = aggregate(s_hat, amateur, r, config)
    if aggregation == "max":
        assert torch.equal(scores, s_hat.max(dim=0).values)
    else:
        weights, log_p = torch.softmax(prior, dim=0), torch.log_softmax(s_hat, dim=-1)
        reference = (torch.logsumexp(log_p + torch.log(weights)[:, None], dim=0) if aggregation == "moe"
                     else torch.log_softmax((weights[:, None] * log_p).sum(dim=0), dim=-1))
        assert torch.equal(scores, reference)
    # r -> r^2 leaves the standardized rule's scores unchanged (up to float rounding)
    scaled, _ = aggregate(calibrate(experts, amateur, beta, 2.0, r ** 2, "standardized"), amateur, r ** 2, config)
    torch.testing.assert_close(scaled, scores, rtol=1e-5, atol=1e-5)


def prior_seen(rule: ContrastiveRule, n_experts: int) -> torch.Tensor:
    """The prior the rule adds at one step: expert rows of zeros and beta 0 make s_hat the prior itself."""
    logits = torch.cat([torch.randn(1, 16), torch.zeros(n_experts, 16)])
    rule.scores(logits)
    return rule.last_s_hat[:, 0]


@pytest.mark.parametrize("aggregation", ["max", "moe"])
def test_standardized_prior_follows_set_relevance_and_add_expert(aggregation):
    rule = ContrastiveRule(RuleConfig(beta=0.0, gamma=1.5, aggregation=aggregation, prior="standardized"),
                           torch.tensor([0.9, 0.6, 0.5]))
    first = prior_seen(rule, 3)
    assert torch.equal(first, prior_term(torch.tensor([0.9, 0.6, 0.5]), 1.5, "standardized"))
    rule.set_relevance(torch.tensor([0.9, 0.6, 0.85]))  # the answer so far made expert 3 relevant
    second = prior_seen(rule, 3)
    assert torch.equal(second, prior_term(torch.tensor([0.9, 0.6, 0.85]), 1.5, "standardized"))
    assert second[2] > first[2] and not torch.equal(second, first)
    rule.add_expert(0.95)  # a new best expert: everyone else moves down
    third = prior_seen(rule, 4)
    assert torch.equal(third, prior_term(torch.tensor([0.9, 0.6, 0.85, 0.95]), 1.5, "standardized"))
    assert third[3] == 0.0 and third[0] < 0.0


# --------------------------------------------------------------------------- the authors' library


def library_get_jsd(p_logits, q_logits, eps: float = 1e-9):
    """langchain-pced 0.2.0, langchain_pced/core/decode_cb.py:105-128, transcribed."""
    p = torch.nn.functional.softmax(p_logits, dim=-1)
    q = torch.nn.functional.softmax(q_logits, dim=-1)
    p = p.reshape(-1, p.size(-1)).clamp_min(eps)
    q = q.reshape(-1, q.size(-1)).clamp_min(eps)
    m = (0.5 * (p + q)).clamp_min(eps).log()
    return 0.5 * (torch.nn.functional.kl_div(m, p, reduction="none", log_target=False)
                  + torch.nn.functional.kl_div(m, q, reduction="none", log_target=False))


def library_decode(steps, relevance, gamma):
    """decode_cb.py's greedy loop (beta=None, normalize=False): the bias at :205-209, the dynamic beta at
    :245-250 (``if current_beta is None: current_beta = get_jsd(...).clamp(0, 1.0)``, likewise :386-390),
    the calibration at :253 and the winner at :269-277; ``steps`` are each step's [N+1, V] logits."""
    retrieval_bias = relevance.clamp_min(1e-12).log()
    current_beta, chosen, calibrated_steps = None, [], []
    for next_logits in steps:
        amateur_logits = next_logits[0].unsqueeze(0)
        expert_logits = next_logits[1:]
        if current_beta is None:
            current_beta = library_get_jsd(amateur_logits, expert_logits).clamp(0, 1.0)
        calibrated_scores = (1 + current_beta) * expert_logits - current_beta * amateur_logits
        best_scores_per_expert, best_tokens_per_expert = calibrated_scores.max(dim=-1)
        best_scores_per_expert = best_scores_per_expert + gamma * retrieval_bias
        winning_expert_idx = int(best_scores_per_expert.argmax().item())
        chosen.append((int(best_tokens_per_expert[winning_expert_idx]), winning_expert_idx))
        calibrated_steps.append(calibrated_scores + gamma * retrieval_bias[:, None])
    return chosen, calibrated_steps


def test_elementwise_beta_is_the_authors_library_frozen_at_the_first_step():
    torch.manual_seed(3)
    relevance, gamma = torch.tensor([0.8, 0.55, 0.3]), 2.5
    steps = [torch.randn(4, 50) * 3 for _ in range(12)]  # every step's logits differ: a recomputed beta would too
    expected, calibrated = library_decode(steps, relevance, gamma)
    rule = ContrastiveRule(RuleConfig(beta="elementwise", gamma=gamma), relevance)
    ours = []
    for logits in steps:
        choice = rule.choose(logits)
        ours.append((choice.token, choice.winner))
        # float32; the library clamps probabilities at 1e-9 where we take 0 log 0 = 0: within 1e-5
        torch.testing.assert_close(rule.last_s_hat, calibrated[len(ours) - 1], rtol=0, atol=1e-5)
    assert ours == expected
    first = library_get_jsd(steps[0][0:1], steps[0][1:]).clamp(0, 1.0)
    torch.testing.assert_close(rule.beta, first, rtol=0, atol=1e-6)
    # the test can tell: a beta recomputed at every step would have chosen other tokens
    recomputed = [int(torch.argmax(((1 + b) * s[1:] - b * s[0] + gamma * relevance.log()[:, None]).max(dim=0).values))
                  for s in steps for b in [library_get_jsd(s[0:1], s[1:]).clamp(0, 1.0)]]
    assert recomputed != [token for token, _ in expected]


def test_an_expert_joining_mid_answer_gets_its_elementwise_beta_at_its_first_step():
    torch.manual_seed(4)
    steps = [torch.randn(3, 30) for _ in range(3)]
    rule = ContrastiveRule(RuleConfig(beta="elementwise", gamma=1.0), torch.tensor([0.9, 0.5]))
    rule.choose(steps[0])
    before = rule.beta.clone()
    rule.add_expert(0.7)
    joined = torch.cat([steps[1], torch.randn(1, 30)])
    rule.choose(joined)
    assert rule.beta.shape == (3, 30) and torch.equal(rule.beta[:2], before)
    torch.testing.assert_close(rule.beta[2], library_get_jsd(joined[0:1], joined[3:4]).clamp(0, 1.0)[0], rtol=0, atol=1e-6)
    rule.choose(torch.cat([steps[2], torch.randn(1, 30)]))
    assert torch.equal(rule.beta[:2], before)  # frozen, the joined row too
