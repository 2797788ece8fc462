"""pced index / ask end to end, bad corpora, incremental adds, interruption and refusals."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pced.corpus.reader import read_corpus
from pced.decoding.sampling import SamplingConfig
from pced.documents import Document
from pced.store import DocumentStore, IndexSettings, StoreError, index_store

from helpers.cli import run_pced as pced
from helpers.cli import write_jsonl

CORPUS = [
    {"id": "zorblax", "title": "Zorblax", "text": "The Zorblax Company makes tidal clocks. It was founded by Mira Quell."},
    {"id": "quell", "title": "Mira Quell", "text": "Mira Quell was born in the town of Oskvale."},
    {"id": "oskvale", "title": "Oskvale", "text": "Oskvale is a fishing town on Lake Tarnow."},
    {"id": "heron", "title": "Grey heron", "text": "The grey heron is the national bird of Elumia."},
    {"pid": "loft-1", "title_text": "Vantor", "passage_text": "Vantor is the capital of Elumia."},
]


def kv_files(store: Path):
    return sorted((store / "kv" / "kv").rglob("*.safetensors"))


@pytest.mark.slow
def test_index_then_ask_json_end_to_end(tmp_path, tiny_model_dir):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", CORPUS)
    store = tmp_path / "store"
    result = pced("index", str(corpus), "--out", str(store), "--model", str(tiny_model_dir), "--storage-dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert "5 documents" in result.stdout
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["documents"] == 5 and manifest["model"]["fingerprint"]
    assert set(manifest["retrievers"]) == {"sparse", "dense"}
    png = tmp_path / "trace.png"
    result = pced("ask", str(store), "Where was the founder of Zorblax born?", "--json", "--top-k", "3",
                  "--max-new-tokens", "6", "--model", str(tiny_model_dir), "--trace-png", str(png))
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"answer", "method", "experts", "trace", "beta", "timings"} <= set(out)
    assert out["method"] == "pced" and len(out["experts"]) == 3 and len(out["beta"]) == 3
    ids = {d["id"] if "id" in d else d["pid"] for d in CORPUS}
    for expert in out["experts"]:
        assert expert["doc_id"] in ids
        assert 0.0 < expert["relevance"] < 1.0
        assert {"retrieval", "r_ret"} <= set(expert["scores"])
    relevances = [e["relevance"] for e in out["experts"]]
    assert relevances == sorted(relevances, reverse=True)
    assert all(t["doc_id"] in ids or t["doc_id"] is None for t in out["trace"])
    assert set(out["timings"]) >= {"retrieval_s", "cache_load_s", "ttft_s", "total_s"}
    assert png.stat().st_size > 1000
    for method in ("all", "single"):
        result = pced("ask", str(store), "Where was the founder born?", "--json", "--method", method, "--top-k", "2",
                      "--max-new-tokens", "4", "--model", str(tiny_model_dir))
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout.strip().splitlines()[-1])["method"] == method


@pytest.mark.slow
@pytest.mark.parametrize(
    "lines,message",
    [
        ([CORPUS[0], CORPUS[0]], "duplicate id 'zorblax'"),
        ([CORPUS[0], "{oops"], "invalid JSON"),
        ([{"name": "x", "body": "no id"}], "fits no corpus shape"),
        ([{"id": "e", "text": "   "}], "no documents"),
    ],
)
def test_bad_corpus_is_refused_before_anything_is_written(tmp_path, lines, message):
    corpus = write_jsonl(tmp_path / "bad.jsonl", lines)
    result = pced("index", str(corpus), "--out", str(tmp_path / "store"))
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("pced: error:")]
    assert len(errors) == 1 and message in errors[0]
    assert not (tmp_path / "store").exists()


def test_empty_documents_are_skipped_with_a_warning(tmp_path, caplog):
    corpus = write_jsonl(tmp_path / "c.jsonl", [CORPUS[0], {"id": "blank", "text": ""}])
    assert [d.id for d in read_corpus(corpus)] == ["zorblax"]
    assert "empty text" in caplog.text


def test_long_documents_are_chunked_and_logged(tmp_path, tiny_llm, caplog):
    long_text = " ".join(f"word{i}" for i in range(400))
    corpus = [Document("long", long_text, "Long"), Document("short", "Short text.")]
    store, report = index_store(corpus, tmp_path / "s", IndexSettings(model=str(tiny_llm.path), max_doc_tokens=128), llm=tiny_llm, progress=False)
    assert report["chunked"] == ["long"]
    chunk_ids = [d.id for d in store.documents if d.id.startswith("long#")]
    assert len(chunk_ids) >= 3
    builder = store.generator.builder
    assert all(len(builder.context_ids([d.render()])) <= 128 for d in store.documents)
    assert " ".join(d.text for d in store.documents if d.id.startswith("long#")) == long_text
    assert "split into" in caplog.text


def test_incremental_add_encodes_only_new_documents(tmp_path, tiny_llm):
    settings = IndexSettings(model=str(tiny_llm.path), storage_dtype="float32")
    docs = [Document(d.get("id", "x"), d.get("text", "x"), d.get("title", "")) for d in CORPUS[:4]]
    store, report = index_store(docs[:2], tmp_path / "s", settings, llm=tiny_llm, progress=False)
    assert report["kv_encoded"] == 2
    dense_before = store.retriever("dense").embeddings[:2].copy()
    store, report = index_store(docs, tmp_path / "s", settings, llm=tiny_llm, progress=False)
    assert (report["added"], report["updated"], report["kv_encoded"]) == (2, 0, 2)
    assert [d.id for d in store.documents] == [d.id for d in docs]
    assert (store.retriever("dense").embeddings[:2] == dense_before).all()
    fresh = store.retriever("dense").encode([docs[3].render()])
    assert abs(store.retriever("dense").embeddings[3] - fresh[0]).max() < 1e-5
    assert len(kv_files(tmp_path / "s")) == 4
    changed = [Document("quell", "Mira Quell was born in Brask.", "Mira Quell")]
    store, report = index_store(changed, tmp_path / "s", settings, llm=tiny_llm, progress=False)
    assert (report["added"], report["updated"]) == (0, 1)
    assert store.documents[1].text == "Mira Quell was born in Brask."
    assert store.retrieve("Where was Mira Quell born?", "sparse", top_k=1)[0].document.id == "quell"


def test_lazy_kv_store_encodes_a_document_the_first_time_it_is_retrieved(tmp_path, tiny_llm):
    settings = IndexSettings(model=str(tiny_llm.path), storage_dtype="float32")
    docs = [Document(d.get("id", "x"), d.get("text", "x"), d.get("title", "")) for d in CORPUS[:4]]
    store, report = index_store(docs, tmp_path / "s", settings, llm=tiny_llm, progress=False, encode_kv=False)
    assert report["kv_encoded"] == 0 and kv_files(tmp_path / "s") == []
    found = store.retrieve("Where was Mira Quell born?", "sparse", top_k=1)
    assert found[0].document.id == "quell"
    lazy = store.generator.answer(found, "Where was Mira Quell born?", sampling=SamplingConfig(max_new_tokens=4))
    assert len(kv_files(tmp_path / "s")) == 1  # only the retrieved document
    eager, _ = index_store(docs, tmp_path / "e", settings, llm=tiny_llm, progress=False)
    again = eager.generator.answer(found, "Where was Mira Quell born?", sampling=SamplingConfig(max_new_tokens=4))
    assert lazy.token_ids == again.token_ids


def test_demo_question_path_runs_on_a_store(tmp_path, tiny_llm):
    # pced demo asks through the one pipeline with its own options
    from pced.cli.store import DEMO_OPTIONS
    from pced.pipeline import ask

    settings = IndexSettings(model=str(tiny_llm.path), storage_dtype="float32")
    docs = [Document(d.get("id", "x"), d.get("text", "x"), d.get("title", "")) for d in CORPUS[:4]]
    store, _ = index_store(docs, tmp_path / "s", settings, llm=tiny_llm, progress=False)
    asked = ask(store, "Where was Mira Quell born?", DEMO_OPTIONS)
    generation, candidates = asked.generation, asked.candidates
    assert len(candidates) == 4 and generation.answer().token_ids
    assert generation.rule_config.gamma == 2.5  # the tiny store's model is a plain llama: the paper's gamma


@pytest.mark.slow
def test_store_refuses_another_model_or_embedder(tmp_path, tiny_llm, embedded_llm):
    docs = [Document("a", "Alpha text."), Document("b", "Beta text.")]
    index_store(docs, tmp_path / "s", IndexSettings(model=str(tiny_llm.path)), llm=tiny_llm, progress=False)
    with pytest.raises(StoreError, match="built with model"):
        DocumentStore.open(tmp_path / "s", embedded_llm)
    with pytest.raises(StoreError, match="was built with"):
        index_store(docs, tmp_path / "s", IndexSettings(model=str(tiny_llm.path), dense_model="/elsewhere"), llm=tiny_llm, progress=False)
    with pytest.raises(StoreError, match="not a pced store"):
        DocumentStore.open(tmp_path)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="not a pced store"):
        index_store(docs, tmp_path / "other", IndexSettings(model=str(tiny_llm.path)), llm=tiny_llm, progress=False)


@pytest.mark.slow
def test_killed_index_run_completes_on_rerun(tmp_path, tiny_model_dir):
    records = [{"id": f"d{i}", "text": f"Document {i} says that item {i} is kept in room {i * 7 % 13}. " * 8} for i in range(60)]
    corpus = write_jsonl(tmp_path / "corpus.jsonl", records)
    store = tmp_path / "store"
    args = [sys.executable, "-m", "pced.cli", "index", str(corpus), "--out", str(store), "--model", str(tiny_model_dir)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and len(kv_files(store) if (store / "kv" / "kv").exists() else []) < 8:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = len(kv_files(store))
    assert 8 <= partial < 60, partial
    assert not (store / "manifest.json").exists()
    with pytest.raises(StoreError):
        DocumentStore.open(store)
    result = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    files = kv_files(store)
    assert len(files) == 60 and not list(store.rglob(".tmp-*"))
    opened = DocumentStore.open(store)
    assert [d.id for d in opened.documents] == [r["id"] for r in records]
    assert "encoded" in result.stdout and f"{60 - partial} KV caches encoded" in result.stdout
