"""The kinds of value a dataset record's fields may hold, and the one check every reader runs.

Each reader declares its records as kinds (``STRING``, ``list_of(STRING)``, ``record({...})``) and
passes every record through :func:`check` before it builds anything from it. A value of the wrong
kind (answers that are null, an id that is a number, a list where text belongs) would otherwise be
turned into text by ``str()`` and scored as gold ("None"), split into characters, or fail as a
traceback deep in a run; here it is one line naming the file, the line or record and the field,
with what was expected and what was found.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Sequence

from pced.evaluation.records import DatasetError

__all__ = [
    "BOOLEAN", "INTEGER", "NAME", "NUMBER", "OBJECT", "STRING", "STRINGS", "TEXT",
    "Kind", "check", "check_each", "list_of", "one_of", "pair", "record", "table_of",
]

_MISSING = object()
Mismatch = tuple[str, str, Any]  # (field path, what was expected, what was found)


class Kind:
    """A kind of JSON value; ``expected`` says it in words for the error line."""

    def __init__(self, expected: str, accepts: Callable[[Any], bool] = lambda _: True):
        self.expected = expected
        self._accepts = accepts

    def mismatch(self, value: Any, path: str) -> Mismatch | None:
        """The innermost part of ``value`` (at ``path``) that is not of this kind, else None."""
        return None if self._accepts(value) else (path, self.expected, value)


def _not_bool(test: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: test(v) and not isinstance(v, bool)  # JSON true is no number


STRING = Kind("a string", lambda v: isinstance(v, str))
TEXT = Kind("a non-empty string", lambda v: isinstance(v, str) and bool(v.strip()))
NAME = TEXT  # ids: an empty one would name nothing, or collide
INTEGER = Kind("an integer", _not_bool(lambda v: isinstance(v, int)))
NUMBER = Kind("a number", _not_bool(lambda v: isinstance(v, (int, float))))
BOOLEAN = Kind("true or false", lambda v: isinstance(v, bool))
OBJECT = Kind("an object", lambda v: isinstance(v, dict))


def _at(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


class _List(Kind):
    def __init__(self, item: Kind, expected: str, min_len: int):
        super().__init__(expected)
        self.item, self.min_len = item, min_len

    def mismatch(self, value: Any, path: str) -> Mismatch | None:
        if not isinstance(value, list) or len(value) < self.min_len:
            return path, self.expected, value
        for i, item in enumerate(value):
            found = self.item.mismatch(item, _at(path, i))
            if found:
                return found
        return None


class _Pair(Kind):
    def __init__(self, items: Sequence[Kind], expected: str, required: int):
        super().__init__(expected)
        self.items, self.required = tuple(items), required

    def mismatch(self, value: Any, path: str) -> Mismatch | None:
        if not isinstance(value, list) or not self.required <= len(value) <= len(self.items):
            return path, self.expected, value
        for i, (item, kind) in enumerate(zip(value, self.items)):
            found = kind.mismatch(item, _at(path, i))
            if found:
                return found
        return None


class _Record(Kind):
    def __init__(self, fields: Mapping[str, Kind], optional: Mapping[str, Kind], expected: str):
        super().__init__(expected)
        self.fields, self.optional = dict(fields), dict(optional)

    def mismatch(self, value: Any, path: str) -> Mismatch | None:
        if not isinstance(value, dict):
            return path, self.expected, value
        for name, kind in self.fields.items():
            found = kind.mismatch(value[name], _at(path, name)) if name in value else \
                (_at(path, name), kind.expected, _MISSING)
            if found:
                return found
        for name, kind in self.optional.items():
            if value.get(name) is not None:  # absent and null both mean "not given"
                found = kind.mismatch(value[name], _at(path, name))
                if found:
                    return found
        return None


class _Table(Kind):
    def __init__(self, item: Kind, expected: str):
        super().__init__(expected)
        self.item = item

    def mismatch(self, value: Any, path: str) -> Mismatch | None:
        if not isinstance(value, dict):
            return path, self.expected, value
        for key, item in value.items():
            found = self.item.mismatch(item, _at(path, key))
            if found:
                return found
        return None


class _OneOf(Kind):
    def __init__(self, kinds: Sequence[Kind], expected: str):
        super().__init__(expected)
        self.kinds = tuple(kinds)

    def mismatch(self, value: Any, path: str) -> Mismatch | None:
        if any(kind.mismatch(value, path) is None for kind in self.kinds):
            return None
        return path, self.expected, value


def list_of(item: Kind, expected: str | None = None, *, min_len: int = 0) -> Kind:
    """A JSON array of ``item`` values (at least ``min_len`` of them)."""
    words = expected or f"a {'non-empty ' if min_len else ''}list of {item.expected.split(' ', 1)[1]}s"
    return _List(item, words, min_len)


def pair(items: Sequence[Kind], expected: str, *, required: int | None = None) -> Kind:
    """A short JSON array whose positions hold the given kinds (the last ones optional when
    ``required`` is less than their number), such as ``[title, [sentence, ...]]``."""
    return _Pair(items, expected, len(items) if required is None else required)


def record(fields: Mapping[str, Kind], optional: Mapping[str, Kind] | None = None,
           expected: str = "an object") -> Kind:
    """A JSON object with ``fields`` (required) and ``optional`` ones (absent or null); other
    fields are left alone, since the readers do not read them."""
    return _Record(fields, optional or {}, expected)


def table_of(item: Kind, expected: str) -> Kind:
    """A JSON object whose every value is an ``item``, such as ``{title: [sentence, ...]}``."""
    return _Table(item, expected)


def one_of(*kinds: Kind, expected: str) -> Kind:
    return _OneOf(kinds, expected)


STRINGS = list_of(STRING)


def _shown(value: Any, limit: int = 60) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check(where: str, value: Any, kind: Kind, *, noun: str = "field") -> Any:
    """``value`` itself when it is of ``kind``; else a one-line ``DatasetError``:
    ``{where}: field 'paragraphs[3].title' must be a string, got 5``. ``where`` names the file and
    the line or record; ``noun`` what a path names (a file's ``field``, a function's ``setting``)."""
    found = kind.mismatch(value, "")
    if found is None:
        return value
    path, expected, got = found
    if not path:
        raise DatasetError(f"{where}: expected {expected}, got {_shown(got)}")
    if got is _MISSING:
        raise DatasetError(f"{where}: {noun} {path!r} is missing (expected {expected})")
    raise DatasetError(f"{where}: {noun} {path!r} must be {expected}, got {_shown(got)}")


def check_each(where: str, value: Any, item: Kind, *, expected: str, label: str) -> list:
    """A JSON array whose items are records of their own, each named ``{where}: {label} {index}``
    (``question 3``) rather than by a path into the whole file."""
    check(where, value, Kind(expected, lambda v: isinstance(v, list)))
    return [check(f"{where}: {label} {i}", entry, item) for i, entry in enumerate(value)]
