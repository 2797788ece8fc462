"""`pced generate` end to end in a subprocess, and its one-line errors."""

import json
import os

import pytest

from helpers.cli import run_pced

pytestmark = pytest.mark.slow  # `pced generate` in subprocesses

CONTRACT_KEYS = {"answer", "method", "experts", "trace", "beta", "timings"}


def run_cli(args, env_extra=None, cwd=None):
    return run_pced(*args, env=dict(os.environ, **(env_extra or {})), cwd=cwd)


@pytest.fixture
def docs_file(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(
        json.dumps({"id": "a", "text": "Mira Quell founded Zorblax.", "score": 0.9}) + "\n"
        + json.dumps({"id": "b", "text": "Mira Quell was born in Oskvale.", "score": 0.6, "title": "Quell"}) + "\n"
    )
    return path


def test_generate_json_follows_the_contract(tiny_model_dir, docs_file, tmp_path):
    result = run_cli(["generate", "--docs", str(docs_file), "--question", "Where was the founder born?", "--json",
                      "--model", str(tiny_model_dir), "--max-new-tokens", "8", "--kv-dir", str(tmp_path / "kv")])
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert CONTRACT_KEYS <= set(out)
    assert out["method"] == "pced"
    assert [e["doc_id"] for e in out["experts"]] == ["a", "b"]
    assert [e["relevance"] for e in out["experts"]] == [0.9, 0.6]
    assert 1 <= len(out["trace"]) <= 8
    assert all(t["doc_id"] in {"a", "b", None} and isinstance(t["token"], str) for t in out["trace"])
    assert "".join(t["token"] for t in out["trace"]) == out["answer"]
    assert len(out["beta"]) == 2
    assert {"retrieval_s", "cache_load_s", "ttft_s", "total_s"} <= set(out["timings"])


@pytest.mark.parametrize(
    "content,message",
    [
        ('{"id": "a", "text": "x", "score": 0.5}\n{not json}\n', "invalid JSON"),
        ('{"id": "a", "text": "", "score": 0.5}\n', "non-empty"),
        ('{"id": "a", "text": "x", "score": 1.5}\n', "score"),
        ('{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n', "duplicate id"),
    ],
)
def test_bad_docs_give_one_line_errors(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    result = run_cli(["generate", "--docs", str(path), "--question", "q?", "--model", str(tmp_path / "none")])
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_missing_model_and_bad_flags(tmp_path, docs_file):
    result = run_cli(["generate", "--docs", str(docs_file), "--question", "q?", "--model", str(tmp_path / "nowhere")])
    assert result.returncode == 2 and "does not exist" in result.stderr
    (tmp_path / "notlm").mkdir()
    (tmp_path / "notlm" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    result = run_cli(["generate", "--docs", str(docs_file), "--question", "q?", "--model", str(tmp_path / "notlm")])
    assert result.returncode == 2 and result.stderr.startswith("pced: error:")
    result = run_cli(["generate", "--docs", str(docs_file), "--question", "q?", "--beta", "often"])
    assert result.returncode == 2


def test_generate_with_500_documents_is_refused_in_under_a_second(tmp_path, capsys):
    import time

    from pced.cli import InputError, build_parser, main

    path = tmp_path / "many.jsonl"
    path.write_text("".join(json.dumps({"id": f"d{i}", "text": f"Document number {i}.", "score": 0.5}) + "\n"
                            for i in range(500)))
    argv = ["generate", "--docs", str(path), "--question", "Which one?", "--kv-dir", str(tmp_path / "kv")]
    args = build_parser().parse_args(argv)  # what every pced command imports first (torch among them)
    started = time.perf_counter()
    with pytest.raises(InputError, match="^at most 64 documents per question, got 500$"):
        args.func(args)
    elapsed = time.perf_counter() - started
    assert elapsed < 1.0, elapsed  # refused before any model loads (it took 88 s to fail before)
    assert not (tmp_path / "kv").exists()
    assert main(argv) == 2 and capsys.readouterr().err.strip() == "pced: error: at most 64 documents per question, got 500"
    result = run_cli(argv)  # and the same one line from the command line
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["pced: error: at most 64 documents per question, got 500"]


def test_generate_refuses_a_document_longer_than_the_server_takes(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"id": "huge", "text": "word " * 20_000}) + "\n")
    result = run_cli(["generate", "--docs", str(path), "--question", "Which one?", "--kv-dir", str(tmp_path / "kv")])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "pced: error: document 'huge' has 100000 characters; at most 20000 per document (split it)"]
