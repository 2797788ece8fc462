"""Prompt segmentation: every expert's ids are exactly the plain path's ids for the same text."""

import pytest
from transformers import AutoTokenizer

from pced.text.prompts import ICL_TEMPLATE, RAG_TEMPLATE, PromptBuilder

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


NO_SYSTEM_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                      "{{ raise_exception('System role not supported') }}{% endif %}"
                      "<|user|>{{ m['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|bot|>{% endif %}")


def test_a_template_that_refuses_the_system_role_gets_it_folded_into_the_user_turn(embedded_tokenizer_dir):
    from pced.methods.mapreduce import map_prompt_ids
    from pced.text.prompts import render_chat

    tokenizer = AutoTokenizer.from_pretrained(embedded_tokenizer_dir)
    tokenizer.chat_template = NO_SYSTEM_TEMPLATE
    assert render_chat(tokenizer, "Be brief.", "Who?") == "<|user|>Be brief.\n\nWho?<|end|><|bot|>"
    expected = tokenizer("<|user|>Summarize this.\n\nA document.<|end|><|bot|>", add_special_tokens=False)["input_ids"]
    assert map_prompt_ids(tokenizer, " A document. ", "Summarize this.") == list(expected)


def test_any_other_chat_template_failure_is_not_hidden(embedded_tokenizer_dir, monkeypatch):
    from pced.methods.mapreduce import map_prompt_ids
    from pced.text.prompts import render_chat

    tokenizer = AutoTokenizer.from_pretrained(embedded_tokenizer_dir)

    def broken(*args, **kwargs):
        raise KeyError("a bug in the tokenizer")

    monkeypatch.setattr(tokenizer, "apply_chat_template", broken)
    with pytest.raises(KeyError, match="a bug in the tokenizer"):
        render_chat(tokenizer, "Be brief.", "Who?")
    with pytest.raises(KeyError, match="a bug in the tokenizer"):
        map_prompt_ids(tokenizer, "A document.")
