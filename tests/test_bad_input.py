"""Every bad input a user can give gets one line on stderr and exit 2 (CLI) or a 4xx JSON error
(server); never a traceback, never a 500, never damaged stored data."""

import contextlib
import errno
import json
import subprocess
import sys

import pytest

from pced.cli import main
from pced.documents import Document
from pced.options import MAX_QUESTION_CHARS, MAX_TOP_K
from pced.store import DocumentStore, IndexSettings, index_store

from helpers.cli import write_jsonl

DOCS = [Document("zorblax", "The Zorblax Company makes tidal clocks. It was founded by Mira Quell.", "Zorblax"),
        Document("quell", "Mira Quell was born in the town of Oskvale.", "Mira Quell")]


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, tiny_llm):
    root = tmp_path_factory.mktemp("bad-input") / "store"
    index_store(DOCS, root, IndexSettings(model=str(tiny_llm.path), storage_dtype="float32"), llm=tiny_llm, progress=False)
    return root


def one_line_error(capsys, code: int, expected: str) -> None:
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "pced: error:" in line]
    assert code == 2 and len(errors) == 1 and expected in errors[0] and "Traceback" not in err, err


@pytest.mark.slow
def test_question_with_undecodable_bytes_is_one_line(store_dir, tiny_model_dir):
    # the shell hands Python bytes that are not UTF-8: they arrive as lone surrogates
    result = subprocess.run([sys.executable, "-m", "pced.cli", "ask", str(store_dir), b"Who \xff Cola?", "--model",
                             str(tiny_model_dir)], capture_output=True, timeout=300)
    lines = result.stderr.decode().strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "not valid UTF-8" in lines[0], lines


@pytest.mark.parametrize("argv, expected", [
    (["x" * 100_000], f"longer than {MAX_QUESTION_CHARS} characters"),
    (["Who?", "--top-k", "300"], f"top_k must be between 1 and {MAX_TOP_K}"),
    (["Who?", "--top-n", "0"], "top_n must be between"),
    (["Who?", "--max-experts", "500"], "max_experts must be between"),
    (["Who?", "--method", "magic"], "unknown method"),
    (["Who?", "--threads", "0"], "--threads must be at least 1"),
    (["Who?", "--no-repeat-ngram", "-1"], "no_repeat_ngram must be an integer >= 0"),
    (["Who?", "--no-repeat-ngram", "3", "--backend", "vllm"], "--no-repeat-ngram is not supported with --backend vllm"),
    (["  "], "the question is empty"),
    (["Who?", "--backend", "vllm", "--kv-transfer-config", "/nonexistent/kv.json"], "not a readable JSON file"),
])
def test_unbounded_or_invalid_ask_options_are_refused_before_any_model_loads(store_dir, capsys, argv, expected):
    one_line_error(capsys, main(["ask", str(store_dir), *argv]), expected)


def test_a_kv_transfer_config_without_a_connector_is_refused_before_any_engine_starts(store_dir, tmp_path, capsys):
    config = tmp_path / "kv.json"
    config.write_text(json.dumps({"kv_role": "kv_both"}))
    one_line_error(capsys, main(["ask", str(store_dir), "Who?", "--backend", "vllm", "--kv-transfer-config", str(config)]),
                   "expected a JSON object with 'kv_connector'")


def test_corpus_with_a_latin1_line_names_file_and_line(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(b'{"id": "a", "text": "fine"}\n{"id": "b", "text": "caf\xe9"}\n')
    one_line_error(capsys, main(["index", str(corpus), "--out", str(tmp_path / "s")]), f"{corpus}:2: not UTF-8")
    assert not (tmp_path / "s").exists()
    docs = tmp_path / "docs.jsonl"
    docs.write_bytes(b'{"id": "a", "text": "caf\xe9", "score": 0.5}\n')
    one_line_error(capsys, main(["generate", "--docs", str(docs), "--question", "q?"]), f"{docs}:1: not UTF-8")


@contextlib.contextmanager
def read_only_writes(path):
    raise PermissionError(errno.EACCES, "Permission denied", str(path))
    yield  # pragma: no cover


def test_read_only_store_is_one_line_and_keeps_the_store(store_dir, tiny_model_dir, tmp_path, capsys, monkeypatch):
    # root ignores permission bits, so the store's file system refusing writes is simulated at the one writer
    monkeypatch.setattr("pced.fs.atomic_path", read_only_writes)
    more = write_jsonl(tmp_path / "more.jsonl", [{"id": "new", "text": "Oskvale is a fishing town on Lake Tarnow."}])
    documents = DocumentStore.open(store_dir).state / "documents.jsonl"
    before = documents.read_bytes()
    code = main(["index", str(more), "--out", str(store_dir), "--model", str(tiny_model_dir), "--storage-dtype", "float32"])
    one_line_error(capsys, code, "Permission denied")
    assert documents.read_bytes() == before
    assert [d.id for d in DocumentStore.open(store_dir).documents] == ["zorblax", "quell"]


def test_server_refuses_lone_surrogates_and_oversized_input(store_dir, tiny_llm):
    from fastapi.testclient import TestClient

    from pced.server import create_app

    with TestClient(create_app(DocumentStore.open(store_dir, tiny_llm)), raise_server_exceptions=False) as client:
        cases = [
            ('{"question": "Who \\udcff?"}', "question", "invalid_encoding"),
            ('{"messages": [{"role": "user", "content": "Who \\udcff?"}]}', "question", "invalid_encoding"),
            # pydantic's strict string fields refuse it themselves
            ('{"question": "Who?", "documents": [{"text": "bad \\ud800 text"}]}', "documents.0.text", "invalid_value"),
            (json.dumps({"question": "x" * 100_000}), "question", "question_too_long"),
            (json.dumps({"question": "Who?", "top_k": 300}), "top_k", "invalid_value"),
        ]
        for body, param, code in cases:
            path = "/v1/chat/completions" if "messages" in body else "/v1/pced/answer"
            response = client.post(path, content=body, headers={"Content-Type": "application/json"})
            assert response.status_code == 400, (body[:60], response.text)
            error = response.json()["error"]
            assert error["code"] == code and error["param"] == param, error


@pytest.mark.slow
def test_two_concurrent_index_runs_keep_every_document(tmp_path, tiny_model_dir):
    a = write_jsonl(tmp_path / "a.jsonl", [{"id": f"a{i}", "text": f"Alpha fact {i}: item {i} is red. " * 6} for i in range(15)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"id": f"b{i}", "text": f"Beta fact {i}: item {i} is blue. " * 6} for i in range(30)])
    store = tmp_path / "store"
    runs = [subprocess.Popen([sys.executable, "-m", "pced.cli", "index", str(corpus), "--out", str(store), "--model",
                              str(tiny_model_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for corpus in (a, b)]
    outputs = [run.communicate(timeout=600) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    opened = DocumentStore.open(store)
    assert sorted(d.id for d in opened.documents) == sorted([f"a{i}" for i in range(15)] + [f"b{i}" for i in range(30)])
    kv_files = sorted((store / "kv" / "kv").glob("*/*.safetensors"))
    assert len(kv_files) == 45  # one cache per document, nothing orphaned
    assert not list(store.rglob(".tmp-*"))


def test_replaced_documents_leave_no_orphan_caches(tmp_path, tiny_llm):
    settings = IndexSettings(model=str(tiny_llm.path), storage_dtype="float32")
    index_store(DOCS, tmp_path / "s", settings, llm=tiny_llm, progress=False)
    _, report = index_store([Document("quell", "Mira Quell was born in Brask.")], tmp_path / "s", settings, llm=tiny_llm,
                            progress=False)
    # the replaced text's cache outlives one run: a reader of the previous state may still load it
    assert report["kv_orphans_removed"] == 0
    _, report = index_store([Document("quell", "Mira Quell was born in Brask.")], tmp_path / "s", settings, llm=tiny_llm,
                            progress=False)
    assert report["kv_orphans_removed"] == 1
    assert len(list((tmp_path / "s" / "kv" / "kv").glob("*/*.safetensors"))) == 2


def test_version_and_threads(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("pced ")
    with pytest.raises(SystemExit):
        main(["ask", "--help"])
    assert "--threads" in capsys.readouterr().out
