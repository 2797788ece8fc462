"""pced store list / show / remove / stats / verify on a tiny-model store."""

import json

import pytest

from pced.cli import main
from pced.documents import Document
from pced.retrieval.base import load_doc_ids
from pced.store import DocumentStore, IndexSettings, StoreError, index_store, remove_documents
from pced.store.inventory import Inventory

LONG = " ".join(f"word{i}" for i in range(300))
CORPUS = [
    Document("zorblax", "The Zorblax Company makes tidal clocks. It was founded by Mira Quell.", "Zorblax"),
    Document("quell", "Mira Quell was born in the town of Oskvale.", "Mira Quell"),
    Document("oskvale", "Oskvale is a fishing town on Lake Tarnow.", "Oskvale"),
    Document("long", LONG, "Long"),
]


@pytest.fixture()
def store(tmp_path, tiny_llm):
    settings = IndexSettings(model=str(tiny_llm.path), storage_dtype="float32", max_doc_tokens=128)
    store, _ = index_store(CORPUS, tmp_path / "store", settings, llm=tiny_llm, progress=False)
    return store


def cache_files(root):
    return sorted(p.name for p in (root / "kv" / "kv").rglob("*.safetensors"))


def test_list_groups_chunks_under_their_document(store, capsys):
    assert main(["store", "list", str(store.root), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in rows] == ["zorblax", "quell", "oskvale", "long"]
    long = rows[-1]
    assert long["chunks"] == len([d for d in store.documents if d.id.startswith("long#")]) >= 3
    files = {p.name: p.stat().st_size for p in (store.root / "kv" / "kv").rglob("*.safetensors")}
    assert sum(r["cache_bytes"] for r in rows) == sum(files.values())
    builder = store.generator.builder
    assert rows[0]["tokens"] == len(builder.context_ids([CORPUS[0].render()]))
    assert all(r["encoded"] == r["chunks"] for r in rows)
    assert main(["store", "list", str(store.root)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:4] == ["id", "chunks", "tokens", "cache"] and table[1].startswith("zorblax")


def test_show_prints_text_chunks_and_cache_state(store, capsys):
    assert main(["store", "show", str(store.root), "long", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["text"] == LONG and info["chunks"] == len(info["parts"]) >= 3
    assert all(p["cache"] == "encoded" and p["cache_bytes"] > 0 for p in info["parts"])
    (store.root / info["parts"][0]["cache_files"][0]).unlink()
    assert main(["store", "show", str(store.root), "long#chunk-1"]) == 0
    out = capsys.readouterr().out
    assert "not encoded" in out and "[long#chunk-1]" in out
    assert main(["store", "show", str(store.root), "nope"]) == 2
    assert "no document 'nope'" in capsys.readouterr().err


def test_stats_bytes_by_part_add_up(store, capsys):
    assert main(["store", "stats", str(store.root), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["documents"] == 4 and stats["stored_chunks"] == len(store.documents)
    b = stats["bytes"]
    assert b["caches"] > b["text"] > 0 and b["retrieval"] > 0 and b["total"] == b["text"] + b["retrieval"] + b["caches"]
    assert "kv_budget" not in stats
    manifest = json.loads((store.root / "manifest.json").read_text())
    manifest["kv_budget_gb"] = 0.5
    (store.root / "kv" / "budget.json").write_text(json.dumps({"hits": 3, "misses": 2, "evictions": 1}))
    inventory = Inventory(store.root, manifest, store.documents, store.generator.builder)
    assert inventory.stats()["kv_budget"] == {"budget_gb": 0.5, "hits": 3, "misses": 2, "evictions": 1}


def test_remove_drops_document_chunks_caches_and_index_entries(store, tmp_path, tiny_llm, capsys):
    reader = DocumentStore.open(store.root, tiny_llm)
    before = reader.retrieve("word7 word8", "hybrid", top_k=3, top_n=10)
    long_caches = {Inventory.open(store).cache(d).digest + ".safetensors" for d in store.documents if d.id.startswith("long")}
    with pytest.raises(StoreError, match="no document 'missing'"):
        remove_documents(store.root, ["long", "missing"], llm=tiny_llm)
    assert len(DocumentStore.open(store.root).documents) == len(store.documents)  # nothing changed
    _, report = remove_documents(store.root, ["long", "quell"], llm=tiny_llm)
    after = DocumentStore.open(store.root, tiny_llm)
    assert [d.id for d in after.documents] == ["zorblax", "oskvale"]
    for name in ("sparse", "dense"):
        assert load_doc_ids(after.state / "retrievers" / name) == ["zorblax", "oskvale"]
    assert not long_caches & set(cache_files(store.root)) and len(cache_files(store.root)) == 2
    assert report["kv_orphans_removed"] == len(long_caches) + 1
    assert "long" not in json.loads((store.root / "manifest.json").read_text())["chunked"]
    # the same retrieval as a store built without them
    fresh, _ = index_store([CORPUS[0], CORPUS[2]], tmp_path / "fresh", after.settings, llm=tiny_llm, progress=False)
    for question in ("Where is Oskvale?", "Who founded Zorblax?"):
        got, want = after.retrieve(question, top_k=2, top_n=2), fresh.retrieve(question, top_k=2, top_n=2)
        assert [c.doc_id for c in got] == [c.doc_id for c in want]
        assert [c.relevance for c in got] == pytest.approx([c.relevance for c in want], abs=1e-6)
    # a reader opened before keeps answering from what it loaded
    assert [c.doc_id for c in reader.retrieve("word7 word8", "hybrid", top_k=3, top_n=10)] == [c.doc_id for c in before]
    assert main(["store", "remove", str(store.root), "oskvale"]) == 0
    assert "removed 1 document (1 stored id)" in capsys.readouterr().out
    assert [d.id for d in DocumentStore.open(store.root).documents] == ["zorblax"]
    assert main(["store", "remove", str(store.root), "zorblax"]) == 2  # never an empty store
    assert "leave the store empty" in capsys.readouterr().err


def test_store_verify_is_pced_verify(store, capsys):
    assert main(["store", "verify", str(store.root)]) == 0
    short = capsys.readouterr().out
    assert main(["verify", str(store.root)]) == 0
    assert capsys.readouterr().out == short and "0 damaged" in short


@pytest.mark.slow
def test_a_closed_pipe_ends_the_listing_quietly(store):
    import subprocess
    import sys

    # the reader goes away before pced writes (pced list STORE | head -0): no error, exit 0
    child = subprocess.Popen([sys.executable, "-m", "pced.cli", "store", "list", str(store.root)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()
    assert child.wait(timeout=300) == 0
    assert b"error" not in child.stderr.read()
