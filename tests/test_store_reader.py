"""Readers of a store being indexed see the old state or the new one, never a refusal."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pced.documents import Document
from pced.store import DocumentStore, IndexSettings, StoreError, index_store

# Four index runs; after each, the writer waits (at most 30 s) until the reader has opened the new
# generation, so that the reader is sure to overlap the runs however the two processes are scheduled.
WRITER = """
import sys, time
from pathlib import Path
from pced.documents import Document
from pced.llm import load_model
from pced.store import IndexSettings, index_store
llm = load_model(sys.argv[2], device="cpu", dtype="float32")
settings = IndexSettings(model=sys.argv[2], storage_dtype="float32")
for run in range(4):
    docs = [Document(f"run{run}-{i}", f"Run {run}, fact {i}: the ferry {i} leaves at dawn.") for i in range(6)]
    docs.append(Document("changing", f"This document changes every run: now run {run}."))
    index_store(docs, sys.argv[1], settings, llm=llm, progress=False)
    deadline = time.monotonic() + 30
    while not (Path(sys.argv[3]) / f"seen-{run + 2}").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
"""


@pytest.mark.slow
def test_readers_opening_a_store_while_it_is_indexed_are_never_refused(tmp_path, tiny_llm, tiny_model_dir):
    root = tmp_path / "store"
    index_store([Document("first", "The first document.")], root,
                IndexSettings(model=str(tiny_model_dir), storage_dtype="float32"), llm=tiny_llm, progress=False)
    marks = tmp_path / "seen"
    marks.mkdir()
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(tiny_model_dir), str(marks)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    opens, refusals, seen = 0, [], set()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        finished = writer.poll() is not None
        try:
            store = DocumentStore.open(root)
            ids = [d.id for d in store.documents]
            for name in ("sparse", "dense"):  # the indexes of the same generation: the same documents
                hits = store.retrieve("ferry dawn changes", name, top_k=len(ids), top_n=len(ids), rerank=False)
                assert {c.document.id for c in hits} <= set(ids)
                assert len(store.retriever(name).doc_ids) == len(ids)
            opens += 1
            seen.add(store.generation)
            (marks / f"seen-{store.generation}").touch()
        except StoreError as exc:
            refusals.append(str(exc))
        if finished:
            break
    assert writer.wait(timeout=60) == 0, writer.stderr.read()
    assert not refusals, refusals[:3]
    assert opens > 5 and len(seen) >= 3, (opens, seen)  # the reader really overlapped the runs
    final = DocumentStore.open(root)
    assert final.generation == 5 and len(final.documents) == 1 + 4 * 6 + 1
    assert len(list((root / "generations").iterdir())) == 2  # older generations swept


def test_a_reader_opening_between_the_index_files_being_written_sees_the_old_state(tmp_path, tiny_llm, monkeypatch):
    """Deterministic: open a reader at the moment documents.jsonl is written, after the retriever
    indexes of the new state exist (before generations, the indexes were already swapped in then)."""
    import pced.store.writer as writer

    settings = IndexSettings(model=str(tiny_llm.path), storage_dtype="float32")
    root = tmp_path / "store"
    index_store([Document("first", "The first document.")], root, settings, llm=tiny_llm, progress=False)
    seen = []
    original = writer.write_documents

    def write_and_read(documents, path, records=None):
        original(documents, path, records)
        store = DocumentStore.open(root)  # a reader arriving now
        seen.append([d.id for d in store.documents])
        seen.append(store.retrieve("document", "dense", top_k=5, top_n=5, rerank=False)[0].document.id)

    monkeypatch.setattr(writer, "write_documents", write_and_read)
    index_store([Document("second", "The second document.")], root, settings, llm=tiny_llm, progress=False)
    assert seen == [["first"], "first"]
    assert [d.id for d in DocumentStore.open(root).documents] == ["first", "second"]
