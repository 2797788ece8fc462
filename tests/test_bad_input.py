"""Every bad input a user can give gets one line on stderr and exit 2 (CLI) or a 4xx JSON error
(server); never a traceback, never a 500, never damaged stored data.

Sections: settings (the dataclasses that own them refuse them, for the CLI, the library and the
server alike); stored data (manifests, retrieval indexes); files given to commands (corpora,
--docs, eval data); user text printed literally; the server; concurrent and repeated indexing."""

import contextlib
import errno
import json
import shutil
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
    (["Who?", "--temperature", "1e-300"], "temperature must be 0 (greedy) or between 0.01 and 10"),
    (["Who?", "--temperature", "nan"], "temperature must be 0 (greedy)"),
    (["Who?", "--temperature", "0.5", "--sample-top-p", "1e-300"], "top_p must be between 0.01 and 1"),
    (["Who?", "--beta", "1e308"], "beta must be dynamic or elementwise or a number between 0 and 10"),
    (["Who?", "--beta", "-1"], "beta must be"),
    (["Who?", "--gamma", "1e308"], "gamma must be a number between 0 and 1000"),
    (["Who?", "--gamma", "inf"], "gamma must be"),
    (["Who?", "--max-new-tokens", "100000000"], "max_new_tokens must be an integer between 1 and"),
    (["Who?", "--seed", "-5"], "seed must be an integer between 0 and 2**63 - 1"),
    (["Who?", "--stop", ""], "stop must be a tuple of non-empty strings"),
    (["Who?", "--prune-margin", "nan"], "prune_margin must be a finite number"),
    (["Who?", "--backend", "llamacpp", "--gpu-layers", "-1"], "--gpu-layers must be 0 or more"),
])
def test_unbounded_or_invalid_ask_options_are_refused_before_any_model_loads(store_dir, capsys, argv, expected):
    one_line_error(capsys, main(["ask", str(store_dir), *argv]), expected)


@pytest.mark.parametrize("value", ["0", "nan", "-5"])
def test_a_request_timeout_that_is_not_a_positive_number_is_refused(store_dir, capsys, value):
    one_line_error(capsys, main(["serve", str(store_dir), "--request-timeout", value]),
                   "--request-timeout must be a finite number of seconds > 0")


def test_library_settings_are_refused_by_the_dataclasses_that_own_them():
    from pced.errors import UserError
    from pced.options import AskOptions
    from pced.decoding.rule import RuleConfig
    from pced.decoding.sampling import SamplingConfig

    for make in (lambda: SamplingConfig(temperature=1e-300), lambda: SamplingConfig(temperature=0.5, top_p=1e-300),
                 lambda: SamplingConfig(max_new_tokens=100_000_000), lambda: SamplingConfig(max_new_tokens=True),
                 lambda: RuleConfig(beta=1e308), lambda: RuleConfig(gamma=float("nan")),
                 lambda: AskOptions(beta=1e308), lambda: AskOptions(top_k=2.5), lambda: AskOptions(ape_scale=float("inf"))):
        with pytest.raises(UserError):
            make()


def test_max_new_tokens_beyond_the_models_window_is_one_line_before_any_buffer(store_dir, tiny_model_dir, capsys):
    # the tiny model's window is 2048: 100,000 is within the absolute cap, not within the window
    code = main(["ask", str(store_dir), "Who?", "--model", str(tiny_model_dir), "--max-new-tokens", "100000"])
    one_line_error(capsys, code, "max_new_tokens 100000 does not fit the model's 2048-token window")
    code = main(["ask", str(store_dir), "Who?", "--model", str(tiny_model_dir), "--max-new-tokens", "2040"])
    one_line_error(capsys, code, "with 2040 new tokens it exceeds the model's 2048-token window")


# -- stored data ------------------------------------------------------------------------------


def _drop(key):
    def change(manifest):
        del manifest[key]
        return manifest
    return change


def _setting(key, value):
    def change(manifest):
        manifest["settings"][key] = value
        return manifest
    return change


@pytest.mark.parametrize("change, expected", [
    (lambda manifest: [], "expected a JSON object, found list"),
    (_drop("settings"), "no 'settings' object"),
    (_drop("model"), "'model' must be an object"),
    (_setting("colour", "red"), "unknown setting 'colour'"),
    (_setting("template", "fancy"), "settings.template must be one of rag, icl"),
    (_setting("max_doc_tokens", "many"), "settings.max_doc_tokens must be an integer"),
], ids=["list", "no-settings", "no-model", "unknown-setting", "bad-template", "bad-max-doc-tokens"])
def test_a_manifest_off_its_schema_is_one_line_naming_it(store_dir, tiny_model_dir, tmp_path, capsys, change, expected):
    copy = tmp_path / "store"
    shutil.copytree(store_dir, copy)
    manifest = copy / "manifest.json"
    manifest.write_text(json.dumps(change(json.loads(manifest.read_text()))))
    one_line_error(capsys, main(["verify", str(copy)]), f"{manifest}: {expected}")
    one_line_error(capsys, main(["ask", str(copy), "Who?", "--model", str(tiny_model_dir)]), f"{manifest}: {expected}")
    manifest.write_text("{not json")
    one_line_error(capsys, main(["verify", str(copy)]), f"{manifest}: not readable JSON")


def test_a_truncated_dense_index_fails_verify_and_ask_naming_the_file(store_dir, tiny_model_dir, tmp_path, capsys):
    import numpy as np

    copy = tmp_path / "store"
    shutil.copytree(store_dir, copy)
    embeddings = DocumentStore.open(copy).state / "retrievers" / "dense" / "embeddings.npy"
    full = embeddings.read_bytes()
    embeddings.write_bytes(full[: len(full) // 2])
    assert main(["verify", str(copy)]) == 1
    err = capsys.readouterr().err
    assert f"pced: damaged: {embeddings}: missing or damaged index file" in err and "Traceback" not in err, err
    one_line_error(capsys, main(["ask", str(copy), "Who?", "--model", str(tiny_model_dir)]), f"{embeddings}: missing or damaged")
    original = DocumentStore.open(store_dir).state / "retrievers" / "dense" / "embeddings.npy"
    np.save(embeddings, np.load(original)[:1])  # whole, but a row short
    one_line_error(capsys, main(["ask", str(copy), "Who?", "--model", str(tiny_model_dir)]),
                   f"{embeddings}: (1, 384) embeddings for 2 documents")
    shutil.copy(original, embeddings)
    assert main(["verify", str(copy)]) == 0


# -- files given to commands ------------------------------------------------------------------


def test_a_hotpotqa_file_of_the_wrong_shape_is_named_by_pced_eval(tmp_path, tiny_model_dir, capsys):
    data = tmp_path / "data"
    (data / "hotpotqa").mkdir(parents=True)
    rows = [{"_id": "q1", "question": "Who?", "answer": "Mira", "context": [["Zorblax", ["It was founded by Mira."]]]}]
    path = data / "hotpotqa" / "hotpotqa_train_100.json"
    path.write_text(json.dumps(rows))  # no supporting_facts
    code = main(["eval", "--dataset", "hotpotqa", "--data-dir", str(data), "--limit", "1", "--model", str(tiny_model_dir),
                 "--out", str(tmp_path / "out"), "--no-progress"])
    one_line_error(capsys, code, f"{path}: question 0: field 'supporting_facts' is missing")
    path.write_text(json.dumps([{**rows[0], "supporting_facts": [["Zorblax"]]}]))  # a pair cut short
    code = main(["eval", "--dataset", "hotpotqa", "--data-dir", str(data), "--limit", "1", "--model", str(tiny_model_dir),
                 "--out", str(tmp_path / "out"), "--no-progress"])
    one_line_error(capsys, code, f"{path}: question 0: field 'supporting_facts[0]' must be a [title, sentence index] pair")


@pytest.mark.parametrize("digits", [401, 5000])
def test_a_score_with_hundreds_of_digits_is_one_line(tmp_path, capsys, digits):
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"id": "a", "text": "Mira Quell founded Zorblax.", "score": ' + "9" * digits + "}\n")
    # 401 digits parse (and used to overflow float()); 5000 pass Python's digit limit for int()
    expected = "'score' must be a number in [0, 1]" if digits == 401 else "invalid JSON (Exceeds the limit"
    one_line_error(capsys, main(["generate", "--docs", str(docs), "--question", "Who?"]), f"{docs}:1: {expected}")


# -- user text printed literally --------------------------------------------------------------


def test_markup_in_a_question_is_printed_literally(store_dir, tiny_model_dir, capsys):
    question = "Who [/] founded [red]Zorblax[/red]?"
    code = main(["ask", str(store_dir), question, "--model", str(tiny_model_dir), "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert code == 0 and f"Q: {question}" in out and "Traceback" not in err, (out, err)


def test_terminal_escapes_in_ids_titles_and_questions_are_shown_not_sent(tmp_path, tiny_model_dir, capsys):
    docs = write_jsonl(tmp_path / "docs.jsonl", [
        {"id": "evil\x1b[31m", "title": "\x1b]0;pwned\x07Title", "text": "Mira Quell founded Zorblax.", "score": 0.9},
        {"id": "bidi\u202eexe.txt", "text": "Oskvale is a fishing town.", "score": 0.5},
    ])
    code = main(["generate", "--docs", str(docs), "--question", "Who \x1b[2J founded Zorblax?", "--model",
                 str(tiny_model_dir), "--max-new-tokens", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "\x1b" not in out and "\x07" not in out and "\u202e" not in out, repr(out)
    assert "evil\\x1b[31m" in out and "\\x1b]0;pwned\\x07Title" in out and "bidi\\u202eexe.txt" in out
    assert "Who \\x1b[2J founded" in out


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


def test_server_refuses_numbers_out_of_range_with_a_400(store_dir, tiny_llm):
    from fastapi.testclient import TestClient

    from pced.server import Limits, create_app

    app = create_app(DocumentStore.open(store_dir, tiny_llm), Limits(max_tokens=100_000))
    chat = {"messages": [{"role": "user", "content": "Who?"}], "max_tokens": 2}
    cases = [
        ("/v1/chat/completions", {**chat, "temperature": 1e-300}, "temperature"),
        ("/v1/chat/completions", {**chat, "temperature": 0.5, "top_p": 1e-300}, "top_p"),
        ("/v1/pced/answer", {"question": "Who?", "max_tokens": 2, "beta": 1e308}, "beta must be"),
        ("/v1/pced/answer", {"question": "Who?", "max_tokens": 2, "gamma": 1e308}, "gamma must be"),
        ("/v1/chat/completions", {**chat, "pced": {"beta": 1e308}}, "beta must be"),
        ("/v1/pced/answer", {"question": "Who?", "max_tokens": 100_000}, "does not fit the model's 2048-token window"),
        ("/v1/pced/answer", {"question": "Who?", "max_tokens": 2040}, "exceeds the model's 2048-token window"),
    ]
    with TestClient(app, raise_server_exceptions=False) as client:
        for path, body, expected in cases:
            response = client.post(path, json=body)
            assert response.status_code == 400, (body, response.text)
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and expected in (error["message"] + str(error["param"])), error
        assert client.post("/v1/pced/answer", json={"question": "Who?", "max_tokens": 2}).status_code == 200


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
