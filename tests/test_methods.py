"""Every method runs through the one loop and honours every SamplingConfig field."""

import dataclasses
import json

import pytest

from pced.decoding.sampling import SamplingConfig
from pced.documents import Candidate, Document
from pced.generator import Generator
from pced.options import METHODS, AskOptions
from pced.pipeline import ask_candidates

QUESTION = "Where was the founder of Zorblax born?"
DOCS = [Document("zorblax", "The Zorblax company was founded by Mira Quell."),
        Document("quell", "Mira Quell was born in the town of Oskvale.")]


@pytest.fixture
def stop_everywhere(tiny_llm):
    """The tiny model, except that every token counts as end-of-sequence: an answer ends at once unless
    ``ignore_eos`` is honoured."""
    llm = dataclasses.replace(tiny_llm)
    vocabulary = set(range(len(tiny_llm.tokenizer)))
    llm.eos_token_ids = lambda: vocabulary
    return llm


@pytest.mark.parametrize("method", METHODS)
def test_every_method_honours_ignore_eos(method, stop_everywhere, tmp_path):
    generator = Generator(stop_everywhere, "rag", tmp_path / "kv", "float32")
    candidates = [Candidate(d, r) for d, r in zip(DOCS, (0.8, 0.6))]
    options = AskOptions(method=method, summary_tokens=4)
    stopped = ask_candidates(generator, candidates, QUESTION, options).answer()
    assert stopped.token_ids == [] and stopped.method == method
    exact = ask_candidates(generator, candidates, QUESTION, dataclasses.replace(
        options, sampling=SamplingConfig(max_new_tokens=5, ignore_eos=True))).answer()
    assert len(exact.token_ids) == len(exact.trace) == 5


@pytest.mark.parametrize("method", METHODS)
def test_every_method_honours_stop_strings_and_seeds(method, tiny_llm, tmp_path):
    generator = Generator(tiny_llm, "rag", tmp_path / "kv", "float32")
    candidates = [Candidate(d, r) for d, r in zip(DOCS, (0.8, 0.6))]
    options = AskOptions(method=method, summary_tokens=4, sampling=SamplingConfig(max_new_tokens=8))
    full = ask_candidates(generator, candidates, QUESTION, options).answer()
    assert full.text, "the tiny model should say something"
    stop = full.text.strip()[:3]
    cut = ask_candidates(generator, candidates, QUESTION, dataclasses.replace(
        options, sampling=SamplingConfig(max_new_tokens=8, stop=(stop,)))).answer()
    assert stop not in cut.text and full.text.startswith(cut.text)
    sampled = dataclasses.replace(options, sampling=SamplingConfig(max_new_tokens=8, temperature=1.5, seed=7))
    first = ask_candidates(generator, candidates, QUESTION, sampled).answer()
    again = ask_candidates(generator, candidates, QUESTION, sampled).answer()
    assert first.token_ids == again.token_ids


@pytest.mark.slow
def test_bench_runs_every_method_to_the_exact_length(tiny_llm, tmp_path):
    from pced.bench.run import BenchConfig, run_bench, secret_code_documents
    from pced.text.prompts import RAG_TEMPLATE

    config = BenchConfig(ks=(2, 3), doc_tokens=(24,), repeats=1, new_tokens=4, long_new_tokens=5,
                         storage_dtypes=("float16", "int8"), memory=False, cold=False, out=str(tmp_path / "bench"))
    results = run_bench(tiny_llm, config)
    rows = results["lengths"][0]["rows"]
    assert [row[method]["new_tokens"] for row in rows for method in config.methods] == [4] * 6
    assert all(row["pced"]["ttft_resident_s"] > 0 for row in rows)  # PCED with its caches in the device pool
    storage = {row["dtype"]: row for row in results["storage"]}
    assert storage["int8"]["bytes_per_token"] < storage["float16"]["bytes_per_token"]  # files: headers weigh at 24 tokens
    assert all(row["pced_ttft_s"] > 0 for row in storage.values())
    assert results["end_to_end"]["pced"]["new_tokens"] == results["end_to_end"]["all"]["new_tokens"] == 5
    assert {p.name for p in (tmp_path / "bench").iterdir()} >= {"bench.json", "bench.md", "bench.png", "peer_inputs.json"}
    # what the authors' implementation is timed on (experiments/peer_langchain_pced.py): exactly our prompt
    peer = json.loads((tmp_path / "bench" / "peer_inputs.json").read_text())
    length = peer["lengths"][0]
    assert peer["ks"] == [2, 3] and len(length["doc_ids"]) == 3 and length["scores"][0] == 0.8
    generator = Generator(tiny_llm, RAG_TEMPLATE, tmp_path / "bench" / "kv-L24-float16", "float16")
    docs, question, gold = secret_code_documents(tiny_llm, 3, 24, config.seed)
    gold_doc = next(d for d in docs if d.id in gold)
    assert length["prefix_ids"] + length["doc_ids"][0] + length["question_ids"] == \
        generator.builder.prompt_ids([gold_doc.render()], question)
    assert "peer" not in results["lengths"][0]


def test_one_dispatch_builds_every_method_and_the_generator_streams_through_it(tiny_llm, tmp_path):
    from pced.methods import BUILDERS, start
    from pced.methods.pced import Expert, PCEDGeneration
    from pced.decoding.rule import RuleConfig

    assert set(BUILDERS) == set(METHODS)  # a method is added in one place
    generator = Generator(tiny_llm, "rag", tmp_path / "kv", "float32")
    candidates = [Candidate(d, r) for d, r in zip(DOCS, (0.8, 0.6))]
    sampling = SamplingConfig(max_new_tokens=8, ignore_eos=True)
    options = AskOptions(sampling=sampling)
    started = start(generator, candidates, QUESTION, options, RuleConfig())
    streamed = generator.stream(candidates, QUESTION, RuleConfig(), sampling)
    # by hand, as the generator did before it handed the work down to the method
    builder, caches = generator.builder, generator.caches
    digests = caches.add([c.document.render() for c in candidates], progress=False)
    experts = [Expert(c.document.id, c.relevance, lambda d=d: caches.load(d)) for c, d in zip(candidates, digests)]
    by_hand = PCEDGeneration(tiny_llm, caches.prefix(), experts, builder.suffix_ids(QUESTION, with_context=True),
                             builder.suffix_ids(QUESTION, with_context=False), RuleConfig(), sampling)
    answers = [g.answer() for g in (started, streamed, by_hand)]
    assert answers[0].token_ids == answers[1].token_ids == answers[2].token_ids and len(answers[0].token_ids) == 8
    assert [s.winner for s in answers[0].trace] == [s.winner for s in answers[2].trace]
