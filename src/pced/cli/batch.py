"""``pced ask STORE --questions FILE``: many questions in one process, JSON Lines out.

FILE holds one question a line, or JSON Lines ``{"id", "question"}`` (chosen by content: a first
line that is a JSON object with "question" makes the whole file JSON Lines). Every question is
checked before the model loads; the model, the retrievers and the store are then loaded once and
each answer is written as soon as it is done: ``id`` (the given id, or the question's line
number), ``question``, then the ``pced ask --json`` object. A question that fails while answering gets
``{"id", "question", "error"}`` and the others go on (exit code 1 at the end).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..options import QuestionError, check_question
from .common import InputError, ask_options_from, open_store


def read_questions(path: Path) -> list[tuple[object, str]]:
    """(id, question) of every non-blank line; a one-line ``InputError`` naming the line otherwise."""
    if not path.is_file():
        raise InputError(f"{path}: no such questions file")
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError:
        raise InputError(f"{path}: not UTF-8 text; save the file as UTF-8") from None
    numbered = [(n, line) for n, line in enumerate(lines, start=1) if line.strip()]
    if not numbered:
        raise InputError(f"{path}: no questions")
    json_lines = _is_question_record(numbered[0][1])
    questions, seen = [], set()
    for number, line in numbered:
        where = f"{path}:{number}"
        if json_lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{where}: invalid JSON ({exc.msg}); expected {{\"id\", \"question\"}} on every line") from None
            if not isinstance(record, dict) or not isinstance(record.get("question"), str):
                raise InputError(f"{where}: expected {{\"id\", \"question\"}} with a string 'question'")
            qid, question = record.get("id", number), record["question"]
            if not isinstance(qid, (str, int)) or isinstance(qid, bool):
                raise InputError(f"{where}: 'id' must be a string or an integer")
        else:
            qid, question = number, line.strip()
        if qid in seen:
            raise InputError(f"{where}: duplicate id {qid!r}")
        seen.add(qid)
        try:
            check_question(question)
        except QuestionError as exc:
            raise InputError(f"{where}: {exc}") from None
        questions.append((qid, question))
    return questions


def _is_question_record(line: str) -> bool:
    try:
        value = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(value, dict) and "question" in value


def cmd_ask_many(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from ..pipeline import ask

    if args.question is not None:
        raise InputError("give a question or --questions FILE, not both")
    if args.trace_png:
        raise InputError("--trace-png draws one answer; it does not go with --questions")
    questions = read_questions(Path(args.questions))
    options = ask_options_from(args)  # bad settings fail before any model loads
    store = open_store(args)
    out = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout
    failed = 0
    try:
        for qid, question in tqdm(questions, desc="questions", unit="q", file=sys.stderr):
            try:
                record = {"id": qid, "question": question, **ask(store, question, options).json()}
            except (ValueError, RuntimeError) as exc:  # one question's failure (a damaged cache, ...)
                record, failed = {"id": qid, "question": question, "error": str(exc)}, failed + 1
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()
    finally:
        if out is not sys.stdout:
            out.close()
    if failed:
        print(f"pced: {failed} of {len(questions)} questions failed (their lines carry 'error')", file=sys.stderr)
    return 1 if failed else 0
