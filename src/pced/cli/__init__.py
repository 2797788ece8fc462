"""The ``pced`` command line: one module per subcommand, each on the same ``pced.pipeline``.

Imports point one way: this module imports the subcommands, the subcommands import ``common``.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings

from .bench import add_bench_parser
from .chat import add_chat_parser
from .common import InputError, add_plugin_options
from .eval import add_eval_parser
from .offline import force_offline
from .generate import add_generate_parser
from .serve import add_serve_parser
from .store_admin import add_store_parser
from .store import add_ask_parser, add_demo_parser, add_index_parser, add_verify_parser

__all__ = ["InputError", "build_parser", "main"]


THREADS_HELP = "CPU threads for the model (default: see docs/performance.md, \"Threads\")"


def add_global_options(parser: argparse.ArgumentParser, top: bool = False) -> None:
    """Options every command takes, before or after the subcommand (``pced --threads 2 serve`` and
    ``pced serve --threads 2``). Below the top, the default is SUPPRESS, so a subcommand that does
    not see the option keeps what the top level parsed."""
    parser.add_argument("--threads", type=int, default=None if top else argparse.SUPPRESS, help=THREADS_HELP)


def _leaf_parsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield child
                yield from _leaf_parsers(child)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(prog="pced", description="Parallel Context-of-Experts Decoding for RAG")
    parser.add_argument("--version", action="version", version=f"pced {__version__}")
    add_global_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True)

    add_generate_parser(sub)
    add_index_parser(sub)
    add_ask_parser(sub)
    add_chat_parser(sub)
    add_demo_parser(sub)
    add_verify_parser(sub)
    add_store_parser(sub)
    add_serve_parser(sub)
    add_eval_parser(sub)
    add_bench_parser(sub)
    commands = list(_leaf_parsers(parser))
    for command in commands:
        add_global_options(command)
    add_plugin_options(commands)  # last: a plug-in's flags are tried against all of every command's
    return parser


def stop_on_terminate() -> None:
    """SIGTERM (``kill``, ``timeout``, a service manager) stops a command the way Ctrl-C does, so
    that its clean-ups run: an index run stopped while it builds a generation leaves no staging
    folder or temporary file behind (``pced serve``'s uvicorn installs its own handler)."""
    import signal
    import threading

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)


def main(argv: list[str] | None = None) -> int:
    from ..backend import PluginWarning
    from ..errors import DataError, PcedError, UserError

    from .terminal import report
    from .threads import check_threads, configure_threads

    with warnings.catch_warnings(record=True) as caught:  # a plug-in left out: one line, not Python's two
        parser = build_parser()
    for warning in caught:
        if issubclass(warning.category, PluginWarning):
            report("warning", str(warning.message))
        else:
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    args = parser.parse_args(argv)
    force_offline()
    stop_on_terminate()
    try:
        threads = check_threads(args.threads)
        if not getattr(args, "metadata_only", False):  # reading a store's files needs no torch
            configure_threads(threads)
        return args.func(args)
    except (UserError, DataError) as exc:  # bad input, or stored data that is damaged: one line
        report("error", str(exc))
        return 2
    except BrokenPipeError:  # pced store list STORE | head: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes at exit
        return 0
    except PcedError as exc:  # an engine that stopped: its own line, not the user's fault
        report("error", str(exc))
        return 1
    except OSError as exc:  # a read-only store, a full disk, a missing directory
        where = f": {exc.filename}" if exc.filename else ""
        report("error", f"{exc.strerror or exc}{where}")
        return 2
    except KeyboardInterrupt:
        print("pced: interrupted", file=sys.stderr)
        return 130
    except Exception:  # a bug: never reported as the user's fault
        traceback.print_exc(file=sys.stderr)
        print("pced: internal error, please report it with the traceback above", file=sys.stderr)
        return 1
