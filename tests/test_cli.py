"""One vocabulary across front ends: global options on either side of the subcommand, one default
per setting (written in its dataclass), the API's max_tokens mapped to max_new_tokens."""

import argparse

import pytest
import torch

from pced.cli import build_parser, main
from pced.evaluation.config import EvalConfig
from pced.decoding.sampling import SamplingConfig
from pced.server.schemas import AnswerRequest, Limits, answer_job


def leaves(parser, path=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                if any(isinstance(a, argparse._SubParsersAction) for a in child._actions):
                    yield from leaves(child, path + (name,))
                else:
                    yield path + (name,), child


@pytest.mark.parametrize("argv", [
    ["--threads", "2", "serve", "STORE"], ["serve", "STORE", "--threads", "2"],
    ["--threads", "2", "store", "list", "STORE"], ["store", "list", "STORE", "--threads", "2"],
    ["--threads", "2", "ask", "STORE", "q?"], ["eval", "--dataset", "nq", "--threads", "2"],
])
def test_threads_parses_before_and_after_the_subcommand(argv):
    assert build_parser().parse_args(argv).threads == 2


def test_every_command_takes_the_global_options():
    parser = build_parser()
    commands = dict(leaves(parser))
    assert {("serve",), ("ask",), ("chat",), ("store", "remove"), ("store", "verify"), ("index",)} <= set(commands)
    for path, command in commands.items():
        assert any("--threads" in a.option_strings for a in command._actions), path
    assert parser.parse_args(["store", "stats", "S"]).threads is None  # unset: the default rule


def test_threads_before_the_subcommand_configures_torch(tmp_path, capsys):
    before = torch.get_num_threads()
    try:
        assert main(["--threads", "1", "ask", str(tmp_path / "missing"), "Who?"]) == 2  # threads set, then the store fails
        assert torch.get_num_threads() == 1
        torch.set_num_threads(before)
        assert main(["--threads", "1", "verify", str(tmp_path / "missing")]) == 2
        assert torch.get_num_threads() == before  # reading a store's files leaves torch alone
        assert main(["--threads", "0", "verify", str(tmp_path)]) == 2  # still checked
        assert "--threads must be at least 1" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("argv", [
    ["--threads", "{n}", "ask", "{missing}", "q?"], ["ask", "{missing}", "q?", "--threads", "{n}"],
    ["--threads", "{n}", "serve", "{missing}"], ["serve", "{missing}", "--threads", "{n}"],
    ["chat", "{missing}", "--threads", "{n}"], ["index", "{missing}", "--out", "{missing}", "--threads", "{n}"],
    ["--threads", "{n}", "store", "list", "{missing}"], ["verify", "{missing}", "--threads", "{n}"],
    ["eval", "--dataset", "{missing}", "--threads", "{n}"], ["generate", "--docs", "{missing}", "--question", "q?",
                                                             "--threads", "{n}"],
])
def test_threads_above_what_the_machine_can_run_are_one_line_for_every_command(argv, tmp_path, capsys):
    from pced.backends.threads import THREADS_PER_CPU, max_threads

    before = torch.get_num_threads()
    try:
        for n in (max_threads() + 1, 1_000_000):
            assert main([a.format(n=n, missing=tmp_path / "missing") for a in argv]) == 2
            err = capsys.readouterr().err.splitlines()
            assert err == [f"pced: error: --threads must be at most {max_threads()} ({THREADS_PER_CPU} for each of this "
                           f"machine's {max_threads() // THREADS_PER_CPU} CPUs), got {n}"]
    finally:
        torch.set_num_threads(before)


def test_the_most_threads_is_accepted_and_the_llamacpp_setting_has_the_same_bound():
    from pced.backends.llamacpp.settings import LlamaSettings
    from pced.backends.threads import max_threads
    from pced.cli.threads import check_threads
    from pced.errors import UserError

    assert check_threads(max_threads()) == max_threads() and LlamaSettings(threads=max_threads()).threads == max_threads()
    with pytest.raises(UserError, match=f"threads must be at most {max_threads()}"):
        LlamaSettings(threads=max_threads() + 1)


def test_answer_length_has_one_default():
    default = SamplingConfig().max_new_tokens
    parser = build_parser()
    assert parser.parse_args(["ask", "S", "q?"]).max_new_tokens == default
    assert parser.parse_args(["chat", "S"]).max_new_tokens == default
    assert parser.parse_args(["generate", "--docs", "d", "--question", "q?"]).max_new_tokens == default
    assert int(parser.parse_args(["eval", "--dataset", "nq"]).max_new_tokens) == default == EvalConfig(dataset="nq").max_new_tokens
    assert Limits().default_max_tokens == default


def test_the_api_max_tokens_is_max_new_tokens():
    limits = Limits()
    assert answer_job(AnswerRequest(question="q?", max_tokens=7), limits).options.sampling.max_new_tokens == 7
    assert answer_job(AnswerRequest(question="q?", max_completion_tokens=5), limits).options.sampling.max_new_tokens == 5
    assert answer_job(AnswerRequest(question="q?"), limits).options.sampling.max_new_tokens == SamplingConfig().max_new_tokens


def test_serve_names_its_limit_as_a_limit(capsys):
    parser = build_parser()
    assert parser.parse_args(["serve", "S", "--max-tokens-limit", "99"]).max_tokens == 99
    assert parser.parse_args(["serve", "S", "--max-tokens", "98"]).max_tokens == 98  # the old spelling still works
    assert main(["serve", "S", "--max-tokens-limit", "0"]) == 2
    assert "--max-tokens-limit must be at least 1" in capsys.readouterr().err
