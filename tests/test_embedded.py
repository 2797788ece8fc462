"""Integration on the embedded SmolLM2-135M-Instruct (dequantized from the packaged GGUF)."""

import pytest
import torch

from pced.decoding.sampling import SamplingConfig
from pced.documents import Document
from pced.documents import Candidate
from pced.generator import Generator
from pced.text.prompts import PromptBuilder
from pced.decoding.rule import RuleConfig

pytestmark = pytest.mark.slow  # the embedded model


def test_embedded_one_document_is_plain_greedy(embedded_llm, tmp_path):
    generator = Generator(embedded_llm, kv_dir=tmp_path, storage_dtype="float32")
    doc = Document("d", "The Zorblax company, a maker of tidal clocks, was founded in 1987 by the engineer Mira Quell.")
    question = "Who founded the Zorblax company?"
    answer = generator.answer([Candidate(doc, 0.9, {})], question, RuleConfig(beta=0.0, gamma=0.0), SamplingConfig(max_new_tokens=20))
    ids = PromptBuilder(embedded_llm.tokenizer).prompt_ids([doc.render()], question)
    out = embedded_llm.model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0, len(ids) :].tolist()
    eos = embedded_llm.eos_token_ids()
    reference = out[: next((i for i, t in enumerate(out) if t in eos), len(out))]
    assert answer.token_ids == reference
    assert "Mira Quell" in answer.text


def test_two_document_bridge_question_uses_both_documents(embedded_llm, tmp_path):
    generator = Generator(embedded_llm, kv_dir=tmp_path)  # float16 storage, the default
    candidates = [
        Candidate(Document("zorblax", "The Zorblax company was founded by Mira Quell."), 0.80, {}),
        Candidate(Document("quell", "Mira Quell was born in the town of Oskvale."), 0.75, {}),
    ]
    answer = generator.answer(candidates, "In which town was the founder of the Zorblax company born?", RuleConfig(), SamplingConfig(max_new_tokens=40))
    assert "Oskvale" in answer.text
    winners = {step.doc_id for step in answer.trace}
    assert {"zorblax", "quell"} <= winners
    # the bridge entity and the answer come from different documents
    oskvale_tokens = [s.doc_id for s in answer.trace if s.text.strip() in {"O", "sk", "v", "ale"}]
    assert "quell" in oskvale_tokens
