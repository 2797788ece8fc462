"""pced.options: the defaults, written once, and one rule resolution for every front end (the library, the CLI and
the server answer alike)."""

import argparse
import ast
import json
import re
from importlib import resources
from pathlib import Path

import pytest
import torch

from pced.decoding.sampling import SamplingConfig
from pced.cli import main
from pced.cli.common import add_decoding_options, ask_options_from
from pced.options import MODEL_FAMILY_RULES, PAPER_RULE, AskOptions, family_defaults, model_family, resolve_rule
from pced.decoding.rule import RuleConfig
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
    from pced.corpus.reader import read_corpus
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


# --------------------------------------------------------------------------- written once

SRC = Path(__file__).resolve().parents[1] / "src" / "pced"
# The defaults a front end used to restate: (setting, value, the words that name it, where it is written).
WRITTEN_ONCE = [
    ("top_k", 8, ("top_k", "top-k"), {("options.py", "AskOptions")}),
    ("top_n", 90, ("top_n", "top-n"), {("options.py", "AskOptions")}),
    ("retriever", "hybrid", ("retriever",), {("options.py", "AskOptions")}),
    ("the paper's gamma", 2.5, ("gamma", "paper"), {("decoding/rule_config.py", "RuleConfig")}),
    ("SmolLM2's gamma", 32, ("gamma", "smollm2"), {("options.py", "MODEL_FAMILY_RULES")}),
    ("max_new_tokens", 32, ("max_new_tokens", "max-new-tokens", "max_tokens", "max-tokens"),
     {("decoding/sampling.py", "SamplingConfig")}),
    ("eval seed", 42, ("seed",), {("evaluation/config.py", "EvalConfig"), ("bench/config.py", "BenchConfig")}),
    ("max_doc_tokens", 1024, ("max_doc_tokens", "max-doc-tokens"), {("store/layout.py", "IndexSettings")}),
]


def _same(node, value) -> bool:
    """A literal that states ``value``: the number itself, or a string holding just that number."""
    if not isinstance(node, ast.Constant) or isinstance(node.value, bool):
        return False
    if isinstance(value, str):
        return node.value == value
    if isinstance(node.value, (int, float)):
        return node.value == value
    return isinstance(node.value, str) and re.fullmatch(r"\s*[0-9.]+\s*", node.value) is not None and float(node.value) == value


def _texts(node) -> list[str]:
    """The literal text of a string or of an f-string's fixed parts (formatted values excluded)."""
    parts = node.values if isinstance(node, ast.JoinedStr) else [node]
    return [p.value for p in parts if isinstance(p, ast.Constant) and isinstance(p.value, str)]


def restated_defaults(root: Path = SRC) -> list[str]:
    """Every place under ``root`` that writes one of WRITTEN_ONCE's values as a literal where it names that
    setting: a class or module field (``top_n: int = 90``, ``DEFAULT_TOP_N = 90``), a keyword or dict entry
    (``gamma=2.5``, ``{"gamma": 32.0}``), an argparse option's default (``"--top-k", default="8"``), a help
    text (``"(default 8)"``, ``"... the paper's 2.5"`` in ``--gamma``'s help), outside the dataclass that owns it;
    and in the page (static/*.html, *.js), an input's own value or a numeric fallback."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        owners = {}  # node id -> the class or module variable it is written in
        for top in tree.body:
            name = top.name if isinstance(top, ast.ClassDef) else (
                top.targets[0].id if isinstance(top, ast.Assign) and isinstance(top.targets[0], ast.Name) else
                top.target.id if isinstance(top, ast.AnnAssign) and isinstance(top.target, ast.Name) else None)
            for node in ast.walk(top):
                owners[id(node)] = name
        for setting, value, words, owned in WRITTEN_ONCE:
            names = lambda text: any(w in text.lower() for w in words)
            hits = []
            for node in ast.walk(tree):
                if isinstance(node, (ast.AnnAssign, ast.Assign)):
                    targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
                    label = " ".join(t.id if isinstance(t, ast.Name) else getattr(t, "attr", "") for t in targets)
                    if node.value is not None and names(label) and _same(node.value, value):
                        hits.append(node)
                elif isinstance(node, ast.keyword) and node.arg in words and _same(node.value, value):
                    hits.append(node.value)
                elif isinstance(node, ast.Dict):
                    hits += [v for k, v in zip(node.keys, node.values)
                             if isinstance(k, ast.Constant) and isinstance(k.value, str) and k.value.lower() in words
                             and _same(v, value)]
                elif isinstance(node, ast.Call):  # an option: its name, its default, its help text
                    flags = " ".join(a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str))
                    if flags.startswith("-") and names(flags):
                        for kw in node.keywords:
                            if kw.arg == "default" and _same(kw.value, value):
                                hits.append(kw.value)
                            if kw.arg == "help" and isinstance(kw.value, (ast.Constant, ast.JoinedStr, ast.BinOp)):
                                texts = [t for part in ast.walk(kw.value) if isinstance(part, (ast.Constant, ast.JoinedStr))
                                         for t in _texts(part)]
                                if any(re.search(rf"(?<![\w.]){re.escape(str(value))}(?![\w]|\.\d)", t) for t in texts):
                                    hits.append(kw.value)
            for node in hits:
                if (rel, owners.get(id(node))) not in owned:
                    found.append(f"{rel}:{node.lineno}: {setting} ({value!r})")
    for path in sorted((root / "server" / "static").glob("*")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"top-k|top_k|max-tokens|max_tokens", line) and re.search(r"value=\"\d|\|\|\s*\d", line):
                found.append(f"server/static/{path.name}:{number}: the page's own number")
    return sorted(set(found))


def test_no_default_is_restated_outside_the_dataclass_that_owns_it():
    assert restated_defaults() == []


def test_the_restatement_finder_finds_what_it_looks_for(tmp_path):
    (tmp_path / "server" / "static").mkdir(parents=True)
    (tmp_path / "cli.py").write_text(
        'p.add_argument("--top-k", default="8", help="documents (default 8)")\n'
        'p.add_argument("--gamma", type=float, help="the family\'s value, 32 for SmolLM2; the paper\'s 2.5")\n'
        "RULE = RuleConfig(gamma=2.5)\nDEFAULT_TOP_N = 90\nTABLE = {'smollm2': {'gamma': 32.0}}\n"
        "class EvalConfig:\n    seed: int = 42\n"
        'p.add_argument("--top-n", default=str(AskOptions.top_n), help=f"(default {AskOptions.top_n})")\n')
    (tmp_path / "server" / "static" / "index.html").write_text('<input id="top-k" type="number" value="4">\n')
    assert restated_defaults(tmp_path) == sorted([
        "cli.py:1: top_k (8)", "cli.py:2: SmolLM2's gamma (32)", "cli.py:2: the paper's gamma (2.5)",
        "cli.py:3: the paper's gamma (2.5)", "cli.py:4: top_n (90)", "cli.py:5: SmolLM2's gamma (32)", "cli.py:7: eval seed (42)",
        "server/static/index.html:1: the page's own number"])


def test_help_texts_format_the_family_rule_from_its_table(capsys):
    assert family_defaults("gamma") == (f"{MODEL_FAMILY_RULES['smollm2']['gamma']:g} for smollm2 (the embedded "
                                        f"SmolLM2-135M-Instruct); the paper's {PAPER_RULE.gamma:g} otherwise")
    assert family_defaults("aggregation") == f"the paper's {PAPER_RULE.aggregation}"
    assert PAPER_RULE == RuleConfig()
    with pytest.raises(SystemExit):
        main(["ask", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert family_defaults("gamma") in help_text and f"(gamma {PAPER_RULE.gamma:g})" in help_text
