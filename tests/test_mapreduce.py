"""MapReduce: N greedy summary calls plus one reduce call, the reduce prompt built from the summaries."""

import pytest

from pced.methods.concat import PlainGeneration
from pced.methods.mapreduce import MAP_INSTRUCTION, MapReduceGeneration, map_prompt_ids
from pced.decoding.sampling import SamplingConfig
from pced.text.prompts import PromptBuilder

QUESTION = "Which town was the founder born in?"
DOCS = [
    "Mira Quell founded the Zorblax company.",
    "Mira Quell was born in the town of Oskvale, which lies on the northern shore of Lake Tarnow.",
    "Oskvale is a fishing town. It has a copper-roofed harbour and a long pier.",
]


def test_map_prompt_is_instruction_as_system_and_document_as_user(tiny_llm):
    tokenizer = tiny_llm.tokenizer
    messages = [{"role": "system", "content": MAP_INSTRUCTION}, {"role": "user", "content": DOCS[0]}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = map_prompt_ids(tokenizer, "  " + DOCS[0] + "\n")
    assert ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    text = tokenizer.decode(ids)
    assert text.index(MAP_INSTRUCTION) < text.index(DOCS[0])


def test_mapreduce_calls_the_model_n_plus_one_times(tiny_llm):
    builder = PromptBuilder(tiny_llm.tokenizer)
    prefills = []  # every call starts with one multi-token forward (its prompt); decode steps feed one token
    hook = tiny_llm.model.register_forward_pre_hook(
        lambda module, args, kwargs: prefills.append(kwargs["input_ids"].shape[1]) if kwargs["input_ids"].shape[1] > 1 else None,
        with_kwargs=True,
    )
    try:
        generation = MapReduceGeneration(tiny_llm, builder, DOCS, QUESTION, SamplingConfig(max_new_tokens=6), summary_tokens=10)
        answer = generation.answer()
    finally:
        hook.remove()
    assert len(prefills) == len(DOCS) + 1
    stats = answer.stats
    assert stats["llm_calls"] == len(DOCS) + 1
    assert answer.method == "mapreduce" and all(step.doc_id is None for step in answer.trace)

    # each summary is the greedy continuation of its map prompt, and the reduce prompt is the standard one
    map_prompts = [map_prompt_ids(tiny_llm.tokenizer, doc) for doc in DOCS]
    references = [PlainGeneration(tiny_llm, ids, SamplingConfig(max_new_tokens=10)).answer() for ids in map_prompts]
    assert stats["summaries"] == [r.text.strip() for r in references]
    assert all(stats["summaries"])
    assert generation.prompt_ids == builder.prompt_ids(stats["summaries"], QUESTION)
    assert prefills[-1] == len(generation.prompt_ids)
    reduce_text = tiny_llm.tokenizer.decode(generation.prompt_ids)
    for summary in stats["summaries"]:
        assert reduce_text.count(summary) == 1, summary
    assert stats["prompt_tokens"] == sum(map(len, map_prompts)) + len(generation.prompt_ids)
    assert stats["generated_tokens"] == sum(len(r.token_ids) for r in references) + len(answer.token_ids)
    assert answer.timings["ttft_s"] >= stats["map_s"] > 0  # the map phase is part of time to first token


def test_reduce_answer_is_plain_greedy_over_the_summary_prompt(tiny_llm):
    builder = PromptBuilder(tiny_llm.tokenizer)
    generation = MapReduceGeneration(tiny_llm, builder, DOCS[:2], QUESTION, SamplingConfig(max_new_tokens=8), summary_tokens=6)
    answer = generation.answer()
    reference = PlainGeneration(tiny_llm, generation.prompt_ids, SamplingConfig(max_new_tokens=8)).answer()
    assert answer.token_ids == reference.token_ids
    with pytest.raises(ValueError, match="summary_tokens"):
        MapReduceGeneration(tiny_llm, builder, DOCS, QUESTION, summary_tokens=0)
