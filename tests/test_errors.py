"""The error family: bad input and damaged data are reported as one line by kind; anything else
is a bug, reported as one (a 500 with a logged traceback, "internal error, please report" on the
CLI), never as the user's fault, even when it is a ValueError."""

from __future__ import annotations

import logging

import pytest

from pced.cli import main
from pced.decoding.loop import DecodingError
from pced.errors import DataError, PcedError, UserError
from pced.evaluation.records import DatasetError
from pced.kv.format import CacheError
from pced.llm import ModelLoadError
from pced.options import QuestionError
from pced.text.prompts import PromptError
from pced.store import StoreError
from helpers.server import QUESTION, tiny_store


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_llm):
    return tiny_store(tmp_path_factory, tiny_llm)


def test_every_error_pced_raises_on_purpose_is_of_one_kind():
    from pced.cli.common import InputError
    from pced.corpus.reader import CorpusError
    from pced.evaluation.config import EvalError
    from pced.server.schemas import RequestError

    for user in (InputError, CorpusError, EvalError, DatasetError, ModelLoadError, PromptError, QuestionError, RequestError):
        assert issubclass(user, UserError) and issubclass(user, ValueError), user
    for data in (CacheError, DecodingError, StoreError):
        assert issubclass(data, DataError) and not issubclass(data, UserError), data
    assert issubclass(UserError, PcedError) and issubclass(DataError, PcedError)


def a_bug(*args, **kwargs):
    raise ValueError("a bug deep in the decoding loop")


def test_an_unexpected_value_error_in_the_pipeline_is_a_500_with_a_logged_traceback(store, monkeypatch, caplog):
    from fastapi.testclient import TestClient

    from pced.server import create_app

    monkeypatch.setattr("pced.decoding.loop.pick_token", a_bug)
    with TestClient(create_app(store), raise_server_exceptions=False) as client:
        with caplog.at_level(logging.ERROR, logger="pced.server"):
            response = client.post("/v1/pced/answer", json={"question": QUESTION, "max_tokens": 4})
            streamed = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": QUESTION}],
                                                                  "stream": True, "max_tokens": 4})
        health = client.get("/health").json()
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error" and "a bug" not in response.text
    assert streamed.status_code == 500 and streamed.json()["error"]["code"] == "internal_error"
    logged = [r for r in caplog.records if r.name == "pced.server" and r.exc_info]
    assert len(logged) == 2 and all("a bug deep in the decoding loop" in str(r.exc_info[1]) for r in logged)
    assert health["failed"] == 2


def test_a_user_error_deep_in_the_pipeline_is_still_a_400_without_a_traceback(store, monkeypatch, caplog):
    from fastapi.testclient import TestClient

    from pced.server import create_app

    def refused(*args, **kwargs):
        raise UserError("this setting is refused")

    monkeypatch.setattr("pced.decoding.loop.pick_token", refused)
    with TestClient(create_app(store), raise_server_exceptions=False) as client:
        with caplog.at_level(logging.ERROR, logger="pced.server"):
            response = client.post("/v1/pced/answer", json={"question": QUESTION, "max_tokens": 4})
    assert response.status_code == 400 and response.json()["error"]["message"] == "this setting is refused"
    assert not [r for r in caplog.records if r.name == "pced.server"]


def test_an_unexpected_value_error_on_the_cli_is_an_internal_error_not_bad_input(store, tiny_model_dir, monkeypatch,
                                                                                    capsys):
    monkeypatch.setattr("pced.decoding.loop.pick_token", a_bug)
    code = main(["ask", str(store.root), QUESTION, "--model", str(tiny_model_dir), "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "Traceback" in err and "ValueError: a bug deep in the decoding loop" in err
    assert "internal error, please report" in err.strip().splitlines()[-1]
    assert "pced: error:" not in err


def test_damaged_data_is_one_line_exit_2_on_the_cli(store, tiny_model_dir, monkeypatch, capsys):
    def damaged(*args, **kwargs):
        raise CacheError("cache file X is damaged")

    monkeypatch.setattr("pced.decoding.loop.pick_token", damaged)
    code = main(["ask", str(store.root), QUESTION, "--model", str(tiny_model_dir), "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == "pced: error: cache file X is damaged", err
