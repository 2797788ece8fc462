"""Damaged store files: every command reads the manifest and documents.jsonl through one checked
path, so each damage is one line naming the file (and line), the same from every command, and the
advice in that line repairs the store when followed. Wrong-typed records never become data."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from helpers.cli import write_jsonl
from pced.cli import main
from pced.documents import Document
from pced.store import DocumentStore, IndexSettings, index_store

DOCS = [Document("zorblax", "The Zorblax Company makes tidal clocks. It was founded by Mira Quell.", "Zorblax"),
        Document("quell", "Mira Quell was born in the town of Oskvale.", "Mira Quell"),
        Document("oskvale", "Oskvale is a fishing town on Lake Tarnow.", "Oskvale")]


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_llm):
    base = tmp_path_factory.mktemp("damage")
    index_store(DOCS, base / "store", IndexSettings(model=str(tiny_llm.path), storage_dtype="float32"), llm=tiny_llm,
                progress=False)
    corpus = write_jsonl(base / "corpus.jsonl", [{"id": d.id, "title": d.title, "text": d.text} for d in DOCS])
    return base / "store", corpus


@pytest.fixture
def store(built, tmp_path):
    copy = tmp_path / "store"
    shutil.copytree(built[0], copy)
    return copy


def error_line(capsys, code: int) -> str:
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "pced: error:" in line]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err and "internal error" not in err, err
    return errors[0]


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def follow(line: str, corpus: Path, model: Path) -> int:
    """Run the command the error line advises (``... : pced index CORPUS --out STORE ...``) on the corpus,
    with the model options the store was built with."""
    advice = re.search(r"pced (index CORPUS --out \S+(?: --rebuild)?)", line)
    assert advice, line
    argv = [str(corpus) if word == "CORPUS" else word for word in shlex.split(advice.group(1))]
    return main([*argv, "--model", str(model), "--storage-dtype", "float32"])


def repaired(capsys, root: Path) -> None:
    assert main(["verify", str(root)]) == 0
    assert main(["store", "list", str(root), "--json"]) == 0
    out = capsys.readouterr().out
    assert [r["id"] for r in json.loads(out.splitlines()[-1])] == [d.id for d in DOCS]


def with_manifest(change):
    def damage(root: Path) -> Path:
        path = root / "manifest.json"
        path.write_bytes(change(path.read_bytes()))
        return path
    return damage


def manifest_field(key, value):
    return with_manifest(lambda raw: json.dumps({**json.loads(raw), key: value}).encode())


MANIFESTS = {
    "cut": (with_manifest(lambda raw: raw[: len(raw) // 2]), "not readable JSON"),
    "empty": (with_manifest(lambda raw: b""), "not readable JSON"),
    "array": (with_manifest(lambda raw: b"[]"), "expected a JSON object, found list"),
    "settings-null": (manifest_field("settings", None), "no 'settings' object"),
    "huge-generation": (manifest_field("generation", 10**30), "'generation' must be a whole number"),
    "infinite-generation": (with_manifest(lambda raw: raw.replace(b'"generation": 1', b'"generation": 1e400')),
                            "'generation' must be a whole number"),
    "path-generation": (manifest_field("generation", "../../outside"), "'generation' must be a whole number"),
    "not-utf8": (with_manifest(lambda raw: raw.replace(b'"rag"', b'"r\xffg"')), "not UTF-8"),
}


@pytest.mark.parametrize("name", MANIFESTS)
def test_index_on_a_damaged_manifest_is_one_line_naming_it_and_its_advice_repairs_the_store(built, store, tiny_model_dir,
                                                                                             capsys, name):
    damage, expected = MANIFESTS[name]
    path = damage(store)
    before = tree(store)
    lines = [error_line(capsys, main(command)) for command in (
        ["index", str(built[1]), "--out", str(store), "--model", str(tiny_model_dir), "--storage-dtype", "float32"],
        ["verify", str(store)], ["store", "list", str(store)], ["store", "remove", str(store), "quell"])]
    assert f"{path}: " in lines[0] and expected in lines[0], lines[0]
    assert lines[1:] == [lines[0]] * 3  # one reader of the manifest for every command
    assert tree(store) == before  # refused before anything was written
    assert follow(lines[0], built[1], tiny_model_dir) == 0
    repaired(capsys, store)


def documents_of(root: Path) -> Path:
    return root / "generations" / "1" / "documents.jsonl"


def with_records(change):
    def damage(root: Path) -> Path:
        path = documents_of(root)
        path.write_bytes(change(path.read_bytes().splitlines(keepends=True)))
        return path
    return damage


def record_field(line: int, key, value):
    def change(lines):
        record = json.loads(lines[line - 1])
        record[key] = value
        lines[line - 1] = (json.dumps(record) + "\n").encode()
        return b"".join(lines)
    return with_records(change)


DOCUMENTS = {
    "not-utf8": (with_records(lambda lines: b"".join(lines[:1] + [lines[1].replace(b"Oskvale", b"Osk\xffvale")] + lines[2:])),
                 ":2: not UTF-8"),
    "empty": (with_records(lambda lines: b""), ": holds no document records"),
    "duplicated-line": (with_records(lambda lines: b"".join(lines + lines[:1])), ":4: id 'zorblax' again (first on line 1)"),
    "not-an-object": (with_records(lambda lines: b"".join(lines[:2] + [b"[1, 2]\n"])), ":3: not a JSON object"),
    "text-object": (record_field(2, "text", {"body": "Mira"}), ":2: field 'text' must be a string, got an object"),
    "title-list": (record_field(1, "title", ["Zorblax"]), ":1: field 'title' must be a string, got an array"),
    "id-number": (record_field(3, "id", 42), ":3: field 'id' must be a non-empty string, got 42"),
    "cache-absolute-path": (record_field(2, "cache", "/etc/passwd"), ":2: field 'cache' must be a sha256 hex digest"),
    "cache-relative-path": (record_field(2, "cache", "../../../../outside"), ":2: field 'cache' must be a sha256 hex digest"),
    "tokens-text": (record_field(1, "tokens", "many"), ":1: field 'tokens' must be a whole number"),
}


@pytest.mark.parametrize("name", DOCUMENTS)
def test_a_damaged_documents_file_is_one_line_naming_file_and_line_and_its_advice_repairs_the_store(
        built, store, tiny_model_dir, capsys, name):
    damage, expected = DOCUMENTS[name]
    path = damage(store)
    before = tree(store)
    lines = [error_line(capsys, main(command)) for command in (
        ["index", str(built[1]), "--out", str(store), "--model", str(tiny_model_dir), "--storage-dtype", "float32"],
        ["verify", str(store)], ["store", "list", str(store)], ["store", "show", str(store), "quell"],
        ["store", "stats", str(store)], ["store", "remove", str(store), "oskvale"])]
    assert f"{path}{expected}" in lines[0], lines[0]
    assert "interrupted" not in lines[0]
    assert lines[1:] == [lines[0]] * 5  # one reader of documents.jsonl for every command
    assert tree(store) == before  # never published again by remove, never overwritten by index
    assert follow(lines[0], built[1], tiny_model_dir) == 0
    repaired(capsys, store)


def test_an_index_that_does_not_list_the_documents_is_named_and_re_indexing_repairs_it(built, store, tiny_model_dir,
                                                                                        capsys):
    ids = store / "generations" / "1" / "retrievers" / "dense" / "doc_ids.json"
    ids.write_text(json.dumps(["zorblax", "quell"]))
    line = error_line(capsys, main(["verify", str(store)]))
    assert str(ids.parent) in line and "interrupted" not in line and "pced index CORPUS" in line, line
    assert follow(line, built[1], tiny_model_dir) == 0
    repaired(capsys, store)
    assert DocumentStore.open(store).retrieve("Where is Oskvale?", "dense", top_k=3, top_n=3)
