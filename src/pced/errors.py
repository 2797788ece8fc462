"""The one error family of pced: every error it means to raise is a ``PcedError`` of one kind.

- ``UserError``: the input is wrong (a setting out of range, a malformed file the user gave, a
  question too long). The CLI prints one line and exits 2; the server answers 4xx.
- ``DataError``: pced's own stored data is damaged or does not match (a truncated cache, a store
  built with another model, an index out of step with its documents). One line naming the file,
  exit 2 on the CLI; a 500 that says so on the server.
- ``EngineDeadError``: a backend's engine died (one of its processes was killed or crashed). This
  process can answer with it no more: exit 1 on the CLI; a 503 on the server, which then stops
  for its supervisor to start a fresh process (``pced.server.lifecycle``).

Anything else is a bug: the CLI says "internal error, please report" with the traceback, the
server answers 500 and logs the traceback. Front ends catch these classes by name, never
``ValueError``. ``UserError`` is a ``ValueError`` and ``DataError`` a ``RuntimeError`` so that
callers written against the built-in kinds keep working.
"""

from __future__ import annotations


class PcedError(Exception):
    """Base of every error pced raises on purpose; ``code`` is the machine-readable reason."""

    code = "pced_error"


class UserError(PcedError, ValueError):
    """Bad input: a setting, a file or a request that pced refuses (exit 2, HTTP 4xx)."""

    code = "invalid_value"


class DataError(PcedError, RuntimeError):
    """Stored data that is damaged or does not match what reads it (exit 2, HTTP 500)."""

    code = "damaged_data"


class EngineDeadError(PcedError, RuntimeError):
    """A backend's engine died; only a fresh process has it again (exit 1, HTTP 503, then the server stops)."""

    code = "engine_dead"
