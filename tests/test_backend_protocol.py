"""A backend is a package and one registry line (``pced.backend``): what every registered backend
declares, and the test backend of ``helpers/renamed_backend.py`` (the default backend's rows under
another name), registered as a third party would, driven by ``pced index``, ``pced ask``, the store
verbs, ``pced serve`` and ``pced eval`` without a change outside the tests."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from helpers.cli import run_pced, write_jsonl
from helpers.renamed_backend import NAME, RenamedRows, RenamedSettings
from helpers.server import CORPUS, QUESTION
from pced.backend import DEFAULT_BACKEND, all_backends, backend_names, get_backend, register_backend, unregister_backend
from pced.cli import main
from pced.errors import UserError
from pced.options import METHODS, AskOptions
from pced.decoding.sampling import SamplingConfig

LOFT_TINY = Path(__file__).parent / "fixtures" / "loft_tiny"
TESTS = Path(__file__).parent


@pytest.fixture
def renamed():
    register_backend(NAME, RenamedRows)
    yield get_backend(NAME)
    unregister_backend(NAME)


@pytest.fixture
def corpus(tmp_path) -> Path:
    return write_jsonl(tmp_path / "corpus.jsonl", [{"id": i, "title": t, "text": x} for i, t, x in CORPUS])


def ask_json(capsys, store: Path, backend: str, *extra: str) -> dict:
    capsys.readouterr()
    assert main(["ask", str(store), QUESTION, "--json", "--top-k", "3", "--max-new-tokens", "8", "--backend", backend,
                 *extra]) == 0
    return json.loads(capsys.readouterr().out)


def cache_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*/*/*.safetensors"))


def test_every_registered_backend_declares_itself_and_refuses_from_its_capabilities():
    assert DEFAULT_BACKEND in backend_names() and get_backend(DEFAULT_BACKEND).capabilities.methods is None
    for backend in all_backends():
        assert backend.name and backend.summary and backend is get_backend(backend.name)
        assert isinstance(backend.settings(), backend.settings_class)
        for method in METHODS:
            runs = backend.capabilities.methods is None or method in backend.capabilities.methods
            if runs:
                assert AskOptions(method=method, backend=backend.name).backend_settings == backend.settings()
            else:
                with pytest.raises(UserError, match=f"the {backend.name} backend runs .* only"):
                    AskOptions(method=method, backend=backend.name)
        if not backend.capabilities.sampling:
            with pytest.raises(UserError, match="greedily"):
                AskOptions(backend=backend.name, sampling=SamplingConfig(temperature=0.7))
        if not backend.capabilities.decode_time_relevance:
            with pytest.raises(UserError, match="decode-time relevance"):
                AskOptions(backend=backend.name, rescore=True)
    with pytest.raises(UserError, match="unknown backend 'nope'; choose one of"):
        AskOptions(backend="nope")
    other = next(b for b in all_backends() if b.settings_class is not get_backend(DEFAULT_BACKEND).settings_class)
    with pytest.raises(UserError, match=f"takes {get_backend(DEFAULT_BACKEND).settings_class.__name__}"):
        AskOptions(backend_settings=other.settings())  # another backend's settings are refused, not ignored


def test_a_backend_registered_in_the_tests_indexes_answers_and_is_covered_by_the_store_verbs(
        renamed, tmp_path, tiny_model_dir, corpus, capsys):
    store = tmp_path / "store"
    assert main(["index", str(corpus), "--out", str(store), "--model", str(tiny_model_dir), "--storage-dtype", "float32",
                 "--backend", NAME]) == 0
    assert len(cache_files(store / NAME)) == len(CORPUS) and not (store / "kv").exists()  # its own folder only
    ours = ask_json(capsys, store, NAME, "--renamed-label", "x")
    theirs = ask_json(capsys, store, DEFAULT_BACKEND)  # encodes the default backend's kv/ on the way
    for key in ("answer", "trace", "experts", "beta"):
        assert ours[key] == theirs[key], key  # the same rows: the same answer, token for token
    assert main(["ask", str(store), QUESTION, "--backend", NAME, "--method", "all"]) == 2
    assert f"the {NAME} backend runs pced only; use --backend {DEFAULT_BACKEND} for all" in capsys.readouterr().err

    both = cache_files(store / NAME) + cache_files(store / "kv")
    assert main(["store", "stats", str(store), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["caches_encoded"] == len(CORPUS)
    assert stats["bytes"]["caches"] >= sum(p.stat().st_size for p in both)
    assert main(["verify", str(store)]) == 0
    assert f"{len(both) + 2} cache files checked, 0 damaged" in capsys.readouterr().out  # + each folder's prefix
    assert main(["store", "remove", str(store), "quell"]) == 0
    left = cache_files(store / NAME) + cache_files(store / "kv")
    assert len(left) == len(both) - 2  # the document's cache went from both backends' folders


def test_the_server_answers_on_a_backend_registered_in_the_tests(renamed, tmp_path, tiny_model_dir, corpus, capsys):
    from fastapi.testclient import TestClient

    from pced.server import create_app
    from pced.store import DocumentStore

    store = tmp_path / "store"
    assert main(["index", str(corpus), "--out", str(store), "--model", str(tiny_model_dir), "--backend", NAME]) == 0
    expected = ask_json(capsys, store, DEFAULT_BACKEND)
    app = create_app(DocumentStore.open(store), backend=NAME, settings=RenamedSettings("served"),
                     request_cache_dir=str(tmp_path / "requests"))
    with TestClient(app) as client:
        answer = client.post("/v1/pced/answer", json={"question": QUESTION, "top_k": 3, "max_tokens": 8}).json()
        assert (answer["answer"], answer["trace"]) == (expected["answer"], expected["trace"])
        baseline = client.post("/v1/pced/answer", json={"question": QUESTION, "top_k": 2, "max_tokens": 4, "method": "single"})
        assert baseline.status_code == 200 and baseline.json()["method"] == "single"  # the default backend's lane
        given = client.post("/v1/pced/answer", json={"question": QUESTION, "max_tokens": 4, "documents": [
            {"id": "a", "text": "Mira Quell was born in Oskvale.", "score": 0.9}]})
        assert given.status_code == 200, given.text
        health = client.get("/health").json()
    assert health["backend"]["name"] == NAME
    assert cache_files(tmp_path / "requests" / NAME)  # request documents in its folder of the request cache


@pytest.mark.slow
def test_pced_eval_runs_a_backend_registered_in_the_tests(renamed, tmp_path, tiny_model_dir):
    runs = {}
    for backend, extra in ((NAME, ["--renamed-label", "z"]), (DEFAULT_BACKEND, [])):
        out = tmp_path / backend
        assert main(["eval", "--dataset", str(LOFT_TINY), "--methods", "pced,single", "--top-k", "2", "--max-new-tokens",
                     "4", "--model", str(tiny_model_dir), "--out", str(out), "--work-dir", str(tmp_path / "work"),
                     "--no-progress", "--backend", backend, *extra]) == 0
        records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
        runs[backend] = {(r["example_id"], r["config"]): (r["prediction"], r["trace"]) for r in records}
        runs[backend, "run"] = json.loads((out / "run.json").read_text())["backend"]
    assert runs[NAME] == runs[DEFAULT_BACKEND] and len(runs[NAME]) > 0
    assert (runs[NAME, "run"], runs[DEFAULT_BACKEND, "run"]) == (f"{NAME}:z", None)


@pytest.mark.slow
def test_a_backend_from_another_distribution_is_one_entry_point_line(tmp_path, tiny_model_dir, corpus):
    site = tmp_path / "site"
    info = site / "renamed_backend_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: renamed-backend-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[pced.backends]\n{NAME} = helpers.renamed_backend:RenamedRows\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(TESTS), *sys.path])}
    store = tmp_path / "store"
    result = run_pced("index", str(corpus), "--out", str(store), "--model", str(tiny_model_dir), "--backend", NAME, env=env)
    assert result.returncode == 0, result.stderr
    assert len(cache_files(store / NAME)) == len(CORPUS)
    result = run_pced("ask", str(store), QUESTION, "--json", "--top-k", "3", "--max-new-tokens", "6", "--backend", NAME,
                      env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["trace"]
    result = run_pced("ask", str(store), QUESTION, "--backend", NAME)  # without the entry point: not a backend
    assert result.returncode == 2 and f"invalid choice: '{NAME}'" in result.stderr
