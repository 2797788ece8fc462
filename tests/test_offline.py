"""Process state belongs to entry points: ``pced`` sets the offline switches (pced.cli.offline), a
library call sets no environment variable and still never reaches for the network."""

from __future__ import annotations

import os

import pytest

OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_PROGRESS_BARS")
# load_model still sets this one for SDPA's grouped-query attention; it moves into the attention call elsewhere
NOT_YET_MOVED = {"TRANSFORMERS_SDPA_FORCE_GQA"}


def test_the_command_line_switches_the_process_offline(tmp_path, monkeypatch, capsys):
    from pced.cli import main

    for name in OFFLINE:
        monkeypatch.delenv(name, raising=False)
    assert main(["verify", str(tmp_path / "no-store")]) == 2  # any subcommand, even one that fails
    assert {name: os.environ.get(name) for name in OFFLINE} == dict.fromkeys(OFFLINE, "1")


def test_loading_models_sets_no_environment_variable_and_stays_local(tiny_model_dir, tmp_path, monkeypatch):
    from pced.llm import load_model
    from pced.retrieval.dense import DenseRetriever

    for name in OFFLINE:
        monkeypatch.delenv(name, raising=False)
    before = dict(os.environ)
    llm = load_model(tiny_model_dir, device="cpu", dtype="float32")
    retriever = DenseRetriever()
    assert retriever.model is not None and llm.model is not None
    changed = {k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)}
    assert changed <= NOT_YET_MOVED, changed
    with pytest.raises(FileNotFoundError, match="not a local directory"):  # a hub name is refused, never fetched
        DenseRetriever("sentence-transformers/all-MiniLM-L6-v2")
