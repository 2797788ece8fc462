"""A store's documents.jsonl: one record a line, written by the index path and read one way by
every command (``read_documents``).

A record is ``{"id", "title", "text", "source"?, "cache"?, "tokens"?}``: ``source`` names the
document a chunk was split from, ``cache`` the content hash that names the document's cache files
(64 hex digits, so a cache path never leaves the store) and ``tokens`` how many tokens they hold.
Reading checks every field's type, each line's UTF-8 and that no id comes twice, so a damaged
file is one line naming it and the line, never a value shown or written back in another shape."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..documents import Document
from ..fs import NotRegularFile, atomic_write_lines, open_regular
from .layout import DOCUMENTS, LEGACY_CHUNK, StoreError, legacy_chunked, state_dir
from .manifest import described, rebuild_advice

DIGEST = re.compile(r"[0-9a-f]{64}")  # sha256 of a document's context text


def write_documents(documents: list[Document], path: Path, caches: dict[str, tuple[str, int]] | None = None) -> None:
    """documents.jsonl; ``caches`` (id -> (content hash, tokens)) records what names each document's
    cache files and how many tokens they hold, so that the store's metadata commands read them
    without a tokenizer."""
    caches = caches or {}

    def record(d: Document) -> dict:
        cache = {"cache": caches[d.id][0], "tokens": caches[d.id][1]} if d.id in caches else {}
        return {"id": d.id, "title": d.title, "text": d.text, **({"source": d.source} if d.source else {}), **cache}

    atomic_write_lines(path, (json.dumps(record(d), ensure_ascii=False) + "\n" for d in documents))


class _Damaged(ValueError):
    """What is wrong with one line (its number and the file are added where it is caught)."""


def _string(record: dict, key: str, required: bool = True, empty: bool = True) -> str:
    if key not in record or (record[key] is None and not required):
        if required:
            raise _Damaged(f"missing field '{key}'")
        return ""
    value = record[key]
    if not isinstance(value, str) or (not empty and not value):
        raise _Damaged(f"field '{key}' must be a {'' if empty else 'non-empty '}string, got {described(value)}")
    return value


def _record(record: object, chunked: set[str]) -> tuple[Document, tuple[str, int] | None]:
    """The document of one parsed line and its cache record, or a ``_Damaged`` saying why not."""
    if not isinstance(record, dict):
        raise _Damaged("not a JSON object")
    doc_id = _string(record, "id", empty=False)
    text, title = _string(record, "text"), _string(record, "title", required=False)
    if "source" in record:
        source = _string(record, "source")
    else:  # a chunk written before chunks recorded their source ("id#3")
        legacy = LEGACY_CHUNK.match(doc_id)
        source = legacy.group(1) if legacy and legacy.group(1) in chunked else ""
    cache = None
    if "cache" in record:
        digest, tokens = record["cache"], record.get("tokens")
        if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
            raise _Damaged(f"field 'cache' must be a sha256 hex digest, got {described(digest)}")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise _Damaged(f"field 'tokens' must be a whole number, got {described(tokens)}")
        cache = (digest, tokens)
    return Document(doc_id, text, title, source), cache


def read_documents(root: Path, manifest: dict, caches: dict | None = None) -> list[Document]:
    """The documents of the generation ``manifest`` names (checked: ``manifest.read_manifest``);
    ``caches``, when given, is filled with the recorded (content hash, tokens) of each document that
    has them. A missing file, or anything but whole, well-typed records with distinct ids, is a
    ``StoreError`` naming the file and the line."""
    path = state_dir(root, manifest) / DOCUMENTS
    chunked = set(legacy_chunked(manifest))
    advice = f"the store's document list is damaged; {rebuild_advice(root)}"
    documents: list[Document] = []
    first: dict[str, int] = {}
    try:
        handle = open_regular(path)
    except NotRegularFile as exc:
        raise StoreError(f"{path}: {exc.strerror}; {advice}") from None
    except FileNotFoundError:
        raise StoreError(f"{path}: missing; {advice}") from None
    with handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise StoreError(f"{path}:{number}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
                                 f"{advice}") from None
            if not line.strip():
                continue
            try:
                try:
                    parsed = json.loads(line)
                except ValueError as exc:
                    raise _Damaged(f"not a whole document record ({getattr(exc, 'msg', exc)}): the file is cut "
                                   "short or was edited") from None
                document, cache = _record(parsed, chunked)
            except _Damaged as exc:
                raise StoreError(f"{path}:{number}: {exc}; {advice}") from None
            if document.id in first:
                raise StoreError(f"{path}:{number}: id {document.id!r} again (first on line {first[document.id]}); "
                                 f"{advice}")
            first[document.id] = number
            documents.append(document)
            if caches is not None and cache is not None:
                caches[document.id] = cache
    if not documents:
        raise StoreError(f"{path}: holds no document records; {advice}")
    return documents
