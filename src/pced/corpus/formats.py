"""Which corpus shape a file holds, chosen by its content (not its name), and its documents.

Containers: JSON Lines (one JSON value a line), or one JSON document (an array of records, a
single record, or HotpotQA's ``{title: [sentences]}`` object); ``.gz`` files are read through gzip.
A file whose text parses as one JSON document is a document; otherwise it is read as JSON Lines,
and a bad line is reported with its number.

Record shapes (the first record picks the shape; every record must then fit it, except that the
three one-passage shapes, pced, loft and title-text, may be mixed):
- ``pced``: ``{"id", "text", "title"?}``
- ``loft``: LOFT's ``{"pid", "passage_text", "title_text"?}``
- ``title-text``: ``{"title", "text"}`` without an id (MuSiQue's corpus file): id = ``content_doc_id``
- ``hotpotqa-questions``: HotpotQA rows ``{"context": [[title, [sentences]]], ...}``: every paragraph,
  id = title (unique in HotpotQA's corpus)
- ``musique-questions``: MuSiQue rows ``{"paragraphs": [{"title", "paragraph_text"}], ...}``
- ``nq-questions``: lost-in-the-middle's NQ rows ``{"ctxs": [{"title", "text"}], ...}``
and the object shape ``hotpotqa-corpus``: ``{title: [sentences]}`` (HotpotQA's corpus file).
Question files yield every paragraph once (a paragraph shared by questions comes once; the same
id with another text is an error). The ids match ``pced eval``'s for the same datasets.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path
from typing import Callable, Iterator

from ..documents import Document

RECORD_SHAPES = {
    "pced": '{"id", "text", "title"?}',
    "loft": 'LOFT {"pid", "passage_text", "title_text"?}',
    "title-text": '{"title", "text"} (MuSiQue corpus)',
    "hotpotqa-questions": 'HotpotQA {"context": [[title, [sentences]]]}',
    "musique-questions": 'MuSiQue {"paragraphs": [{"title", "paragraph_text"}]}',
    "nq-questions": 'NQ {"ctxs": [{"title", "text"}]}',
}
FLAT_SHAPES = ("pced", "loft", "title-text")  # one passage a record: they may be mixed in a file
OBJECT_SHAPES = {"hotpotqa-corpus": "HotpotQA corpus {title: [sentences]}"}
EXPECTED = "; ".join([*RECORD_SHAPES.values(), *OBJECT_SHAPES.values()])


class FormatError(ValueError):
    """A corpus file whose container or shape pced cannot read (one line)."""


def content_doc_id(title: str, text: str) -> str:
    """A stable id for a passage whose title is not unique: title plus a short content hash."""
    digest = hashlib.sha1(f"{title}\n{text}".encode()).hexdigest()[:8]
    return f"{title}#{digest}"


def _text_of(path: Path) -> str:
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise FormatError(f"{path}: damaged gzip file ({exc})") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise FormatError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); save the file as UTF-8") from None


def _lines(path: Path, text: str) -> Iterator[tuple[str, object]]:
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{number}", json.loads(line)
        except json.JSONDecodeError as exc:
            raise FormatError(f"{path}:{number}: invalid JSON ({exc.msg}); expected JSON Lines (one record a line) "
                              "or one JSON document") from None


def records(path: str | Path) -> tuple[str, Iterator[tuple[str, object]]]:
    """(container, iterator of (where, value)): container is "json" or "jsonl"; a top-level object
    that is not a record comes as one value with where = "PATH"."""
    path = Path(path)
    text = _text_of(path)
    stripped = text.lstrip()
    if stripped[:1] in "[{":
        try:
            document = json.loads(text)
        except json.JSONDecodeError as exc:
            if stripped[:1] == "[":  # an array over several lines: its own position, not "line 1"
                raise FormatError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON ({exc.msg})") from None
        else:
            if isinstance(document, list):
                return "json", ((f"{path}[{i}]", value) for i, value in enumerate(document))
            return "json", iter([(str(path), document)])
    return "jsonl", _lines(path, text)


def _check(value: object, kind: type, where: str, what: str):
    if not isinstance(value, kind):
        raise FormatError(f"{where}: {what} must be a {'string' if kind is str else kind.__name__}")
    return value


def _pced(record: dict, where: str) -> Iterator[Document | None]:
    yield _document(record["id"], record["text"], record.get("title", ""), where)


def _loft(record: dict, where: str) -> Iterator[Document | None]:
    yield _document(record["pid"], record["passage_text"], record.get("title_text", ""), where)


def _title_text(record: dict, where: str) -> Iterator[Document | None]:
    title, text = _check(record["title"], str, where, "'title'"), _check(record["text"], str, where, "'text'")
    yield _document(content_doc_id(title, text), text, title, where)


def _hotpotqa(record: dict, where: str) -> Iterator[Document | None]:
    for i, pair in enumerate(_check(record["context"], list, where, "'context'")):
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str) and isinstance(pair[1], list)):
            raise FormatError(f"{where}: context[{i}] must be [title, [sentences]]")
        yield _document(pair[0], "".join(_sentences(pair[1], where)).strip(), pair[0], where)


def _musique(record: dict, where: str) -> Iterator[Document | None]:
    for i, p in enumerate(_check(record["paragraphs"], list, where, "'paragraphs'")):
        if not (isinstance(p, dict) and isinstance(p.get("title"), str) and isinstance(p.get("paragraph_text"), str)):
            raise FormatError(f"{where}: paragraphs[{i}] needs string 'title' and 'paragraph_text'")
        yield _document(content_doc_id(p["title"], p["paragraph_text"]), p["paragraph_text"], p["title"], where)


def _nq(record: dict, where: str) -> Iterator[Document | None]:
    for i, c in enumerate(_check(record["ctxs"], list, where, "'ctxs'")):
        if not (isinstance(c, dict) and isinstance(c.get("title"), str) and isinstance(c.get("text"), str)):
            raise FormatError(f"{where}: ctxs[{i}] needs string 'title' and 'text'")
        yield _document(content_doc_id(c["title"], c["text"]), c["text"], c["title"], where)


# shape name -> (does a record have it, its documents); tried in this order
READERS: dict[str, tuple[Callable[[dict], bool], Callable[[dict, str], Iterator[Document | None]]]] = {
    "loft": (lambda r: "pid" in r and "passage_text" in r, _loft),
    "pced": (lambda r: "id" in r and "text" in r, _pced),
    "hotpotqa-questions": (lambda r: "context" in r and isinstance(r["context"], list), _hotpotqa),
    "musique-questions": (lambda r: "paragraphs" in r and isinstance(r["paragraphs"], list), _musique),
    "nq-questions": (lambda r: "ctxs" in r and isinstance(r["ctxs"], list), _nq),
    "title-text": (lambda r: "title" in r and "text" in r, _title_text),
}


def _sentences(value: list, where: str) -> list[str]:
    if not all(isinstance(s, str) for s in value):
        raise FormatError(f"{where}: sentences must be strings")
    return value


def _document(doc_id: object, text: object, title: object, where: str) -> Document | None:
    """A document, or None for an empty text (the caller warns); one-line errors for wrong types."""
    if not isinstance(doc_id, (str, int)) or isinstance(doc_id, bool) or str(doc_id).strip() == "":
        raise FormatError(f"{where}: 'id' must be a non-empty string")
    if not isinstance(text, str) or not isinstance(title or "", str):
        raise FormatError(f"{where}: 'text' and 'title' must be strings")
    if not text.strip():
        return None
    return Document(id=str(doc_id), text=text.strip(), title=(title or "").strip())


def shape_of(value: object) -> str | None:
    """The record shape of one JSON value, or None."""
    if not isinstance(value, dict):
        return None
    return next((name for name, (fits, _) in READERS.items() if fits(value)), None)


def _keys(value: object) -> str:
    if isinstance(value, dict):
        return "keys " + ", ".join(sorted(map(str, value))[:8]) if value else "an empty object"
    return f"a JSON {type(value).__name__.replace('dict', 'object').replace('list', 'array').replace('str', 'string')}"


def _hotpotqa_corpus(value: object) -> bool:
    return isinstance(value, dict) and bool(value) and all(
        isinstance(v, list) and all(isinstance(s, str) for s in v) for v in value.values())


def read_documents(path: str | Path) -> tuple[str, Iterator[tuple[str, Document | None]]]:
    """(shape name, iterator of (where, Document or None for an empty text)) of a corpus file;
    a ``FormatError`` when the file fits no shape, naming the shape it expected."""
    path = Path(path)
    container, values = records(path)
    first = next(values, None)
    if first is None:
        raise FormatError(f"{path}: no records")
    where, value = first
    if container == "json" and where == str(path) and shape_of(value) is None:
        if _hotpotqa_corpus(value):
            return "hotpotqa-corpus", ((f"{path}[{t!r}]", _document(t, "".join(s).strip(), t, str(path)))
                                       for t, s in value.items())
        raise FormatError(f"{path}: a JSON object with {_keys(value)} fits no corpus shape; expected one of: {EXPECTED}")
    shape = shape_of(value)
    if shape is None:
        raise FormatError(f"{where}: {_keys(value)} fits no corpus shape; expected one of: {EXPECTED}")

    def documents() -> Iterator[tuple[str, Document | None]]:
        for where_, value_ in _chain((where, value), values):
            own = shape_of(value_)
            if own != shape and not (own in FLAT_SHAPES and shape in FLAT_SHAPES):
                expected = " or ".join(RECORD_SHAPES[s] for s in (FLAT_SHAPES if shape in FLAT_SHAPES else (shape,)))
                raise FormatError(f"{where_}: {_keys(value_)}; expected {expected} (the first record's shape)")
            for document in READERS[own][1](value_, where_):
                yield where_, document

    return shape, documents()


def _chain(first, rest):
    yield first
    yield from rest
