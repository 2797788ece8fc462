"""Issue 14's two options, off by default: the scale-free (standardized) retrieval prior and the
no-repeat n-gram ban after the rule. Off, both are today's decoding token for token."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from pced.sampling import SamplingConfig
from pced.cli import main
from pced.decoding import Generation, PlainScoring, Rows, ban_repeated_ngrams
from pced.defaults import resolve_rule
from pced.evaluation.config import EvalConfig, EvalError, build_grid, validate
from pced.evaluation.report import format_table
from pced.methods.pced import Expert, PCEDGeneration
from pced.options import AskOptions
from pced.rule import ContrastiveRule, RuleConfig, aggregate, calibrate, prior_term

from helpers.experts import encode_setup

QUESTION = "Which town was the founder born in?"
DOCS = ["Mira Quell founded the Zorblax company.",
        "Mira Quell was born in the town of Oskvale, which lies on the northern shore of Lake Tarnow.",
        "Oskvale is a fishing town. It has a copper-roofed harbour and a long pier."]
RELEVANCE = [0.9, 0.7, 0.5]
LOFT_TINY = Path(__file__).parent / "fixtures" / "loft_tiny"
TOLERANCE = dict(rtol=1e-6, atol=1e-6)  # float32 rounding of the same real number computed two ways


@pytest.fixture(scope="module")
def setup(tiny_llm):
    return encode_setup(tiny_llm, DOCS)


def pced_generation(setup, rule: RuleConfig, sampling: SamplingConfig, relevance=RELEVANCE) -> PCEDGeneration:
    llm, builder, prefix, caches = setup
    experts = [Expert(f"d{i}", r, lambda kv=kv: kv) for i, (kv, r) in enumerate(zip(caches, relevance))]
    return PCEDGeneration(llm, prefix, experts, builder.suffix_ids(QUESTION), builder.suffix_ids(QUESTION, False),
                          rule, sampling)


def old_prior(relevance: torch.Tensor, gamma: float) -> torch.Tensor:
    """The prior exactly as written before the option existed."""
    return gamma * torch.log(relevance.double().clamp(1e-8, 1.0 - 1e-8)).float()


# --------------------------------------------------------------------------- 1. log = today


def test_defaults_stay_the_papers_and_the_familys():
    assert RuleConfig().prior == "log" and AskOptions().prior is None and SamplingConfig().no_repeat_ngram == 0
    assert resolve_rule(None) == RuleConfig(gamma=32.0)  # the embedded family's rule, prior untouched
    assert resolve_rule(None, prior="standardized") == RuleConfig(gamma=32.0, prior="standardized")
    assert AskOptions(prior="standardized").rule("/nowhere/llama") == RuleConfig(prior="standardized")


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


# --------------------------------------------------------------------------- 2. standardized


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


# --------------------------------------------------------------------------- 3. it follows decode-time relevance


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


def test_standardized_generation_decodes_with_the_standardized_prior(setup):
    generation = pced_generation(setup, RuleConfig(gamma=2.5, prior="standardized"),
                                 SamplingConfig(max_new_tokens=6, ignore_eos=True))
    prior = prior_term(torch.tensor(RELEVANCE), 2.5, "standardized")
    for step in generation:
        logits, beta = generation.last_logits, generation.scoring.rule.beta[:, None]
        s_hat = (1.0 + beta) * logits[1:] - beta * logits[0][None, :] + prior[:, None]
        assert torch.equal(generation.scoring.rule.last_s_hat, s_hat)
        assert step.token_id == int(torch.argmax(s_hat.max(dim=0).values))


def test_vllm_group_members_carry_the_prior():
    from pced.backends.vllm.groups import GroupMember

    member = GroupMember("q", 1, (0.9, 0.5), RuleConfig(prior="standardized"))
    assert GroupMember.from_args(member.to_args()) == member


# --------------------------------------------------------------------------- 4. no-repeat n-gram


def banned_by_hand(generated: list[int], n: int) -> set[int]:
    if len(generated) < n:
        return set()
    prefix = generated[len(generated) - n + 1:]
    return {generated[i + n - 1] for i in range(len(generated) - n + 1) if generated[i:i + n - 1] == prefix}


def test_ban_sets_exactly_the_completing_tokens_to_minus_inf():
    scores = torch.randn(20)
    before = scores.clone()
    generated = [1, 2, 3, 1, 2, 5, 1, 2]
    for n, banned in ((3, {3, 5}), (2, {3, 5}), (1, {1, 2, 3, 5}), (4, set()), (9, set())):
        out = ban_repeated_ngrams(scores, generated, n)
        assert torch.equal(scores, before)  # the caller's scores are not changed in place
        assert {int(i) for i in torch.nonzero(torch.isinf(out)).flatten()} == banned, n
        keep = torch.ones(20, dtype=torch.bool)
        keep[list(banned)] = False
        assert torch.equal(out[keep], before[keep]) and bool((out[~keep] == float("-inf")).all())
    rng = random.Random(0)
    for _ in range(200):  # against the definition, on random short sequences over a small vocabulary
        generated, n = [rng.randrange(4) for _ in range(rng.randrange(12))], rng.randrange(1, 5)
        out = ban_repeated_ngrams(torch.zeros(4), generated, n)
        assert {int(i) for i in torch.nonzero(torch.isinf(out)).flatten()} == banned_by_hand(generated, n)


def repeats(ids: list[int], n: int) -> int:
    """Index of the first token that completes an n-gram seen before, or -1."""
    seen = set()
    for end in range(n, len(ids) + 1):
        gram = tuple(ids[end - n:end])
        if gram in seen:
            return end - 1
        seen.add(gram)
    return -1


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


class CyclingRows(Rows):
    """A stand-in model of one row that always prefers the next token of a 4-token cycle."""

    def __init__(self, ids: list[int], vocab: int):
        self.ids, self.vocab, self.timings, self.stats = ids, vocab, {}, {}

    def logits_after(self, token: int) -> torch.Tensor:
        logits = torch.zeros(1, self.vocab)
        logits[0, self.ids] = torch.tensor([1.0, 2.0, 3.0, 4.0])  # a fixed fallback order
        logits[0, self.ids[(self.ids.index(token) + 1) % 4] if token in self.ids else self.ids[0]] = 10.0
        return logits

    def prefill(self) -> torch.Tensor:
        return self.logits_after(-1)

    def advance(self, token: int) -> torch.Tensor:
        return self.logits_after(token)


def test_the_ban_applies_to_plain_scoring_too(tiny_llm):
    ids = tiny_llm.tokenizer(" a b c d", add_special_tokens=False)["input_ids"][:4]
    assert len(set(ids)) == 4
    vocab = len(tiny_llm.tokenizer)
    run = lambda n: Generation(CyclingRows(ids, vocab), PlainScoring(), tiny_llm,
                               SamplingConfig(max_new_tokens=12, ignore_eos=True, no_repeat_ngram=n),
                               method="single").answer().token_ids
    assert run(0) == [ids[0], ids[1], ids[2], ids[3]] * 3 and repeats(run(0), 3) == 6
    assert repeats(run(3), 3) == -1 and run(3)[:6] == run(0)[:6] and run(3)[6] != run(0)[6]
    assert repeats(run(2), 2) == -1 and run(2)[:5] == run(0)[:5]


# --------------------------------------------------------------------------- 5. bad input


def test_bad_settings_are_one_line_value_errors():
    for build, expected in ((lambda: RuleConfig(prior="nope"), "prior must be one of log, standardized"),
                            (lambda: SamplingConfig(no_repeat_ngram=-1), "no_repeat_ngram must be an integer >= 0"),
                            (lambda: AskOptions(prior="nope"), "prior must be one of"),
                            (lambda: AskOptions(backend="vllm", sampling=SamplingConfig(no_repeat_ngram=3)),
                             "--no-repeat-ngram is not supported with --backend vllm")):
        with pytest.raises(ValueError) as info:
            build()
        assert expected in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("argv, message", [
    (["--prior", "nope"], "--prior: 'nope' is not one of log, standardized"),
    (["--prior", "log,"], "--prior: empty value"),
    (["--no-repeat-ngram", "-1"], "--no-repeat-ngram: values must be >= 0"),
    (["--no-repeat-ngram", "3,x"], "--no-repeat-ngram: 'x' is not an integer"),
    (["--no-repeat-ngram", "0,3", "--backend", "vllm"], "--no-repeat-ngram: the vllm backend"),
])
def test_eval_refuses_bad_prior_and_ngram_before_any_model_loads(argv, message, tmp_path, capsys, monkeypatch):
    import pced.llm

    monkeypatch.setattr(pced.llm, "load_model", lambda *_, **__: pytest.fail("a model was loaded"))
    code = main(["eval", "--dataset", str(LOFT_TINY), *argv, "--model", str(tmp_path / "missing"),
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("pced: error: ") and err.count("\n") == 1 and message in err, err


def test_cli_flags_reach_ask_options():
    from pced.cli import build_parser
    from pced.cli.common import ask_options_from

    args = build_parser().parse_args(["generate", "--docs", "d.jsonl", "--question", "q", "--prior", "standardized",
                                      "--no-repeat-ngram", "3"])
    options = ask_options_from(args)
    assert options.prior == "standardized" and options.sampling.no_repeat_ngram == 3
    default = ask_options_from(build_parser().parse_args(["generate", "--docs", "d.jsonl", "--question", "q"]))
    assert default.prior is None and default.sampling == SamplingConfig()


# --------------------------------------------------------------------------- 6. the eval grid


def test_grid_sweeps_prior_for_pced_and_the_ban_for_every_method():
    config = validate(EvalConfig(dataset="x", methods=["pced", "single"], prior=["log", "standardized"],
                                 no_repeat_ngram=[0, 3]))
    grid = build_grid(config, RuleConfig(gamma=32.0))
    today = "pced|beta=dynamic|gamma=32|agg=max|space=logits|k=8|ret=hybrid"
    assert [r.key for r in grid] == [
        today, today + "|nrng=3",
        "pced|beta=dynamic|gamma=32|agg=max|space=logits|prior=standardized|k=8|ret=hybrid",
        "pced|beta=dynamic|gamma=32|agg=max|space=logits|prior=standardized|k=8|ret=hybrid|nrng=3",
        "single|k=8|ret=hybrid", "single|k=8|ret=hybrid|nrng=3"]
    assert [(r.rule.prior if r.rule else None, r.no_repeat_ngram) for r in grid] == [
        ("log", 0), ("log", 3), ("standardized", 0), ("standardized", 3), (None, 0), (None, 3)]
    # a run without the new settings has exactly the keys and settings it had before they existed
    plain = build_grid(validate(EvalConfig(dataset="x", methods=["pced", "single"])), RuleConfig(gamma=32.0))
    assert [r.key for r in plain] == [today, "single|k=8|ret=hybrid"]
    assert plain[0] == grid[0] and plain[0].settings() == {"beta": "dynamic", "gamma": 32.0, "aggregation": "max",
                                                          "score_space": "logits", "top_k": 8, "retriever": "hybrid"}
    assert grid[3].settings()["prior"] == "standardized" and grid[3].settings()["no_repeat_ngram"] == 3
    with pytest.raises(EvalError, match="--prior"):
        validate(EvalConfig(dataset="x", prior=["nope"]))
    with pytest.raises(EvalError, match="--no-repeat-ngram"):
        validate(EvalConfig(dataset="x", no_repeat_ngram=[]))


def test_table_shows_prior_and_ngram_columns_only_when_swept():
    base = {"method": "pced", "config": "c", "score": 10.0, "n": 2, "beta": "dynamic", "gamma": 2.5,
            "aggregation": "max", "score_space": "logits", "top_k": 8, "retriever": "hybrid"}
    plain = format_table({"metric": "em", "results": [base]})
    assert "Prior" not in plain and "n-gram" not in plain
    swept = format_table({"metric": "em", "results": [
        base, {**base, "config": "d", "prior": "standardized", "no_repeat_ngram": 3},
        {"method": "single", "config": "e", "score": 5.0, "n": 2, "top_k": 8, "retriever": "hybrid"}]})
    lines = swept.splitlines()
    header = [c.strip() for c in next(line for line in lines if line.startswith("| Method")).split("|")]
    cells = [[c.strip() for c in line.split("|")] for line in lines if line.startswith("| PCED") or "Single" in line]
    prior, ngram = header.index("Prior"), header.index("No-repeat n-gram")
    assert [(row[prior], row[ngram]) for row in cells] == [("log", "0"), ("standardized", "3"), ("–", "0")]


# --------------------------------------------------------------------------- the server


def test_server_takes_prior_and_ngram_in_the_pced_object(tiny_llm, tmp_path_factory):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from pced.documents import Candidate, Document
    from pced.methods import make_generation
    from pced.server import create_app

    from helpers.server import tiny_store

    store = tiny_store(tmp_path_factory, tiny_llm)
    documents = [{"id": "a", "text": DOCS[0], "score": 0.9}, {"id": "b", "text": DOCS[1], "score": 0.4}]
    with TestClient(create_app(store), raise_server_exceptions=False) as client:
        body = {"question": QUESTION, "documents": documents, "max_tokens": 16, "prior": "standardized",
                "no_repeat_ngram": 2}
        response = client.post("/v1/pced/answer", json=body)
        assert response.status_code == 200, response.text
        chat = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": QUESTION}], "documents": documents, "max_tokens": 16,
            "pced": {"prior": "standardized", "no_repeat_ngram": 2}})
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == response.json()["answer"]
        for bad in ({"prior": "nope"}, {"no_repeat_ngram": -1}, {"no_repeat_ngram": "3"}, {"no_repeat_ngram": 2.5}):
            refused = client.post("/v1/pced/answer", json={"question": QUESTION, **bad})
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_value", (bad, refused.text)
    candidates = [Candidate(Document(d["id"], d["text"], ""), d["score"], {"given": d["score"]}) for d in documents]
    direct = make_generation(store.generator, "pced", candidates, QUESTION, RuleConfig(prior="standardized"),
                             SamplingConfig(max_new_tokens=16, no_repeat_ngram=2)).answer()
    assert response.json()["answer"] == direct.text

