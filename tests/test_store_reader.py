"""Readers of a store being indexed see the old state or the new one, never a refusal."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pced.documents import Document
from pced.store import DocumentStore, IndexSettings, StoreError, index_store

WRITER = """
import sys
from pced.documents import Document
from pced.llm import load_model
from pced.store import IndexSettings, index_store
llm = load_model(sys.argv[2], device="cpu", dtype="float32")
settings = IndexSettings(model=sys.argv[2], storage_dtype="float32")
for run in range(4):
    docs = [Document(f"run{run}-{i}", f"Run {run}, fact {i}: the ferry {i} leaves at dawn.") for i in range(6)]
    docs.append(Document("changing", f"This document changes every run: now run {run}."))
    index_store(docs, sys.argv[1], settings, llm=llm, progress=False)
"""


@pytest.mark.slow
def test_readers_opening_a_store_while_it_is_indexed_are_never_refused(tmp_path, tiny_llm, tiny_model_dir):
    root = tmp_path / "store"
    index_store([Document("first", "The first document.")], root,
                IndexSettings(model=str(tiny_model_dir), storage_dtype="float32"), llm=tiny_llm, progress=False)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(tiny_model_dir)],
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
