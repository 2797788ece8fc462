"""``pced chat STORE``: an interactive prompt that keeps the model, retrievers and store loaded.

Each line is a question, answered as ``pced ask`` prints one (tokens coloured by document, cited
sentences, sources). Lines starting with ``/`` change settings for the questions that follow;
their names are ``pced ask``'s options. History is off by default: each question is asked on
its own. With ``/history on`` a question is a follow-up of the previous turn (``follow_up_query``):
retrieval searches with the question and the names the previous answer added, so "Where was she
born?" after "... founded by Mira Quell" reads the document about Mira Quell; the model is asked
the question as typed (docs/daily-use.md, "Follow-up questions", measures the alternatives).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace

from ..errors import DataError, UserError
from ..options import METHODS, RETRIEVERS, AskOptions, check_question
from .common import InputError, add_backend_options, add_decoding_options, add_model_options, add_retrieval_options, \
    ask_options_from, open_store
from .terminal import count, printable, report

HELP = f"""commands (settings hold for the questions that follow):
  /method NAME          {', '.join(METHODS)}
  /top-k N              documents used as experts
  /retriever NAME       {', '.join(RETRIEVERS)}
  /max-new-tokens N     tokens per answer
  /history [on|off]     follow-ups: retrieve with the names the previous answer gave (off by default); alone: show it
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


def echo(text: str) -> None:
    """A line of chat's own that holds what the user typed: shown literally (``terminal.printable``)."""
    print(printable(text, newlines=False))


def apply_command(line: str, options: AskOptions, session: dict) -> AskOptions | None:
    """The options after a /command (printing what changed), or None for /quit. Bad values raise
    ``InputError`` with one line and change nothing; every echo of the line goes through ``echo``
    or ``report``."""
    name, _, value = line[1:].strip().partition(" ")
    value = value.strip()
    try:
        if name in ("quit", "exit", "q"):
            return None
        if name == "help":
            print(HELP)
        elif name == "settings":
            echo(f"method {options.method}, top-k {options.top_k}, retriever {options.retriever}, "
                 f"max-new-tokens {options.sampling.max_new_tokens}, history {'on' if session['history'] else 'off'}")
        elif name == "method":
            options = replace(options, method=value)
        elif name == "top-k":
            options = replace(options, top_k=int(value))
        elif name == "retriever":
            options = replace(options, retriever=value)
        elif name == "max-new-tokens":
            options = replace(options, sampling=replace(options.sampling, max_new_tokens=int(value)))
        elif name == "history" and not value:
            if not session["history"]:
                print("history off: each question is asked on its own (/history on: follow-ups of the previous turn)")
            elif session["turns"]:
                echo(f'history on: the next question follows up on "{session["turns"][-1][0]}"')
            else:
                print("history on: the next question is the first of the conversation")
            return options
        elif name == "history":
            if value not in ("on", "off"):
                raise ValueError(f"/history takes on or off, got {value!r}")
            # on: the turn just asked counts (a person turns history on to follow it up); off: forgotten
            session["history"] = value == "on"
            if value == "off":
                session["turns"] = []
        else:
            raise ValueError(f"unknown command /{name}; /help lists them")
    except ValueError as exc:
        raise InputError(str(exc) if "invalid literal" not in str(exc) else f"/{name} needs a number") from None
    if name not in ("help", "settings"):
        echo(f"ok: /{name} {value}".rstrip())
    return options


# Capitalized words that name nothing: sentence openers, pronouns, articles.
NOT_NAMES = {"a", "an", "the", "he", "she", "it", "they", "we", "you", "i", "his", "her", "its", "their", "this", "that",
             "these", "those", "in", "on", "at", "of", "and", "but", "or", "yes", "no", "based", "according"}


def names_added(question: str, answer: str) -> list[str]:
    """The capitalized words of ``answer`` that ``question`` does not hold, in order, once each: the
    names an answer gave ("Mira Quell" for "Who founded the Zorblax Company?"), which a follow-up
    calls "she" or "it"."""
    asked = {word.lower().removesuffix("'s") for word in re.findall(r"[\w'-]+", question)}
    names: list[str] = []
    for word in re.findall(r"\b[A-Z][\w'-]*", answer):
        bare = word.removesuffix("'s")
        if bare.lower() not in asked and bare.lower() not in NOT_NAMES and bare not in names:
            names.append(bare)
    return names


def follow_up_query(question: str, turns: list[tuple[str, str]]) -> str:
    """What retrieval searches with for a question that follows ``turns``: the question and the
    names the previous answer added. Not the whole turn: its words are the previous question's,
    and retrieval would return the previous answer's document first (measured in
    docs/daily-use.md); an answer without names falls back to the previous question."""
    if not turns:
        return question
    previous, answer = turns[-1]
    names = names_added(previous, answer)
    return f"{question} {' '.join(names) if names else previous}"


def cmd_chat(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..pipeline import ask
    from .render import stream_answer

    options = ask_options_from(args)  # bad settings fail before any model loads
    store = open_store(args)
    console = Console(highlight=False)
    interactive = sys.stdin.isatty()
    session = {"history": False, "turns": []}
    echo(f"pced chat: {store.root}, {count(len(store.documents), 'document')}. /help for commands, /quit to leave.")
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
                report("error", str(exc))
                continue
            if options is None:
                return 0
            continue
        typed = line.strip()
        query = follow_up_query(typed, session["turns"]) if session["history"] else None
        try:
            check_question(typed)
            asked = ask(store, typed, options, query=query)
            answer = stream_answer(asked.generation, asked.candidates, typed, console)
        except (UserError, DataError) as exc:
            report("error", str(exc))
            continue
        except KeyboardInterrupt:
            print("\n(stopped)")
            continue
        session["turns"] = [(typed, answer.text.strip())]  # a follow-up refers to the turn before it

