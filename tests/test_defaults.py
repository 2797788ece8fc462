"""One rule resolution for every front end: the library, the CLI and the server answer alike."""

import argparse
import json
from importlib import resources

import pytest
import torch

from pced.sampling import SamplingConfig
from pced.cli import main
from pced.cli.common import add_decoding_options, ask_options_from
from pced.defaults import PAPER_RULE, model_family, resolve_rule
from pced.options import AskOptions
from pced.rule import RuleConfig
from pced.server.schemas import AnswerRequest, Limits, answer_job

QUESTION = "In which town was the founder of the Zorblax Company born?"


def test_family_of_a_model_setting_without_loading(tiny_model_dir, tmp_path):
    assert model_family(None) == model_family("embedded") == "smollm2"
    assert model_family(str(tiny_model_dir)) == "llama"  # read from config.json
    assert model_family(str(tmp_path / "missing")) == ""


@pytest.mark.slow
def test_family_of_a_loaded_model(tiny_llm, embedded_llm):
    assert model_family(embedded_llm) == "smollm2" and model_family(tiny_llm) == "llama"


@pytest.mark.slow
def test_one_resolution_of_the_rule(tiny_model_dir, tiny_llm, embedded_llm):
    assert resolve_rule(None).gamma == resolve_rule(embedded_llm).gamma == 32.0
    assert resolve_rule(None, paper=True) == PAPER_RULE and PAPER_RULE.gamma == 2.5
    assert resolve_rule(str(tiny_model_dir)) == resolve_rule(tiny_llm) == PAPER_RULE
    assert resolve_rule(embedded_llm, gamma=1.5, beta=0.3) == PAPER_RULE.__class__(beta=0.3, gamma=1.5)
    with pytest.raises(TypeError, match="unknown rule settings"):
        resolve_rule(None, temperature=1.0)
    # every front end builds AskOptions, and AskOptions.rule is resolve_rule
    parser = argparse.ArgumentParser()
    add_decoding_options(parser)
    assert ask_options_from(parser.parse_args([])).rule(embedded_llm).gamma == 32.0
    assert ask_options_from(parser.parse_args(["--paper-defaults"])).rule(embedded_llm).gamma == 2.5
    assert ask_options_from(parser.parse_args(["--gamma", "1.5"])).rule(embedded_llm).gamma == 1.5
    assert ask_options_from(parser.parse_args(["--aggregation", "moe"])).rule(tiny_llm).aggregation == "moe"
    job = answer_job(AnswerRequest(question="Who?"), Limits())
    assert job.options == AskOptions(sampling=job.options.sampling) and job.options.rule(embedded_llm).gamma == 32.0
    assert answer_job(AnswerRequest(question="Who?", gamma=2.5), Limits()).options.rule(embedded_llm).gamma == 2.5
    assert answer_job(AnswerRequest(question="Who?", score_space="logprobs"), Limits()).options.rule(None).score_space == "logprobs"


@pytest.fixture(scope="module")
def embedded_store(tmp_path_factory, embedded_llm):
    from pced.corpus import read_corpus
    from pced.store import IndexSettings, index_store

    with resources.as_file(resources.files("pced") / "data" / "demo_corpus.jsonl") as corpus:
        documents = read_corpus(corpus)
    store, _ = index_store(documents, tmp_path_factory.mktemp("embedded") / "store", IndexSettings(storage_dtype="float32"),
                           llm=embedded_llm, progress=False)
    return store


@pytest.mark.slow
def test_library_cli_and_server_give_identical_answers_on_the_embedded_model(embedded_store, capsys):
    from fastapi.testclient import TestClient

    from pced.generator import Generator
    from pced.pipeline import ask
    from pced.server import create_app

    options = AskOptions(top_k=4, top_n=30, sampling=SamplingConfig(max_new_tokens=16))
    asked = ask(embedded_store, QUESTION, options)
    library = asked.json()
    assert asked.generation.rule_config.gamma == 32.0  # the embedded SmolLM2's measured default
    # the Generator API with no rule given resolves the same rule
    engine_answer = Generator(embedded_store.llm, "rag", embedded_store.root / "kv", "float32").answer(asked.candidates, QUESTION,
                                                                                                    sampling=options.sampling)
    assert engine_answer.token_ids == asked.answer().token_ids
    # the CLI
    # the same thread count as this process: float sums then run in the same order
    threads = str(torch.get_num_threads())
    assert main(["ask", str(embedded_store.root), QUESTION, "--json", "--top-k", "4", "--top-n", "30",
                 "--max-new-tokens", "16", "--threads", threads]) == 0
    cli = json.loads(capsys.readouterr().out)
    # the server
    with TestClient(create_app(embedded_store)) as client:
        response = client.post("/v1/pced/answer", json={"question": QUESTION, "top_k": 4, "top_n": 30, "max_tokens": 16})
    assert response.status_code == 200, response.text
    server = response.json()
    for other in (cli, server):
        assert other["answer"] == library["answer"] and other["trace"] == library["trace"]
        assert other["beta"] == pytest.approx(library["beta"])
        assert [e["doc_id"] for e in other["experts"]] == [e["doc_id"] for e in library["experts"]]
    # and the paper's rule is one flag away, for all of them alike
    paper = ask(embedded_store, QUESTION, AskOptions(top_k=4, top_n=30, paper_defaults=True,
                                                     sampling=SamplingConfig(max_new_tokens=16)))
    assert paper.generation.rule_config == PAPER_RULE


def test_defaults_stay_the_papers_and_the_familys():
    assert RuleConfig().prior == "log" and AskOptions().prior is None and SamplingConfig().no_repeat_ngram == 0
    assert resolve_rule(None) == RuleConfig(gamma=32.0)  # the embedded family's rule, prior untouched
    assert resolve_rule(None, prior="standardized") == RuleConfig(gamma=32.0, prior="standardized")
    assert AskOptions(prior="standardized").rule("/nowhere/llama") == RuleConfig(prior="standardized")


def test_bad_settings_are_one_line_value_errors():
    for build, expected in ((lambda: RuleConfig(prior="nope"), "prior must be one of log, standardized"),
                            (lambda: SamplingConfig(no_repeat_ngram=-1), "no_repeat_ngram must be an integer >= 0"),
                            (lambda: AskOptions(prior="nope"), "prior must be one of"),
                            (lambda: AskOptions(backend="vllm", sampling=SamplingConfig(no_repeat_ngram=3)),
                             "--no-repeat-ngram is not supported with --backend vllm")):
        with pytest.raises(ValueError) as info:
            build()
        assert expected in str(info.value) and "\n" not in str(info.value)


def test_cli_flags_reach_ask_options():
    from pced.cli import build_parser
    from pced.cli.common import ask_options_from

    args = build_parser().parse_args(["generate", "--docs", "d.jsonl", "--question", "q", "--prior", "standardized",
                                      "--no-repeat-ngram", "3"])
    options = ask_options_from(args)
    assert options.prior == "standardized" and options.sampling.no_repeat_ngram == 3
    default = ask_options_from(build_parser().parse_args(["generate", "--docs", "d.jsonl", "--question", "q"]))
    assert default.prior is None and default.sampling == SamplingConfig()
