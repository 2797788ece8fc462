"""pced chat: /history shows its state, a follow-up is retrieved with the previous turn and asked
as typed, the typed question is echoed once (the tiny random model); and a conversation through
the real command line on the embedded model."""

import io
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from pced.cli import main
from pced.cli.chat import apply_command, follow_up, with_previous_turn
from pced.cli.common import InputError
from pced.cli.terminal import count
from pced.documents import Document
from pced.options import AskOptions, SamplingConfig
from pced.pipeline import ask, ask_candidates
from pced.store import IndexSettings, index_store

CORPUS = [
    Document("zorblax", "The Zorblax Company makes tidal clocks. It was founded by Mira Quell.", "Zorblax"),
    Document("quell", "Mira Quell was born in the town of Oskvale.", "Mira Quell"),
    Document("oskvale", "Oskvale is a fishing town on Lake Tarnow.", "Oskvale"),
    Document("heron", "The grey heron is the national bird of Elumia.", "Grey heron"),
    Document("renn", "Tobias Renn was an architect. He was born in Pellmoor.", "Tobias Renn"),
]
FIRST, FOLLOW_UP = "Who founded the Zorblax Company?", "Where was she born?"


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_llm):
    root = tmp_path_factory.mktemp("chat") / "store"
    index_store(CORPUS, root, IndexSettings(model=str(tiny_llm.path), storage_dtype="float32"), llm=tiny_llm, progress=False)
    return root


def test_a_follow_up_is_retrieved_with_the_previous_turn_and_asked_as_typed():
    turns = [(FIRST, "Mira Quell founded it.")]
    query, question = follow_up(FOLLOW_UP, turns)
    assert question == FOLLOW_UP
    assert query == f"Q: {FIRST}\nA: Mira Quell founded it.\nQ: {FOLLOW_UP}" == with_previous_turn(FOLLOW_UP, turns)
    assert follow_up(FOLLOW_UP, []) == (FOLLOW_UP, FOLLOW_UP)  # the first question of a conversation


def test_history_alone_shows_the_state_and_a_bad_value_is_one_line(capsys):
    options, session = AskOptions(), {"history": False, "turns": []}
    assert apply_command("/history", options, session) is options
    assert capsys.readouterr().out.startswith("history off: each question is asked on its own")
    apply_command("/history on", options, session)
    assert capsys.readouterr().out == "ok: /history on\n" and session == {"history": True, "turns": []}
    apply_command("/history", options, session)
    assert "the next question is the first" in capsys.readouterr().out
    session["turns"] = [(FIRST, "Mira Quell.")]
    apply_command("/history", options, session)
    assert capsys.readouterr().out == f'history on: the next question follows up on "{FIRST}"\n'
    with pytest.raises(InputError, match="^/history takes on or off, got 'maybe'$"):
        apply_command("/history maybe", options, session)
    assert session["history"] is True  # a bad value changes nothing


def test_ask_retrieves_with_the_query_and_answers_the_question(store, tiny_llm):
    from pced.store import DocumentStore

    opened = DocumentStore.open(store, llm=tiny_llm)
    options = AskOptions(top_k=2, sampling=SamplingConfig(max_new_tokens=6))
    query = with_previous_turn(FOLLOW_UP, [(FIRST, "Mira Quell founded it.")])
    asked = ask(opened, FOLLOW_UP, options, query=query)
    by_query = ask(opened, query, options)
    assert [(c.document.id, c.relevance) for c in asked.candidates] == [(c.document.id, c.relevance) for c in by_query.candidates]
    alone = ask(opened, FOLLOW_UP, options)
    assert [c.document.id for c in asked.candidates] != [c.document.id for c in alone.candidates]  # the turn changed what was read
    expected = ask_candidates(opened.generator_for(options), asked.candidates, FOLLOW_UP, options).answer()
    assert asked.question == FOLLOW_UP and asked.answer().token_ids == expected.token_ids


def test_chat_echoes_what_was_typed_once(store, monkeypatch, capsys):
    script = f"/history\n/history on\n/top-k 2\n/max-new-tokens 4\n{FIRST}\n{FOLLOW_UP}\n/history\n/quit\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(script))
    monkeypatch.setenv("COLUMNS", "2000")
    assert main(["chat", str(store)]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("Q: ")] == [f"Q: {FIRST}", f"Q: {FOLLOW_UP}"]
    assert "history off: each question is asked on its own" in out
    assert f'history on: the next question follows up on "{FOLLOW_UP}"' in out


def test_counts_take_the_noun_in_the_number_they_need():
    assert [count(n, "document") for n in (0, 1, 2)] == ["0 documents", "1 document", "2 documents"]
    assert count(1, "entry", "entries") == "1 entry" and count(1200, "entry", "entries") == "1,200 entries"


@pytest.mark.slow
def test_a_conversation_on_the_embedded_model(tmp_path):
    """The real command line, the embedded model, documents from the demo corpus: with /history on,
    "Where was she born?" after "Who founded the Zorblax Company?" is answered with the founder's
    birthplace, not the previous answer again."""
    from importlib import resources

    corpus = resources.files("pced") / "data" / "demo_corpus.jsonl"
    wanted = {"zorblax", "mira-quell", "oskvale", "tobias-renn", "ilse-marrow", "quell-prize", "halvard", "elumia"}
    lines = [line for line in corpus.read_text().splitlines() if json.loads(line)["id"] in wanted]
    (tmp_path / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    env = {**os.environ, "COLUMNS": "2000"}
    built = subprocess.run([sys.executable, "-m", "pced.cli", "index", str(tmp_path / "corpus.jsonl"), "--out",
                            str(tmp_path / "store")], capture_output=True, text=True, env=env, timeout=900)
    assert built.returncode == 0, built.stderr[-2000:]
    script = f"/history\n/history on\n{FIRST}\n{FOLLOW_UP}\n/history\n/quit\n"
    chat = subprocess.run([sys.executable, "-m", "pced.cli", "chat", str(tmp_path / "store")], input=script,
                          capture_output=True, text=True, env=env, timeout=900)
    assert chat.returncode == 0, chat.stderr[-2000:]
    out = chat.stdout
    answers = [line[3:] for line in out.splitlines() if line.startswith("A: ")]
    assert [line for line in out.splitlines() if line.startswith("Q: ")] == [f"Q: {FIRST}", f"Q: {FOLLOW_UP}"]
    assert len(answers) == 2 and "Mira Quell" in answers[0]
    assert "Oskvale" in answers[1] and answers[1] != answers[0]
    assert "history off" in out and f'follows up on "{FOLLOW_UP}"' in out
