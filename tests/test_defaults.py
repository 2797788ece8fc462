"""Family defaults: the measured gamma for SmolLM2, the paper's elsewhere and on request."""

import argparse

from pced.cli import add_decoding_options, rule_from
from pced.defaults import PAPER_RULE, default_gamma, family_of_model
from pced.server.schemas import AnswerRequest, Limits, answer_job


def test_family_of_a_model_setting_without_loading(tiny_model_dir, tmp_path):
    assert family_of_model(None) == family_of_model("embedded") == "smollm2"
    assert family_of_model(str(tiny_model_dir)) == "llama"  # read from config.json
    assert family_of_model(str(tmp_path / "missing")) == ""


def test_gamma_default_is_measured_for_smollm2_and_the_papers_otherwise(tiny_model_dir):
    assert default_gamma(None) == 32.0 and default_gamma(None, paper=True) == PAPER_RULE.gamma == 2.5
    assert default_gamma(str(tiny_model_dir)) == 2.5
    parser = argparse.ArgumentParser()
    add_decoding_options(parser)
    assert rule_from(parser.parse_args([]), None).gamma == 32.0
    assert rule_from(parser.parse_args(["--paper-defaults"]), None).gamma == 2.5
    assert rule_from(parser.parse_args(["--gamma", "1.5"]), None).gamma == 1.5
    assert rule_from(parser.parse_args([]), str(tiny_model_dir)).gamma == 2.5


def test_server_request_without_gamma_takes_the_served_models_default():
    limits = Limits(default_gamma=32.0)
    assert answer_job(AnswerRequest(question="Who?"), limits).rule.gamma == 32.0
    assert answer_job(AnswerRequest(question="Who?", gamma=2.5), limits).rule.gamma == 2.5
    assert answer_job(AnswerRequest(question="Who?"), Limits()).rule.gamma == 2.5
