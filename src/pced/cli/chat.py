"""``pced chat STORE``: an interactive prompt that keeps the model, retrievers and store loaded.

Each line is a question, answered as ``pced ask`` prints one (tokens coloured by document, cited
sentences, sources). Lines starting with ``/`` change settings for the questions that follow;
their names are ``pced ask``'s options. History is off by default: each question is asked on
its own; ``/history on`` prepends the previous turns (so a follow-up question is retrieved and
answered with them), up to the question length limit.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from ..errors import DataError, UserError
from ..options import MAX_QUESTION_CHARS, METHODS, RETRIEVERS, AskOptions, check_question
from .common import InputError, add_backend_options, add_decoding_options, add_model_options, add_retrieval_options, \
    ask_options_from, open_store

HELP = f"""commands (settings hold for the questions that follow):
  /method NAME          {', '.join(METHODS)}
  /top-k N              documents used as experts
  /retriever NAME       {', '.join(RETRIEVERS)}
  /max-new-tokens N     tokens per answer
  /history on|off       prepend the previous turns to each question (off by default)
  /settings             show the current settings
  /help                 this list
  /quit                 leave (also Ctrl-D)"""


def add_chat_parser(sub) -> None:
    p = sub.add_parser("chat", help="ask questions one after another with the model loaded once (/help inside)")
    p.add_argument("store", help="store directory built by pced index")
    add_retrieval_options(p)
    add_model_options(p)
    add_decoding_options(p)
    add_backend_options(p, "chat")
    p.set_defaults(func=cmd_chat)


def apply_command(line: str, options: AskOptions, session: dict) -> AskOptions | None:
    """The options after a /command (printing what changed), or None for /quit. Bad values raise
    ``InputError`` with one line and change nothing."""
    name, _, value = line[1:].strip().partition(" ")
    value = value.strip()
    try:
        if name in ("quit", "exit", "q"):
            return None
        if name == "help":
            print(HELP)
        elif name == "settings":
            print(f"method {options.method}, top-k {options.top_k}, retriever {options.retriever}, "
                  f"max-new-tokens {options.sampling.max_new_tokens}, history {'on' if session['history'] else 'off'}")
        elif name == "method":
            options = replace(options, method=value)
        elif name == "top-k":
            options = replace(options, top_k=int(value))
        elif name == "retriever":
            options = replace(options, retriever=value)
        elif name == "max-new-tokens":
            options = replace(options, sampling=replace(options.sampling, max_new_tokens=int(value)))
        elif name == "history":
            if value not in ("on", "off"):
                raise ValueError("history is on or off")
            session["history"], session["turns"] = value == "on", []
        else:
            raise ValueError(f"unknown command /{name}; /help lists them")
    except ValueError as exc:
        raise InputError(str(exc) if "invalid literal" not in str(exc) else f"/{name} needs a number") from None
    if name not in ("help", "settings"):
        print(f"ok: /{name} {value}".rstrip())
    return options


def with_history(question: str, turns: list[tuple[str, str]]) -> str:
    """The question after the previous turns, dropping the oldest beyond the length limit."""
    for start in range(len(turns) + 1):
        text = "".join(f"Q: {q}\nA: {a}\n" for q, a in turns[start:]) + (f"Q: {question}" if turns[start:] else question)
        if len(text) <= MAX_QUESTION_CHARS:
            return text
    return question


def cmd_chat(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..pipeline import ask
    from .render import stream_answer

    options = ask_options_from(args)  # bad settings fail before any model loads
    store = open_store(args)
    console = Console(highlight=False)
    interactive = sys.stdin.isatty()
    session = {"history": False, "turns": []}
    print(f"pced chat: {store.root}, {len(store.documents)} documents. /help for commands, /quit to leave.")
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return 0
        if not line.strip():
            continue
        if line.startswith("/"):
            try:
                options = apply_command(line, options, session)
            except InputError as exc:
                print(f"pced: error: {exc}", file=sys.stderr)
                continue
            if options is None:
                return 0
            continue
        question = with_history(line.strip(), session["turns"]) if session["history"] else line.strip()
        try:
            check_question(question)
            asked = ask(store, question, options)
            answer = stream_answer(asked.generation, asked.candidates, question, console)
        except (UserError, DataError) as exc:
            print(f"pced: error: {exc}", file=sys.stderr)
            continue
        except KeyboardInterrupt:
            print("\n(stopped)")
            continue
        if session["history"]:
            session["turns"].append((line.strip(), answer.text.strip()))

