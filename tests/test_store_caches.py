"""A store's cache files: verify and show open only regular files and report what they checked,
caches no document names are orphans reported apart, and a removed document's cache is never
written again by a reader still answering from the generation that held it."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from pced.cli import main
from pced.decoding.sampling import SamplingConfig
from pced.documents import Candidate, Document
from pced.generator import Generator
from pced.store import DocumentStore, IndexSettings, index_store, remove_documents

DOCS = [Document("zorblax", "The Zorblax Company makes tidal clocks. It was founded by Mira Quell.", "Zorblax"),
        Document("quell", "Mira Quell was born in the town of Oskvale.", "Mira Quell"),
        Document("oskvale", "Oskvale is a fishing town on Lake Tarnow.", "Oskvale")]


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_llm):
    root = tmp_path_factory.mktemp("caches") / "store"
    index_store(DOCS, root, IndexSettings(model=str(tiny_llm.path), storage_dtype="float32"), llm=tiny_llm,
                progress=False)
    return root


@pytest.fixture
def store(built, tmp_path):
    copy = tmp_path / "store"
    shutil.copytree(built, copy)
    return copy


class Hung(BaseException):
    """A command still blocked after the watchdog's minute (on a FIFO's open)."""


@pytest.fixture
def watchdog():
    def fire(signum, frame):
        raise Hung
    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def cache_of(root: Path, doc_id: str) -> Path:
    digest = json.loads(next(line for line in (root / "generations" / "1" / "documents.jsonl").read_text().splitlines()
                             if json.loads(line)["id"] == doc_id))["cache"]
    return root / "kv" / "kv" / digest[:2] / f"{digest}.safetensors"


def flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x40
    path.write_bytes(bytes(raw))


def fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def symlink_out(path: Path) -> None:
    outside = path.parents[4] / "outside.safetensors"  # an intact copy, outside the store
    shutil.copy(path, outside)
    path.unlink()
    path.symlink_to(outside)


DAMAGES = {
    "cut": (lambda path: path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]), "truncated"),
    "flipped": (lambda path: flip(path, path.stat().st_size - 3), "do not match its checksum"),
    "zeroed": (lambda path: path.write_bytes(bytes(path.stat().st_size)), "damaged or not a pced cache"),
    "swapped": (lambda path: shutil.copy(cache_of(path.parents[3], "zorblax"), path),
                "does not hold the document it is named after"),
    "fifo": (fifo, "not a regular file (a FIFO)"),
    "symlink-out-of-the-store": (symlink_out, "not a regular file (a symbolic link)"),
}


@pytest.mark.parametrize("name", DAMAGES)
def test_show_and_verify_check_each_cache_and_never_block_on_a_fifo(store, capsys, watchdog, name):
    damage, expected = DAMAGES[name]
    path = cache_of(store, "quell")
    damage(path)
    assert main(["store", "show", str(store), "quell", "--json"]) == 0
    part = json.loads(capsys.readouterr().out)["parts"][0]
    assert part["cache"] == "damaged" and expected in part["cache_damage"][0], part
    assert main(["store", "show", str(store), "quell"]) == 0
    assert "cache damaged" in capsys.readouterr().out
    assert main(["store", "show", str(store), "zorblax", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parts"][0]["cache"] == "encoded"
    assert main(["verify", str(store)]) == 1
    out = capsys.readouterr()
    assert "1 damaged" in out.out and str(path) in out.err and expected in out.err, out
    outside = path.parents[4] / "outside.safetensors"
    assert main(["verify", str(store), "--remove"]) == 0 and not os.path.lexists(path)
    assert "1 removed" in capsys.readouterr().out
    assert not outside.exists() or outside.stat().st_size > 0  # a link is removed, never what it points to
    assert main(["store", "show", str(store), "quell", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parts"][0]["cache"].startswith("not encoded")


def test_caches_no_document_names_are_orphans_apart_from_the_store_and_verify_remove_deletes_them(store, tiny_llm,
                                                                                                    capsys):
    assert main(["store", "stats", str(store), "--json"]) == 0
    clean = json.loads(capsys.readouterr().out)
    assert main(["verify", str(store)]) == 0
    checked = capsys.readouterr().out
    # what an index run killed before it published leaves: caches of documents no record names
    kv = Generator(tiny_llm, "rag", store / "kv", "float32").caches
    digests = kv.add(["A document of an index run that never finished.", "Another one."], progress=False)
    orphans = [kv.path_for(d) for d in digests]
    assert all(path.is_file() for path in orphans)
    assert main(["store", "stats", str(store), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["bytes"] == clean["bytes"] and stats["caches_encoded"] == clean["caches_encoded"]
    assert stats["orphans"] == {"files": 2, "bytes": sum(p.stat().st_size for p in orphans)}
    assert main(["store", "stats", str(store)]) == 0
    assert "orphans: 2 cache files" in capsys.readouterr().out
    assert main(["verify", str(store)]) == 0
    out = capsys.readouterr().out
    assert out.replace("; 2 orphan cache files (no document names them; --remove deletes them)", "") == checked, out
    assert main(["verify", str(store), "--remove"]) == 0
    assert "2 orphan cache files removed" in capsys.readouterr().out and not any(p.exists() for p in orphans)
    assert main(["store", "stats", str(store), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {**clean, "orphans": {"files": 0, "bytes": 0}}


def test_a_reader_on_the_generation_before_a_removal_never_writes_the_removed_documents_cache(store, tiny_llm):
    reader = DocumentStore.open(store, tiny_llm)
    quell = next(d for d in reader.documents if d.id == "quell")
    path = cache_of(store, "quell")
    sampling = SamplingConfig(max_new_tokens=4)
    before = reader.generator.answer([Candidate(quell, 0.9)], "Where was Mira Quell born?", sampling=sampling)
    remove_documents(store, ["quell"])
    assert not path.exists() and reader.changed()
    # the reader still answers from its generation, which holds the document: its KV is encoded
    # for the answer, never written back into the store that no longer holds it
    after = reader.generator.answer([Candidate(quell, 0.9)], "Where was Mira Quell born?", sampling=sampling)
    assert after.token_ids == before.token_ids
    assert not path.exists()
    assert not list((store / "kv" / "kv").rglob(f"{path.name}*"))
    # a document the current generation still holds is written as before
    zorblax = cache_of(store, "zorblax")
    zorblax.unlink()
    reader.generator.answer([Candidate(DOCS[0], 0.9)], "Who founded Zorblax?", sampling=sampling)
    assert zorblax.is_file()
