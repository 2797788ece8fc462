"""Reading a corpus for ``pced index``: validation with line numbers, and chunking of long documents.

Accepted files: the shapes of ``pced.corpus.formats`` (JSON Lines or one JSON document; pced's
``{"id", "text", "title"?}``, LOFT, HotpotQA, MuSiQue and NQ shapes), chosen by content.
Structural problems (invalid JSON, a missing field, a duplicate id) stop indexing before the
store is touched. Empty documents are skipped with a warning. A document longer than
``max_tokens`` is split at word boundaries into chunks ``id#chunk-1``, ``id#chunk-2``, ... (logged),
so that every expert fits the model's window; the chunks keep the title and name their document
(``Document.source``), which owns them: indexing that id again replaces all of them. Ids ending in
``#chunk-<n>`` are reserved for chunks (refused in a corpus), so a chunk never takes a user's id.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Callable, Iterator

from ..documents import Document
from ..errors import UserError

log = logging.getLogger("pced.corpus")
CHUNK_MARK = "#chunk-"
CHUNK_ID = re.compile(re.escape(CHUNK_MARK) + r"\d+$")


class CorpusError(UserError):
    """A corpus file pced refuses to index (reported as one line)."""


def jsonl_records(path: Path) -> Iterator[tuple[int, str, object]]:
    """(line number, "path:line", parsed JSON) of every non-blank line; a line that is not UTF-8 or
    not JSON is a ``CorpusError`` naming the file and line."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise CorpusError(f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
                                  "save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:  # not JSON, or an integer past Python's digit limit
                raise CorpusError(f"{where}: invalid JSON ({getattr(exc, 'msg', exc)})") from None
            yield number, where, record


def read_corpus(path: str | Path) -> list[Document]:
    """The documents of a corpus file in any shape of ``pced.corpus.formats`` (chosen by content)."""
    from .formats import FormatError, read_documents

    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{path}: no such corpus file")
    documents: list[Document] = []
    seen: dict[str, tuple[str, int]] = {}
    try:
        shape, items = read_documents(path)
        for where, document in items:
            if document is None:
                log.warning("%s: document has empty text; skipped", where)
                continue
            if CHUNK_ID.search(document.id):
                raise CorpusError(f"{where}: id {document.id!r} ends in '{CHUNK_MARK}<n>', which pced reserves for the "
                                  "chunks of long documents; rename it")
            if document.id in seen:
                first, position = seen[document.id]
                if shape.endswith("-questions") and documents[position] == document:
                    continue  # a paragraph that several questions share
                raise CorpusError(f"{where}: duplicate id {document.id!r} (first at {first})")
            seen[document.id] = (where, len(documents))
            documents.append(document)
    except FormatError as exc:
        raise CorpusError(str(exc)) from None
    if not documents:
        raise CorpusError(f"{path}: no documents")
    return documents


def chunk_document(document: Document, count_tokens: Callable[[str], int], max_tokens: int) -> list[Document]:
    """Split a too-long document into consecutive word-boundary chunks of at most max_tokens."""
    if count_tokens(document.render()) <= max_tokens:
        return [document]
    words = document.text.split()
    budget = max(1, max_tokens - count_tokens(document.title) - 2)
    chunks, current = [], []
    for word in words:
        current.append(word)
        if count_tokens(" ".join(current)) > budget:
            if len(current) == 1:  # one giant "word": cut it by characters
                chunks.append(word[: max(1, len(word) * budget // max(1, count_tokens(word)))])
                current = []
            else:
                chunks.append(" ".join(current[:-1]))
                current = [word]
    if current:
        chunks.append(" ".join(current))
    pieces = [Document(f"{document.id}{CHUNK_MARK}{i}", text, document.title, source=document.id)
              for i, text in enumerate(chunks, start=1)]
    log.warning("document %r has %d tokens (> %d): split into %d chunks", document.id,
                count_tokens(document.render()), max_tokens, len(pieces))
    return pieces


def chunk_corpus(documents: list[Document], count_tokens: Callable[[str], int], max_tokens: int) -> tuple[list[Document], list[str]]:
    """All documents within max_tokens; returns the new list and the ids that were chunked."""
    out, chunked = [], []
    for document in documents:
        pieces = chunk_document(document, count_tokens, max_tokens)
        if len(pieces) > 1:
            chunked.append(document.id)
        out.extend(pieces)
    ids = [d.id for d in out]
    if len(set(ids)) != len(ids):  # only through the library: read_corpus refuses reserved ids
        raise CorpusError(f"chunk ids collide with existing ids (ids ending in '{CHUNK_MARK}<n>' are reserved); "
                          "rename those documents")
    return out, chunked
