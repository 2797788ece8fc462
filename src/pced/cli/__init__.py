"""The ``pced`` command line: one module per subcommand, each on the same ``pced.pipeline``.

Imports point one way: this module imports the subcommands, the subcommands import ``common``.
"""

from __future__ import annotations

import argparse
import sys
import traceback

from .bench import add_bench_parser
from .common import InputError
from .eval import add_eval_parser
from .generate import add_generate_parser
from .serve import add_serve_parser
from .store import add_ask_parser, add_demo_parser, add_index_parser, add_verify_parser

__all__ = ["InputError", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(prog="pced", description="Parallel Context-of-Experts Decoding for RAG")
    parser.add_argument("--version", action="version", version=f"pced {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    add_generate_parser(sub)
    add_index_parser(sub)
    add_ask_parser(sub)
    add_demo_parser(sub)
    add_verify_parser(sub)
    add_serve_parser(sub)
    add_eval_parser(sub)
    add_bench_parser(sub)
    for command in sub.choices.values():
        command.add_argument("--threads", type=int, default=None,
                             help="CPU threads for the model (default: see README \"Threads\")")
    return parser


def main(argv: list[str] | None = None) -> int:
    from ..errors import DataError, PcedError, UserError

    from .terminal import printable
    from .threads import configure_threads

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        configure_threads(args.threads)
        return args.func(args)
    except (UserError, DataError) as exc:  # bad input, or stored data that is damaged: one line
        print(f"pced: error: {printable(str(exc), newlines=False)}", file=sys.stderr)
        return 2
    except PcedError as exc:  # an engine that stopped: its own line, not the user's fault
        print(f"pced: error: {printable(str(exc), newlines=False)}", file=sys.stderr)
        return 1
    except OSError as exc:  # a read-only store, a full disk, a missing directory
        where = f": {exc.filename}" if exc.filename else ""
        print(f"pced: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pced: interrupted", file=sys.stderr)
        return 130
    except Exception:  # a bug: never reported as the user's fault
        traceback.print_exc(file=sys.stderr)
        print("pced: internal error, please report it with the traceback above", file=sys.stderr)
        return 1
