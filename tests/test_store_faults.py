"""What a user's own data and a stopped run must never cost: a document whose id looks like a
chunk's survives its neighbour's removal byte for byte, a chunk is never removed alone, a cut-short
documents file is one line naming file and line, a malformed HotpotQA file is refused before any
store is built, and a large index run names every phase and leaves nothing behind when stopped."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.cli import write_jsonl
from pced.cli import main
from pced.documents import Document
from pced.fs import TEMP_PREFIX
from pced.store import DocumentStore, IndexSettings, index_store

LONG = " ".join(f"The report's finding number {i} concerns the harbour of Oskvale." for i in range(12))


def one_line_error(capsys, code: int, expected: str) -> str:
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "pced: error:" in line]
    assert code == 2 and len(errors) == 1 and expected in errors[0] and "Traceback" not in err, err
    return errors[0]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def store(tmp_path, tiny_llm):
    documents = [Document("report", LONG, "Report"), Document("report#1", "A note of the user's own, not a chunk.", "Note"),
                 Document("other", "Mira Quell was born in Oskvale.", "Quell")]
    root = tmp_path / "store"
    index_store(documents, root, IndexSettings(model=str(tiny_llm.path), storage_dtype="float32", max_doc_tokens=48),
                llm=tiny_llm, progress=False)
    return root


def records(root: Path) -> dict[str, str]:
    """Each stored id's line of documents.jsonl, as written."""
    text = (DocumentStore.open(root).state / "documents.jsonl").read_text(encoding="utf-8")
    return {json.loads(line)["id"]: line for line in text.splitlines() if line.strip()}


def test_removing_a_chunked_document_leaves_a_document_named_like_its_chunk_byte_identical(store, capsys):
    before = records(store)
    chunks = [i for i in before if i.startswith("report#chunk-")]
    assert len(chunks) >= 2 and "report#1" in before
    assert main(["store", "list", str(store), "--json"]) == 0
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)}
    assert (rows["report"]["chunks"], rows["report#1"]["chunks"]) == (len(chunks), 1)  # not counted as a chunk
    assert main(["store", "show", str(store), "report", "--json"]) == 0
    assert [p["id"] for p in json.loads(capsys.readouterr().out)["parts"]] == chunks
    assert main(["store", "show", str(store), "report#1", "--json"]) == 0
    note = json.loads(capsys.readouterr().out)["parts"][0]
    note_cache = store / note["cache_files"][0]
    cache_before = digest(note_cache)

    assert main(["store", "remove", str(store), "report"]) == 0
    after = records(store)
    assert after["report#1"] == before["report#1"] and digest(note_cache) == cache_before  # byte for byte
    assert set(after) == {"report#1", "other"}
    found = DocumentStore.open(store).retrieve("A note of the user's own", top_k=1, top_n=2)
    assert found[0].document.id == "report#1"


def test_removing_one_chunk_is_refused_naming_its_document(store, capsys):
    before = records(store)
    one_line_error(capsys, main(["store", "remove", str(store), "report#chunk-2"]),
                   "'report#chunk-2' is a chunk of document 'report'; a document is removed with all its chunks")
    assert records(store) == before


def test_a_cut_short_documents_file_is_one_line_naming_the_file_and_line(store, capsys):
    documents = DocumentStore.open(store).state / "documents.jsonl"
    lines = documents.read_text(encoding="utf-8").splitlines(keepends=True)
    documents.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2], encoding="utf-8")
    for command in (["store", "list", str(store)], ["verify", str(store)], ["ask", str(store), "Who?"]):
        one_line_error(capsys, main(command), f"{documents}:{len(lines)}: not a whole document record")


@pytest.mark.parametrize("field, value, message", [
    ("question", 42, "field 'question' must be a non-empty string, got 42"),
    ("answer", None, "field 'answer' must be a string, got null"),
    ("context", "Oskvale is a town.", "field 'context' must be a list"),
])
def test_eval_refuses_a_malformed_hotpotqa_file_before_building_a_store(tmp_path, tiny_model_dir, capsys, field, value,
                                                                         message):
    good = {"_id": "q0", "question": "Where was Mira Quell born?", "answer": "Oskvale", "type": "bridge",
            "supporting_facts": [["Quell", 0]], "context": [["Quell", ["Mira Quell was born in Oskvale."]]]}
    data = tmp_path / "data" / "hotpotqa"
    data.mkdir(parents=True)
    (data / "hotpotqa_train_100.json").write_text(json.dumps([good, {**good, "_id": "q1", field: value}]))
    code = main(["eval", "--dataset", "hotpotqa", "--data-dir", str(data.parent), "--model", str(tiny_model_dir),
                 "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"), "--no-progress"])
    line = one_line_error(capsys, code, message)
    assert "question 1" in line and not (tmp_path / "work").exists()


@pytest.mark.slow
def test_a_large_index_names_every_phase_and_a_stopped_run_leaves_no_temporary_folder(tmp_path, tiny_model_dir):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"id": f"d{i}", "text": f"Passage {i} tells of harbour {i % 97}, "
                                                      f"bell {i % 13} and the town of Oskvale in year {1800 + i}."}
                                                     for i in range(1200)])
    store = tmp_path / "store"
    args = [sys.executable, "-m", "pced.cli", "index", str(corpus), "--out", str(store), "--model", str(tiny_model_dir),
            "--lazy-kv"]
    process = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in iter(process.stderr.readline, ""):  # tqdm's carriage returns end lines too
        seen.append(line)
        if "retrieval indexes: embedding documents" in line:
            time.sleep(1)
            process.send_signal(signal.SIGTERM)  # mid-phase: its generation folder is being built
            break
    rest = process.communicate(timeout=300)[1]
    assert process.returncode == 130 and "pced: interrupted" in rest, rest[-2000:]
    text = "".join(seen)
    for phase in ("counting document tokens", "retrieval indexes: BM25 over 1200 documents",
                  "retrieval indexes: embedding documents"):
        assert phase in text, text[-2000:]
    assert not [p for p in store.rglob(f"{TEMP_PREFIX}*")], "a stopped run left a temporary file or folder"
    assert not (store / "manifest.json").exists()  # nothing was published
    done = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(DocumentStore.open(store).documents) == 1200 and not [p for p in store.rglob(f"{TEMP_PREFIX}*")]
