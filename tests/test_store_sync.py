"""pced store sync SRC DST: a store's current generation copied in the order that keeps a reader of
DST consistent (caches, then the generation folder, then manifest.json), each cache checked, a
damaged SRC refused before DST changes, and DST swept as pced index sweeps."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from pced.cli import main
from pced.documents import Document
from pced.store import DocumentStore, IndexSettings, index_store, remove_documents
from pced.store.sync import sync_store

from helpers.server import CORPUS

DOCUMENTS = [Document(doc_id, text, title) for doc_id, title, text in CORPUS]
NEW = Document("ilden", "Mira Quell moved to Port Ilden in her sixtieth year.", "Port Ilden")


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_llm) -> Path:
    root = tmp_path_factory.mktemp("sync-source") / "store"
    index_store(DOCUMENTS, root, settings(tiny_llm), llm=tiny_llm, progress=False)
    return root


@pytest.fixture()
def src(built, tmp_path) -> Path:
    root = tmp_path / "src"
    shutil.copytree(built, root)
    return root


def settings(tiny_llm) -> IndexSettings:
    return IndexSettings(model=str(tiny_llm.path), storage_dtype="float32")


def tree(root: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``root``: its content hash and inode (a file rewritten in place or replaced shows)."""
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_ino)
            for p in sorted(root.rglob("*")) if p.is_file()}


def cache_path(root: Path, store: DocumentStore, doc_id: str) -> Path:
    digest = store.cache_records[doc_id][0]
    return root / "kv" / "kv" / digest[:2] / f"{digest}.safetensors"


def test_a_copy_serves_what_the_source_holds_and_a_second_sync_copies_nothing(src, tmp_path, capsys):
    dst = tmp_path / "dst"
    assert main(["store", "sync", str(src), str(dst)]) == 0
    line = capsys.readouterr().out.strip()
    assert "now serves generation 1" in line and len(line.splitlines()) == 1
    copy, source = DocumentStore.open(dst), DocumentStore.open(src)
    assert [d.id for d in copy.documents] == [d.id for d in source.documents] and copy.generation == 1
    for doc in source.documents:
        assert cache_path(dst, copy, doc.id).read_bytes() == cache_path(src, source, doc.id).read_bytes()
    assert main(["verify", str(dst)]) == 0
    capsys.readouterr()

    before = tree(dst)
    report = sync_store(src, dst, progress=False)
    assert (report["copied"], report["bytes"], report["published"]) == (0, 0, False) and report["skipped"] > 0
    assert tree(dst) == before


def test_a_damaged_source_cache_is_refused_in_one_line_before_dst_changes(src, tmp_path, tiny_llm, capsys):
    dst = tmp_path / "dst"
    sync_store(src, dst, progress=False)
    store, _ = index_store([NEW], src, settings(tiny_llm), llm=tiny_llm, progress=False)
    damaged = cache_path(src, store, NEW.id)
    data = bytearray(damaged.read_bytes())
    data[-5] ^= 0xFF  # a byte of the tensors: only the checksum can tell
    damaged.write_bytes(bytes(data))
    before = tree(dst)
    assert main(["store", "sync", str(src), str(dst)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(damaged) in err[0] and "checksum" in err[0], err
    assert tree(dst) == before  # no file added, replaced or left behind under a temporary name
    assert DocumentStore.open(dst).generation == 1

    fresh = tmp_path / "fresh"
    assert main(["store", "sync", str(src), str(fresh)]) == 2
    assert not fresh.exists()  # a new DST refused leaves nothing behind


def test_dst_changes_in_order_caches_then_generation_then_manifest_and_opens_whole_at_every_step(
        src, tmp_path, tiny_llm, monkeypatch):
    dst = tmp_path / "dst"
    sync_store(src, dst, progress=False)
    index_store([NEW], src, settings(tiny_llm), llm=tiny_llm, progress=False)
    renames, seen = [], []
    real_replace = os.replace

    def replace(source, target, *args, **kwargs):
        real_replace(source, target, *args, **kwargs)
        target = Path(target)
        if dst in target.parents:
            renames.append(target.relative_to(dst))
            reader = DocumentStore.open(dst)  # a reader of DST right after this step
            for doc in reader.documents:
                assert cache_path(dst, reader, doc.id).is_file(), (target, doc.id)
            seen.append(reader.generation)

    monkeypatch.setattr(os, "replace", replace)
    sync_store(src, dst, progress=False)
    kinds = ["cache" if path.parts[0] == "kv" else "generation" if path.parts[0] == "generations" else str(path)
             for path in renames]
    assert kinds == ["cache"] * kinds.count("cache") + ["generation", "manifest.json"], renames
    assert kinds.count("cache") == 1  # the new document's: the others were there
    assert seen == [1, 1, 2]


def test_dst_keeps_the_generation_it_served_before_and_its_caches_one_sync_longer(src, tmp_path, tiny_llm):
    dst = tmp_path / "dst"
    sync_store(src, dst, progress=False)
    gone = cache_path(dst, DocumentStore.open(dst), "heron")
    remove_documents(src, ["heron"])
    report = sync_store(src, dst, progress=False)
    assert report["generation"] == 2 and report["caches_removed"] == 0
    assert gone.is_file() and sorted(p.name for p in (dst / "generations").iterdir()) == ["1", "2"]
    index_store([NEW], src, settings(tiny_llm), llm=tiny_llm, progress=False)
    report = sync_store(src, dst, progress=False)
    assert (report["generation"], report["generations_swept"], report["caches_removed"]) == (3, 1, 1)
    assert not gone.exists() and sorted(p.name for p in (dst / "generations").iterdir()) == ["2", "3"]


def test_dst_holding_something_else_is_refused(src, tmp_path, tiny_llm, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert main(["store", "sync", str(src), str(other)]) == 2
    assert "is not a pced store" in capsys.readouterr().err and sorted(os.listdir(other)) == ["notes.txt"]
    # a copy of another store whose generation 1 differs: a reader may be using it, so it is never replaced
    elsewhere = tmp_path / "elsewhere"
    index_store([NEW], elsewhere, settings(tiny_llm), llm=tiny_llm, progress=False)
    before = tree(elsewhere)
    assert main(["store", "sync", str(src), str(elsewhere)]) == 2
    assert "copy of another store" in capsys.readouterr().err and tree(elsewhere) == before
