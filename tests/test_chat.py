"""pced chat: /history shows its state, a follow-up is retrieved with the names the previous answer
gave and asked as typed, the typed question is echoed once (the tiny random model, the real
retrievers); and a conversation through the real command line on the embedded model."""

import io
import json
import os
import subprocess
import sys

import pytest

from pced.cli import main
from pced.cli.chat import apply_command, follow_up_query, names_added
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


@pytest.mark.parametrize("question, answer, names", [
    ("Who founded the Zorblax Company?", "The Zorblax Company was founded by Mira Quell, an engineer.", ["Mira", "Quell"]),
    ("Who discovered Ferro's Comet?", "Anselm Ferro was a baker. He discovered a comet named Ferro's Comet.", ["Anselm"]),
    ("Is it big?", "Yes, it is. It has 900 people.", []),
])
def test_the_names_an_answer_gave_are_its_capitalized_words_the_question_lacks(question, answer, names):
    assert names_added(question, answer) == names


def test_a_follow_up_is_retrieved_with_the_names_the_previous_answer_gave():
    assert follow_up_query(FOLLOW_UP, []) == FOLLOW_UP  # the first question of a conversation
    turns = [("Q1?", "A1."), (FIRST, "The Zorblax Company was founded by Mira Quell.")]
    assert follow_up_query(FOLLOW_UP, turns) == f"{FOLLOW_UP} Mira Quell"
    assert follow_up_query("And then?", [("Is it big?", "yes")]) == "And then? Is it big?"  # no names: the question before


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
    apply_command("/history off", options, session)
    assert session == {"history": False, "turns": []}  # off forgets the turn


def test_history_on_follows_up_the_question_asked_just_before(capsys):
    """A person asks, then turns history on to follow that answer up: the turn counts."""
    options, session = AskOptions(), {"history": False, "turns": [(FIRST, "Mira Quell.")]}
    apply_command("/history on", options, session)
    apply_command("/history", options, session)
    assert capsys.readouterr().out.endswith(f'history on: the next question follows up on "{FIRST}"\n')


def test_ask_retrieves_with_the_query_and_answers_the_question(store, tiny_llm):
    """The real retrievers: "Where was she born?" with the name the turn gave reads Mira Quell's
    document first; the whole turn would read the company's (the turn's own words); the model is
    asked the question as typed."""
    from pced.store import DocumentStore

    opened = DocumentStore.open(store, llm=tiny_llm)
    options = AskOptions(top_k=2, sampling=SamplingConfig(max_new_tokens=6))
    answer = "The Zorblax Company was founded by Mira Quell."
    query = follow_up_query(FOLLOW_UP, [(FIRST, answer)])
    asked = ask(opened, FOLLOW_UP, options, query=query)
    assert [(c.document.id, c.relevance) for c in asked.candidates] == [
        (c.document.id, c.relevance) for c in opened.retrieve(query, top_k=2)]
    assert asked.candidates[0].document.id == "quell"
    assert opened.retrieve(f"Q: {FIRST}\nA: {answer}\nQ: {FOLLOW_UP}", top_k=2)[0].document.id == "zorblax"
    expected = ask_candidates(opened.generator_for(options.backend, options.backend_settings), asked.candidates, FOLLOW_UP, options).answer()
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


def test_chat_shows_typed_control_characters_literally(store, monkeypatch, capsys):
    """Whatever chat says back about a line (an unknown command, a refused value, the settings, an
    error from asking) shows its escape bytes and bidirectional overrides as text, never sends them."""
    script = ("/\x1b[31mfoo\n/\u202emethod pced\n/method \x1b]0;owned\x07\n/top-k \x1b[2J\n/history \x1b[5m\n"
              "/retriever sparse\x1b[0m\n/settings\n\u202e" + "x" * 100_000 + "\x1b[31m?\n"
              "/max-new-tokens 2\n\u202eWho founded the Zorblax Company?\x1b[31m\n/quit\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO(script))
    assert main(["chat", str(store)]) == 0
    captured = capsys.readouterr()
    for shown in (captured.out, captured.err):
        assert "\x1b" not in shown and "\x07" not in shown and "\u202e" not in shown
    errors = captured.err.splitlines()
    assert errors[0] == "pced: error: unknown command /\\x1b[31mfoo; /help lists them"
    assert errors[1] == "pced: error: unknown command /\\u202emethod; /help lists them"
    assert len(errors) == 7 and all(line.startswith("pced: error: ") for line in errors), errors
    assert "Q: \\u202eWho founded the Zorblax Company?\\x1b[31m\n" in captured.out


def test_counts_take_the_noun_in_the_number_they_need():
    assert [count(n, "document") for n in (0, 1, 2)] == ["0 documents", "1 document", "2 documents"]
    assert count(1, "entry", "entries") == "1 entry" and count(1200, "entry", "entries") == "1,200 entries"


@pytest.mark.slow
def test_a_conversation_on_the_embedded_model(tmp_path):
    """The real command line, the embedded model, documents from the demo corpus: with /history on,
    "Where was she born?" after "Who founded the Zorblax Company?" reads the founder's document first
    and is answered about her, not with the previous answer again. Which town the 135M model then
    names is its own accuracy (over these eight documents it says the Halvard Institute, where she
    studied, even when asked "Where was Mira Quell born?"), so it is not asserted here."""
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
    assert "Mira Quell" in answers[1] and "born" in answers[1] and answers[1] != answers[0]
    experts = [line.split()[1] for line in out.splitlines() if line.strip().startswith("■")]
    assert experts[0] == "zorblax" and experts[len(experts) // 2] == "mira-quell"  # each answer's best document first
    assert "history off" in out and f'follows up on "{FOLLOW_UP}"' in out
