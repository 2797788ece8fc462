"""The write path: documents own their chunks, reserved chunk ids, cache estimates."""

import pytest

from pced.corpus.reader import CorpusError, read_corpus
from pced.documents import Document
from pced.store import IndexSettings, StoreError, index_store

from helpers.cli import write_jsonl

LONG = " ".join(f"word{i}" for i in range(400))


def settings(tiny_llm, **kw):
    return IndexSettings(model=str(tiny_llm.path), storage_dtype="float32", **kw)


def retrievable_ids(store, query: str) -> set[str]:
    found = set()
    for name in ("sparse", "dense"):
        found |= {c.document.id for c in store.retrieve(query, name, top_k=64, top_n=64, rerank=False)}
    return found


def test_reindexing_a_chunked_id_replaces_all_its_chunks(tmp_path, tiny_llm):
    root = tmp_path / "s"
    store, report = index_store([Document("long", LONG, "Long"), Document("short", "Short text.")], root,
                                settings(tiny_llm, max_doc_tokens=128), llm=tiny_llm, progress=False)
    old_chunks = {d.id for d in store.documents if d.source == "long"}
    assert len(old_chunks) >= 3 and all(i.startswith("long#chunk-") for i in old_chunks)
    store, report = index_store([Document("long", "Now a short text about zebras.", "Long")], root,
                                settings(tiny_llm, max_doc_tokens=128), llm=tiny_llm, progress=False)
    assert (report["added"], report["updated"], report["chunks_replaced"]) == (0, 1, len(old_chunks))
    assert [d.id for d in store.documents] == ["long", "short"]
    assert retrievable_ids(store, "word5 word77 word301 zebras") == {"long", "short"}
    assert store.manifest["chunked"] == []


def test_another_chunk_size_resplits_instead_of_storing_the_text_twice(tmp_path, tiny_llm):
    root = tmp_path / "s"
    store, _ = index_store([Document("long", LONG)], root, settings(tiny_llm, max_doc_tokens=128), llm=tiny_llm,
                           progress=False)
    small = len(store.documents)
    store, _ = index_store([Document("long", LONG)], root, settings(tiny_llm, max_doc_tokens=256), llm=tiny_llm,
                           progress=False)
    assert 1 < len(store.documents) < small
    assert " ".join(d.text for d in store.documents) == LONG  # each word once: the old split is gone


def test_a_user_id_never_collides_with_a_chunk(tmp_path, tiny_llm):
    root = tmp_path / "s"
    store, _ = index_store([Document("report#1", "The user's own first report."), Document("report", LONG)], root,
                           settings(tiny_llm, max_doc_tokens=128), llm=tiny_llm, progress=False)
    by_id = {d.id: d for d in store.documents}
    assert by_id["report#1"].text == "The user's own first report." and by_id["report#1"].source == ""
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": "report#chunk-2", "text": "x"}])
    with pytest.raises(CorpusError, match="reserves for the chunks"):
        read_corpus(corpus)
    with pytest.raises(StoreError, match="reserves for chunks"):
        index_store([Document("a#chunk-1", "x")], root, settings(tiny_llm), llm=tiny_llm, progress=False)


def as_written_before_generations(root):
    """Turn a store into the layout older pced wrote: state at the top level, chunks "id#3" without a
    source, no generation in the manifest (the model's record is kept: its identity is tested elsewhere)."""
    import json
    import shutil

    manifest = json.loads((root / "manifest.json").read_text())
    state = root / "generations" / str(manifest.pop("generation"))
    rows = [json.loads(line) for line in (state / "documents.jsonl").read_text().splitlines()]
    for row in rows:
        row["id"] = row["id"].replace("#chunk-", "#")
        row.pop("source", None)
    (root / "documents.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    shutil.move(state / "retrievers", root / "retrievers")
    for ids in (root / "retrievers").glob("*/doc_ids.json"):
        ids.write_text(json.dumps([r["id"] for r in rows]))
    shutil.rmtree(root / "generations")
    (root / "manifest.json").write_text(json.dumps(manifest))
    return rows


def test_a_store_written_before_generations_opens_and_its_old_chunks_are_replaced(tmp_path, tiny_llm):
    from pced.store import DocumentStore

    root = tmp_path / "s"
    index_store([Document("long", LONG), Document("long#1x", "A user's id that only looks like a chunk.")], root,
                settings(tiny_llm, max_doc_tokens=128), llm=tiny_llm, progress=False)
    rows = as_written_before_generations(root)
    old = DocumentStore.open(root, tiny_llm)
    assert old.generation == 0 and [d.id for d in old.documents] == [r["id"] for r in rows]
    assert {d.source for d in old.documents} == {"long", ""}
    store, report = index_store([Document("long", "short now")], root, settings(tiny_llm, max_doc_tokens=128),
                                llm=tiny_llm, progress=False)
    assert [d.id for d in store.documents] == ["long", "long#1x"] and report["chunks_replaced"] == len(rows) - 1
    assert retrievable_ids(store, "word5 word77 word301 short") == {"long", "long#1x"}
    index_store([Document("other", "Another one.")], root, settings(tiny_llm), llm=tiny_llm, progress=False)
    assert not (root / "documents.jsonl").exists()  # the old top-level state is swept once no reader can need it


def test_a_run_that_extends_a_store_builds_it_as_it_was_built(tmp_path, tiny_model_dir):
    """``pced index MORE --out STORE`` with no settings given takes the store's own (its model, template,
    storage dtype, retrievers, reranker), not the defaults: it extends the store instead of refusing it."""
    import json

    from pced.cli import main
    from pced.store import DocumentStore

    first = write_jsonl(tmp_path / "a.jsonl", [{"id": "a", "text": "Mira Quell founded Zorblax."}])
    more = write_jsonl(tmp_path / "b.jsonl", [{"id": "b", "text": "Mira Quell moved to Port Ilden."}])
    root = tmp_path / "store"
    assert main(["index", str(first), "--out", str(root), "--model", str(tiny_model_dir), "--storage-dtype", "float32",
                 "--template", "icl", "--reranker", str(tmp_path / "reranker")]) == 0
    built = json.loads((root / "manifest.json").read_text())["settings"]
    assert main(["index", str(more), "--out", str(root)]) == 0
    store = DocumentStore.open(root)
    assert [d.id for d in store.documents] == ["a", "b"] and store.manifest["settings"] == built
    assert main(["index", str(more), "--out", str(root), "--storage-dtype", "int8"]) == 2  # one given differs: refused
