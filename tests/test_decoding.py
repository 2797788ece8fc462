"""Batched expert decoding on a tiny random Llama: exactness against plain transformers."""

import pytest
import torch

from pced.sampling import SamplingConfig
from pced.methods.pced import Expert, PCEDGeneration, generate
from pced.rule import AMATEUR, RuleConfig

from helpers.experts import encode_setup

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
    from pced.detokenize import TextTracker

    tokenizer = tiny_llm.tokenizer
    ids = tokenizer("日本語のテキスト 𝔘𝔫𝔦", add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tokenizer.decode(ids[:i]) for i in range(1, len(ids)))  # characters really are split
    tracker = TextTracker(tokenizer, set(), ())
    pieces = [tracker.push(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + tracker.flush() == "日本語のテキスト 𝔘𝔫𝔦"


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
    from pced.decoding import pick_token

    sampling = SamplingConfig(temperature=0.7)
    for seed in range(100):
        scores = torch.randn(300, generator=torch.Generator().manual_seed(1000 + seed)) * 3
        probs = torch.softmax(scores / 0.7, dim=-1)
        expected = int(torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed)))
        assert int(pick_token(scores, sampling, torch.Generator().manual_seed(seed))) == expected


def test_a_damaged_row_is_named_from_the_steps_one_read(setup):
    from pced.decoding import DecodingError

    llm, builder, prefix, caches = setup
    broken = type(caches[1])(keys=caches[1].keys.clone(), values=caches[1].values.clone())
    broken.values[0, :, 2] = float("nan")
    experts = experts_for([caches[0], broken])
    generation = PCEDGeneration(llm, prefix, experts, builder.suffix_ids(QUESTION), builder.suffix_ids(QUESTION, False),
                                RuleConfig(), SamplingConfig(max_new_tokens=4))
    with pytest.raises(DecodingError, match="'d1'"):
        generation.answer()
