"""pced ask --questions (many questions, one process) and pced chat (driven through stdin)."""

import json
import os

import pytest

from pced.cli import main
from pced.documents import Document
from pced.store import IndexSettings, index_store

from helpers.cli import run_pced as pced

CORPUS = [
    Document("zorblax", "The Zorblax Company makes tidal clocks. It was founded by Mira Quell.", "Zorblax"),
    Document("quell", "Mira Quell was born in the town of Oskvale.", "Mira Quell"),
    Document("oskvale", "Oskvale is a fishing town on Lake Tarnow.", "Oskvale"),
    Document("heron", "The grey heron is the national bird of Elumia.", "Grey heron"),
]
QUESTIONS = ["Where was the founder of Zorblax born?", "What is the national bird of Elumia?", "Which lake is Oskvale on?"]


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_llm):
    root = tmp_path_factory.mktemp("batch") / "store"
    index_store(CORPUS, root, IndexSettings(model=str(tiny_llm.path), storage_dtype="float32"), llm=tiny_llm, progress=False)
    return root


def without_timings(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in ("timings", "id", "question")}


def test_batch_answers_are_the_single_answers(store, tmp_path, capsys):
    settings = ["--top-k", "2", "--max-new-tokens", "8"]
    singles = []
    for question in QUESTIONS:
        assert main(["ask", str(store), question, "--json", *settings]) == 0
        singles.append(json.loads(capsys.readouterr().out))
    plain = tmp_path / "questions.txt"
    plain.write_text("\n".join(QUESTIONS[:2]) + "\n\n" + QUESTIONS[2] + "\n")
    assert main(["ask", str(store), "--questions", str(plain), *settings]) == 0
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert [r["id"] for r in lines] == [1, 2, 4]  # line numbers
    assert [r["question"] for r in lines] == QUESTIONS  # each answer says what it answers
    assert [without_timings(r) for r in lines] == [without_timings(s) for s in singles]
    assert "questions" in captured.err  # the progress bar
    records = tmp_path / "questions.jsonl"
    records.write_text("".join(json.dumps({"id": f"q{i}", "question": q}) + "\n" for i, q in enumerate(QUESTIONS)))
    out = tmp_path / "answers.jsonl"
    assert main(["ask", str(store), "--questions", str(records), "--out", str(out), *settings]) == 0
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["question"]) for r in written] == [("q0", QUESTIONS[0]), ("q1", QUESTIONS[1]), ("q2", QUESTIONS[2])]
    assert [without_timings(r) for r in written] == [without_timings(s) for s in singles]


@pytest.mark.parametrize("content,message", [
    ('{"id": 1, "question": "fine?"}\n{"id": 1, "question": "again?"}\n', ":2: duplicate id 1"),
    ('{"id": 1, "question": "fine?"}\nnot json\n', ":2: invalid JSON"),
    ('{"id": 1, "question": "   "}\n', ":1: the question is empty"),
    ("\n\n", "no questions"),
])
def test_a_bad_questions_file_is_one_line_before_any_model_loads(store, tmp_path, capsys, content, message):
    path = tmp_path / "q.jsonl"
    path.write_text(content)
    assert main(["ask", str(store), "--questions", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert main(["ask", str(store), "Who?", "--questions", str(path)]) == 2
    assert "not both" in capsys.readouterr().err


@pytest.mark.slow
def test_chat_keeps_settings_and_answers_like_ask(store):
    env = {**os.environ, "COLUMNS": "2000"}
    single = pced("ask", str(store), QUESTIONS[0], "--json", "--top-k", "2", "--max-new-tokens", "6", env=env)
    assert single.returncode == 0, single.stderr
    expected = json.loads(single.stdout)
    script = f"/help\n/top-k 2\n/max-new-tokens 6\n/method nope\n/top-k x\n{QUESTIONS[0]}\n/settings\n/quit\nnever asked\n"
    import subprocess
    import sys

    chat = subprocess.run([sys.executable, "-m", "pced.cli", "chat", str(store)], input=script, capture_output=True,
                          text=True, env=env, timeout=600)
    assert chat.returncode == 0, chat.stderr
    out = chat.stdout
    assert "/history [on|off]" in out and "ok: /top-k 2" in out and "ok: /max-new-tokens 6" in out
    assert "unknown method 'nope'" in chat.stderr and "/top-k needs a number" in chat.stderr
    answer_line = next(line for line in out.splitlines() if line.startswith("A: "))
    assert answer_line[3:].rstrip() == expected["answer"].rstrip()
    assert "method pced, top-k 2" in out and "history off" in out
    assert out.count("Q: ") == 1  # /quit ends the session before the last line
