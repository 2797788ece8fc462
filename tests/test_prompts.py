"""Prompt segmentation: every expert's ids are exactly the plain path's ids for the same text."""

import pytest
from transformers import AutoTokenizer

from pced.prompts import ICL_TEMPLATE, RAG_TEMPLATE, PromptBuilder

DOCS = [
    "Zorblax Corp was founded in 1987 by Mira Quell in the city of Vantor.",
    "Oskvale (population 4,210) lies on Lake Tarnow; its harbour opened on 3 May 1911!",
    "  Leading and trailing spaces are stripped.  ",
    "Ends with a number 42",
    "Line one\nLine two: with a colon",
    "Ünïcödé tëxt — with dashes «quotes» and emoji 🙂",
]
QUESTION = "Who founded Zorblax Corp, and when?"


@pytest.fixture(scope="module")
def tokenizer(embedded_tokenizer_dir):
    return AutoTokenizer.from_pretrained(embedded_tokenizer_dir)


@pytest.mark.parametrize("template", [RAG_TEMPLATE, ICL_TEMPLATE], ids=["rag", "icl"])
def test_segments_equal_full_chat_tokenization(tokenizer, template):
    builder = PromptBuilder(tokenizer, template)
    for doc in DOCS:
        messages = [
            {"role": "system", "content": template.system_prompt},
            {"role": "user", "content": template.context_block([doc]) + "\n\n" + template.question_text(QUESTION)},
        ]
        reference = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        reference = list(reference["input_ids"] if hasattr(reference, "keys") else reference)
        assert builder.prompt_ids([doc], QUESTION) == reference, doc
        expert = builder.prefix_ids + builder.context_ids([doc]) + builder.suffix_ids(QUESTION)
        assert expert == reference


def test_concatenation_and_amateur_segments(tokenizer):
    builder = PromptBuilder(tokenizer, RAG_TEMPLATE)
    full = tokenizer(builder.render(DOCS[:3], QUESTION), add_special_tokens=False)["input_ids"]
    assert builder.prompt_ids(DOCS[:3], QUESTION) == full
    # The amateur: system prompt and question only, no separator, no document.
    messages = [
        {"role": "system", "content": RAG_TEMPLATE.system_prompt},
        {"role": "user", "content": RAG_TEMPLATE.question_text(QUESTION)},
    ]
    amateur = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    amateur = list(amateur["input_ids"] if hasattr(amateur, "keys") else amateur)
    assert builder.prefix_ids + builder.suffix_ids(QUESTION, with_context=False) == amateur
    assert builder.prompt_ids([], QUESTION) == amateur


def test_prefix_is_shared_and_digest_tracks_template(tokenizer):
    rag, icl = PromptBuilder(tokenizer, RAG_TEMPLATE), PromptBuilder(tokenizer, ICL_TEMPLATE)
    for doc in DOCS:
        assert rag.prompt_ids([doc], QUESTION)[: len(rag.prefix_ids)] == rag.prefix_ids
    assert rag.digest() != icl.digest()
    assert rag.digest() == PromptBuilder(tokenizer, RAG_TEMPLATE).digest()
    assert "Example(s):" in tokenizer.decode(icl.context_ids(["x"]))
