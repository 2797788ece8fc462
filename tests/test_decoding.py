"""Batched expert decoding on a tiny random Llama: exactness against plain transformers."""

import random

import pytest
import torch

from pced.decoding.loop import Generation, PlainScoring, Rows, ban_repeated_ngrams
from pced.decoding.sampling import SamplingConfig
from pced.methods.pced import Expert, PCEDGeneration, generate
from pced.decoding.rule import AMATEUR, RuleConfig

from helpers.experts import encode_setup, repeats

QUESTION = "Which town was the founder born in?"
DOCS = [
    "Mira Quell founded the Zorblax company.",
    "Mira Quell was born in the town of Oskvale, which lies on the northern shore of Lake Tarnow. " * 6,
    "Oskvale is a fishing town. It has a copper-roofed harbour and " + "a long pier. " * 40,
]


@pytest.fixture(scope="module")
def setup(tiny_llm):
    return encode_setup(tiny_llm, DOCS)


def experts_for(caches, relevances=None):
    relevances = relevances or [0.9, 0.7, 0.5][: len(caches)]
    return [Expert(f"d{i}", r, lambda kv=kv: kv) for i, (kv, r) in enumerate(zip(caches, relevances))]


def reference_greedy(llm, ids, n):
    out = llm.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids) :].tolist()


def test_one_expert_beta0_gamma0_is_plain_greedy(setup):
    llm, builder, prefix, caches = setup
    assert len({kv.n_tokens for kv in caches}) == 3  # very different lengths
    for k, doc in enumerate(DOCS):
        reference = reference_greedy(llm, builder.prompt_ids([doc], QUESTION), 24)
        eos = llm.eos_token_ids()
        if any(t in eos for t in reference):
            reference = reference[: min(reference.index(t) for t in eos if t in reference)]
        answer = generate(
            llm,
            prefix,
            experts_for([caches[k]]),
            builder.suffix_ids(QUESTION),
            builder.suffix_ids(QUESTION, with_context=False),
            RuleConfig(beta=0.0, gamma=0.0),
            SamplingConfig(max_new_tokens=24),
        )
        assert answer.token_ids == reference
        assert all(step.winner == 0 and step.doc_id == "d0" for step in answer.trace)


def test_no_documents_answers_from_the_amateur(setup):
    llm, builder, prefix, _ = setup
    reference = reference_greedy(llm, builder.prompt_ids([], QUESTION), 12)
    answer = generate(llm, prefix, [], builder.suffix_ids(QUESTION), builder.suffix_ids(QUESTION, False), sampling=SamplingConfig(max_new_tokens=12))
    assert answer.amateur_only
    assert answer.token_ids == reference[: len(answer.token_ids)] and answer.token_ids
    assert all(step.winner == AMATEUR and step.doc_id is None for step in answer.trace)


def test_batching_is_invisible(setup):
    """Each row's logits in the padded batch equal a plain forward over that expert's own sequence."""
    llm, builder, prefix, caches = setup
    generation = PCEDGeneration(
        llm, prefix, experts_for(caches), builder.suffix_ids(QUESTION), builder.suffix_ids(QUESTION, False),
        RuleConfig(), SamplingConfig(max_new_tokens=6),
    )
    per_step = []
    for step in generation:
        per_step.append((step.token_id, generation.last_logits.clone()))
    assert len(per_step) >= 4
    generated = [token for token, _ in per_step]
    rows = [builder.prompt_ids([], QUESTION)] + [builder.prompt_ids([d], QUESTION) for d in DOCS]
    for step in (0, 3):
        batch_logits = per_step[step][1]
        for row, ids in enumerate(rows):
            with torch.inference_mode():
                alone = llm.model(torch.tensor([ids + generated[:step]])).logits[0, -1]
            diff = (batch_logits[row] - alone).abs().max().item()
            assert diff <= 1e-4, (step, row, diff)


def test_sampling_is_seeded_and_respects_max_new_tokens(setup):
    llm, builder, prefix, caches = setup
    run = lambda seed: generate(
        llm, prefix, experts_for(caches), builder.suffix_ids(QUESTION), builder.suffix_ids(QUESTION, False),
        RuleConfig(), SamplingConfig(max_new_tokens=10, temperature=1.5, top_k=50, top_p=0.9, seed=seed),
    ).token_ids
    assert run(1) == run(1)
    assert len(run(1)) <= 10
    assert run(1) != run(2) or run(1) != run(3)


def test_stop_string_and_timings(setup):
    llm, builder, prefix, caches = setup
    full = generate(llm, prefix, experts_for(caches), builder.suffix_ids(QUESTION), builder.suffix_ids(QUESTION, False),
                    sampling=SamplingConfig(max_new_tokens=12))
    assert {"cache_load_s", "ttft_s", "total_s", "suffix_forward_s"} <= set(full.timings)
    assert 0 < full.timings["ttft_s"] <= full.timings["total_s"]
    assert len(full.betas) == 3
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    if stop.strip():
        cut = generate(llm, prefix, experts_for(caches), builder.suffix_ids(QUESTION), builder.suffix_ids(QUESTION, False),
                       sampling=SamplingConfig(max_new_tokens=12, stop=(stop,)))
        assert cut.text == full.text[: full.text.find(stop)]


def test_split_characters_are_held_back_until_complete(tiny_llm):
    from pced.text.detokenize import TextTracker

    tokenizer = tiny_llm.tokenizer
    ids = tokenizer("日本語のテキスト 𝔘𝔫𝔦", add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tokenizer.decode(ids[:i]) for i in range(1, len(ids)))  # characters really are split
    tracker = TextTracker(tokenizer, set(), ())
    pieces = [tracker.push(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + tracker.flush() == "日本語のテキスト 𝔘𝔫𝔦"


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
                               SamplingConfig(max_new_tokens=12, ignore_eos=True, no_repeat_ngram=n, loop_span=0),
                               method="single").answer().token_ids
    assert run(0) == [ids[0], ids[1], ids[2], ids[3]] * 3 and repeats(run(0), 3) == 6
    assert repeats(run(3), 3) == -1 and run(3)[:6] == run(0)[:6] and run(3)[6] != run(0)[6]
    assert repeats(run(2), 2) == -1 and run(2)[:5] == run(0)[:5]


def test_rows_that_decide_themselves_hand_the_loop_decisions_it_takes_as_they_are(tiny_llm):
    """A serving engine's rows (vLLM's) choose each token inside the engine: the loop streams,
    detokenizes, stops at EOS and traces exactly the tokens and winners they hand it, and never asks
    the scoring for scores."""
    from pced.backends.vllm.engine import TapeScoring
    from pced.decoding.loop import Decision, Generation
    from pced.documents import Candidate, Document

    tokens = tiny_llm.tokenizer.encode(" Oskvale, by the lake", add_special_tokens=False)
    winners = [1, 1, AMATEUR, 0, 1][: len(tokens)] + [0] * max(0, len(tokens) - 5)
    decided = [Decision(t, w) for t, w in zip(tokens, winners)] + [Decision(tiny_llm.tokenizer.eos_token_id, 0)]
    rule = RuleConfig(beta="dynamic", gamma=2.5)

    class DecidedRows(Rows):
        timings, stats = {}, {}

        def __init__(self):
            self.taken = []

        def prefill(self):
            return decided[0]

        def advance(self, token):
            self.taken.append(token)
            return decided[len(self.taken)]

    candidates = [Candidate(Document("a", "A."), 0.9), Candidate(Document("b", "B."), 0.5)]
    rows = DecidedRows()
    answer = Generation(rows, TapeScoring(lambda: [0.25, 0.5], candidates, rule), tiny_llm, SamplingConfig(max_new_tokens=32)).answer()
    assert answer.token_ids == tokens and rows.taken == tokens
    assert [s.winner for s in answer.trace] == winners
    assert [s.doc_id for s in answer.trace] == [None if w == AMATEUR else "ab"[w] for w in winners]
    assert answer.text == tiny_llm.tokenizer.decode(tokens) and answer.betas == [0.25, 0.5]
# --------------------------------------------------------------------------- one host read per step


@pytest.mark.parametrize("aggregation", ["max", "moe", "poe"])
@pytest.mark.parametrize("sampled", [False, True])
def test_one_host_read_per_step(setup, aggregation, sampled):
    """Token, winner, finiteness and support leave the device in one read per step, for every
    aggregation, greedy or sampled (top-k, top-p, a seed) with the n-gram ban (before: 5 greedy, 6
    sampled: the finiteness check, the argmax, the winner's nonzero and int, the support's tolist,
    the distribution copied to the host for the draw)."""
    from helpers.host_reads import reads_per_step

    llm, builder, prefix, caches = setup
    sampling = SamplingConfig(max_new_tokens=6, ignore_eos=True)
    if sampled:
        sampling = SamplingConfig(max_new_tokens=6, ignore_eos=True, temperature=0.8, top_k=20, top_p=0.9, seed=1,
                                  no_repeat_ngram=2)
    generation = PCEDGeneration(llm, prefix, experts_for(caches), builder.suffix_ids(QUESTION),
                                builder.suffix_ids(QUESTION, False), RuleConfig(aggregation=aggregation), sampling)
    per_step = reads_per_step(generation)
    assert len(per_step) == 5 and all(events == ["tolist"] for events in per_step), per_step
    assert all(len(step.support) == 3 for step in generation.trace)


def test_one_host_read_per_step_of_a_plain_answer(setup):
    from helpers.host_reads import reads_per_step
    from pced.methods.concat import PlainGeneration

    llm, builder, _, _ = setup
    generation = PlainGeneration(llm, builder.prompt_ids(DOCS[:1], QUESTION), SamplingConfig(max_new_tokens=5, ignore_eos=True))
    assert reads_per_step(generation) == [["tolist"]] * 4


def test_the_draw_is_torch_multinomial_on_the_same_generator():
    """pick_token's exponential draw gives torch.multinomial's tokens for the same seed (one sample)."""
    from pced.decoding.loop import pick_token

    sampling = SamplingConfig(temperature=0.7)
    for seed in range(100):
        scores = torch.randn(300, generator=torch.Generator().manual_seed(1000 + seed)) * 3
        probs = torch.softmax(scores / 0.7, dim=-1)
        expected = int(torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed)))
        assert int(pick_token(scores, sampling, torch.Generator().manual_seed(seed))) == expected


def test_a_damaged_row_is_named_from_the_steps_one_read(setup):
    from pced.decoding.loop import DecodingError

    llm, builder, prefix, caches = setup
    broken = type(caches[1])(keys=caches[1].keys.clone(), values=caches[1].values.clone())
    broken.values[0, :, 2] = float("nan")
    experts = experts_for([caches[0], broken])
    generation = PCEDGeneration(llm, prefix, experts, builder.suffix_ids(QUESTION), builder.suffix_ids(QUESTION, False),
                                RuleConfig(), SamplingConfig(max_new_tokens=4))
    with pytest.raises(DecodingError, match="'d1'"):
        generation.answer()
