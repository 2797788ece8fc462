"""The embedded model on llama.cpp against the same model on transformers.

The two do not compute the same numbers, so these tests state a tolerance rather than equality:
transformers runs the GGUF's Q4_1 weights dequantized to float32, llama.cpp multiplies the Q4_1
blocks with activations quantized to 8 bits and keeps keys and values in f16 or q8_0. Measured on
the demo corpus (4 documents x 3 questions, one expert each): the next-token distributions differ
by at most 0.0083 nats (KL), and the greedy token was the same in all 24 cases, down to a top-two
margin of 0.27 logits. Accepted here: KL at most 0.02 nats (about twice the largest seen), the
same greedy token wherever transformers' top two are 0.25 logits or more apart, and on the demo
questions the same expected answers found, most answers token for token (a near tie may flip one
token and so the rest of an answer). Skipped where llama-cpp-python is not installed.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from importlib import resources
from pathlib import Path

import pytest
import torch

from pced.corpus.reader import read_corpus
from pced.backends.llamacpp.settings import LlamaSettings
from pced.text.prompts import RAG_TEMPLATE, PromptBuilder

ROOT = Path(__file__).resolve().parents[1]
MAX_KL = 0.02  # nats; the largest measured was 0.0083
CLEAR_MARGIN = 0.25  # logits between transformers' first and second token: above it, the greedy token must agree


def _demo():
    data = resources.files("pced") / "data"
    with resources.as_file(data / "demo_corpus.jsonl") as path:
        corpus = read_corpus(path)
    return corpus, json.loads((data / "demo_questions.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
def test_next_token_distributions_agree_within_quantization_noise(embedded_llm, cache_type):
    pytest.importorskip("llama_cpp")
    from pced.backends.llamacpp.model import LlamaModel

    llama = LlamaModel(None, LlamaSettings(cache_type=cache_type, threads=1))
    builder = PromptBuilder(embedded_llm.tokenizer, RAG_TEMPLATE)
    assert builder.prefix_ids == PromptBuilder(llama.tokenizer, RAG_TEMPLATE).prefix_ids  # the same prompt tokens
    corpus, questions = _demo()
    checked = 0
    for document in corpus[:4]:
        for item in questions:
            ids = builder.prompt_ids([document.render()], item["question"])
            with torch.no_grad():
                reference = embedded_llm.model(torch.tensor([ids])).logits[0, -1].float()
            with llama.lock:
                ctx = llama.context(len(ids), 1)
                logits = ctx.decode(ids, range(len(ids)), [0] * len(ids), [False] * (len(ids) - 1) + [True])[0]
            kl = torch.nn.functional.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                                            reduction="sum").item()
            assert 0 <= kl <= MAX_KL, (document.id, item["question"], kl)
            first, second = torch.topk(reference, 2).values.tolist()
            if first - second >= CLEAR_MARGIN:
                assert int(logits.argmax()) == int(reference.argmax()), (document.id, item["question"])
                checked += 1
    assert checked >= 6  # the greedy check ran on most of the 12 prompts, not on none


@pytest.mark.slow
def test_the_demo_questions_find_the_same_answers_on_both_backends(tmp_path):
    pytest.importorskip("llama_cpp")
    from pced.cli.store import DEMO_OPTIONS
    from pced.pipeline import ask
    from pced.store import DocumentStore, IndexSettings, index_store

    corpus, questions = _demo()
    root = tmp_path / "store"
    index_store(corpus, root, IndexSettings(), progress=False)
    index_store(corpus, root, IndexSettings(), progress=False, backend="llamacpp", backend_settings=LlamaSettings(threads=1))
    store = DocumentStore.open(root)
    llama = replace(DEMO_OPTIONS, backend="llamacpp", backend_settings=LlamaSettings(threads=1))
    identical = 0
    for item in questions:
        ours = ask(store, item["question"], DEMO_OPTIONS).generation.answer()
        theirs = ask(store, item["question"], llama).generation.answer()
        expected = item["answer"].lower()
        assert (expected in ours.text.lower()) == (expected in theirs.text.lower()), item["question"]
        assert ours.token_ids[:8] == theirs.token_ids[:8]  # the answers start alike; a near tie may come later
        identical += ours.token_ids == theirs.token_ids
    assert identical >= 2  # measured: 2 of 3 with f16 (the third parted after 27 tokens)


@pytest.mark.slow
def test_hotpotqa_questions_through_pced_eval_agree_within_the_stated_tolerance(tmp_path):
    """``pced eval`` on the first 5 HotpotQA questions (PCED's defaults), transformers and llama.cpp
    (f16), compared the way ``experiments/llamacpp_agreement.py`` compares them: real contexts through
    both backends' eval path. Measured: 2 of 5 answers identical, subspan EM 60.0 against 40.0 (one
    answer lost, none won). Accepted: at least one identical answer and at most two more lost than
    won (a near tie flipped early changes the rest of an answer; a backend that restored the wrong
    state would agree on none). The agreement itself is measured on 20 and 100 questions by the
    experiment (docs/llamacpp.md: 12 of 20, 60 of 100 identical)."""
    pytest.importorskip("llama_cpp")
    from pced.cli import main
    from pced.evaluation.datasets import resolve_data_dir
    from pced.evaluation.records import DatasetError

    try:
        resolve_data_dir()
    except DatasetError:
        pytest.skip("shared data dir with hotpotqa is absent")
    if not (resolve_data_dir() / "hotpotqa").is_dir():
        pytest.skip("shared data dir with hotpotqa is absent")
    runs = [tmp_path / "transformers", tmp_path / "llamacpp-f16"]
    for backend, out in zip(("transformers", "llamacpp"), runs):
        assert main(["eval", "--dataset", "hotpotqa", "--limit", "5", "--methods", "pced", "--backend", backend,
                     "--out", str(out), "--no-progress"]) == 0
    spec = importlib.util.spec_from_file_location("llamacpp_agreement", ROOT / "experiments" / "llamacpp_agreement.py")
    experiment = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(experiment)
    result = experiment.hotpotqa(runs)
    row = next(r for r in result["comparison"]["rows"] if r["config"] == "llamacpp-f16")
    assert result["n"] == 5
    assert result["identical"]["llamacpp-f16"] >= 1, result["identical"]
    assert row["losses"] - row["wins"] <= 2, row
