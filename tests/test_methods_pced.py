"""PCEDGeneration (pced/methods/pced.py) on the tiny random Llama: the retrieval prior it decodes
with (log, today's formula; standardized, scale-free) and the no-repeat n-gram ban after the rule."""

from __future__ import annotations

import pytest
import torch

from pced.methods.pced import Expert, PCEDGeneration
from pced.decoding.rule import RuleConfig, prior_term
from pced.decoding.sampling import SamplingConfig

from helpers.experts import encode_setup, old_prior, repeats

QUESTION = "Which town was the founder born in?"
DOCS = ["Mira Quell founded the Zorblax company.",
        "Mira Quell was born in the town of Oskvale, which lies on the northern shore of Lake Tarnow.",
        "Oskvale is a fishing town. It has a copper-roofed harbour and a long pier."]
RELEVANCE = [0.9, 0.7, 0.5]


@pytest.fixture(scope="module")
def setup(tiny_llm):
    return encode_setup(tiny_llm, DOCS)


def pced_generation(setup, rule: RuleConfig, sampling: SamplingConfig, relevance=RELEVANCE) -> PCEDGeneration:
    llm, builder, prefix, caches = setup
    experts = [Expert(f"d{i}", r, lambda kv=kv: kv) for i, (kv, r) in enumerate(zip(caches, relevance))]
    return PCEDGeneration(llm, prefix, experts, builder.suffix_ids(QUESTION), builder.suffix_ids(QUESTION, False),
                          rule, sampling)


@pytest.mark.parametrize("aggregation", ["max", "moe"])
def test_log_prior_generation_is_todays_step_by_step(setup, aggregation):
    """Every step of a real generation: s_hat and the token equal the pre-change rule's, computed
    here from the step's logits; and setting prior="log" explicitly changes no token."""
    rule = RuleConfig(gamma=2.5, aggregation=aggregation)
    generation = pced_generation(setup, rule, SamplingConfig(max_new_tokens=12, ignore_eos=True))
    relevance = torch.tensor(RELEVANCE)
    for step in generation:
        logits = generation.last_logits
        amateur, experts = logits[0].float(), logits[1:].float()
        beta = generation.scoring.rule.beta[:, None]
        s_hat = (1.0 + beta) * experts - beta * amateur[None, :] + old_prior(relevance, 2.5)[:, None]
        assert torch.equal(generation.scoring.rule.last_s_hat, s_hat)
        if aggregation == "max":
            assert step.token_id == int(torch.argmax(s_hat.max(dim=0).values))
    tokens = generation.answer().token_ids
    explicit = pced_generation(setup, RuleConfig(gamma=2.5, aggregation=aggregation, prior="log"),
                               SamplingConfig(max_new_tokens=12, ignore_eos=True, no_repeat_ngram=0)).answer()
    assert explicit.token_ids == tokens and len(tokens) == 12


def test_standardized_generation_decodes_with_the_standardized_prior(setup):
    generation = pced_generation(setup, RuleConfig(gamma=2.5, prior="standardized"),
                                 SamplingConfig(max_new_tokens=6, ignore_eos=True))
    prior = prior_term(torch.tensor(RELEVANCE), 2.5, "standardized")
    for step in generation:
        logits, beta = generation.last_logits, generation.scoring.rule.beta[:, None]
        s_hat = (1.0 + beta) * logits[1:] - beta * logits[0][None, :] + prior[:, None]
        assert torch.equal(generation.scoring.rule.last_s_hat, s_hat)
        assert step.token_id == int(torch.argmax(s_hat.max(dim=0).values))


def test_pced_generation_with_the_ban_never_repeats_an_ngram(setup):
    rule, equal = RuleConfig(gamma=2.5), [0.5, 0.5, 0.5]
    free = pced_generation(setup, rule, SamplingConfig(max_new_tokens=48, ignore_eos=True), equal).answer()
    assert repeats(free.token_ids, 2) == -1  # this random model never repeats a bigram: a trigram ban changes nothing
    trigram = pced_generation(setup, rule, SamplingConfig(max_new_tokens=48, ignore_eos=True, no_repeat_ngram=3),
                              equal).answer()
    assert trigram.token_ids == free.token_ids and repeats(trigram.token_ids, 3) == -1
    # it does repeat single tokens: with n = 1 nothing changes before the first repeat, then that token does
    first = repeats(free.token_ids, 1)
    assert first >= 0, "the tiny model repeats no token here: the test would prove nothing"
    banned = pced_generation(setup, rule, SamplingConfig(max_new_tokens=48, ignore_eos=True, no_repeat_ngram=1),
                             equal).answer()
    assert len(banned.token_ids) == 48 and repeats(banned.token_ids, 1) == -1
    assert banned.token_ids[:first] == free.token_ids[:first] and banned.token_ids[first] != free.token_ids[first]
    for step in banned.trace:  # winners still come from the unbanned s_hat (max: the lowest best expert)
        assert step.winner == max(range(len(step.support)), key=lambda k: (step.support[k], -k))
