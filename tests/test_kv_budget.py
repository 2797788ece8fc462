"""One LRU byte budget for on-demand caches: a budgeted store answers exactly as an unbounded one."""

import errno
import json
import os
from pathlib import Path

import pytest

from pced.documents import Document
from pced.kv.budget import GB
from pced.options import AskOptions
from pced.pipeline import ask
from pced.decoding.sampling import SamplingConfig
from pced.store import DocumentStore, IndexSettings, index_store

FACTS = [Document(f"d{i}", f"Fact {i}: the {c} lantern of Vey{i} is kept in tower {i * 7}.", f"Vey{i}")
         for i, c in enumerate(["red", "blue", "green", "amber", "violet", "silver", "copper", "white"])]
QUESTIONS = ["Where is the red lantern kept?", "Which tower keeps the amber lantern?", "What colour is Vey5's lantern?",
             "Where is the red lantern kept?", "Tell me about the copper lantern.", "Which lantern is in tower 14?"]
OPTIONS = AskOptions(top_k=2, top_n=8, rerank=False, sampling=SamplingConfig(max_new_tokens=8))


def answers(store):
    out = []
    for question in QUESTIONS:
        asked = ask(store, question, OPTIONS)
        answer = asked.answer()
        out.append((answer.text, answer.token_ids, [s.doc_id for s in answer.trace],
                    [c.document.id for c in asked.candidates]))
        stats = store.generator.caches.stats()
        if stats["budget_bytes"] is not None:
            # the question in flight may hold its own documents past the budget; never more
            assert stats["bytes"] <= max(stats["budget_bytes"], 2 * per_document_bytes(store))
    return out


def per_document_bytes(store) -> int:
    return max(p.stat().st_size for p in (store.root / "kv" / "kv").glob("*/*.safetensors"))


def test_eviction_under_a_budget_keeps_answers_identical_to_an_unbounded_store(tmp_path, tiny_llm):
    base = dict(model=str(tiny_llm.path), storage_dtype="float32")
    full, _ = index_store(FACTS, tmp_path / "full", IndexSettings(**base), llm=tiny_llm, progress=False)
    expected = answers(full)
    assert full.generator.caches.stats()["misses"] == 0  # a fully encoded store never encodes at ask time

    size = per_document_bytes(full)
    budget_gb = 3 * size / GB  # three documents' caches: questions needing others evict
    bounded, report = index_store(FACTS, tmp_path / "bounded", IndexSettings(**base, kv_budget_gb=budget_gb),
                                  llm=tiny_llm, progress=False)
    assert report["kv_encoded"] == 0 and report["on_demand"]
    assert bounded.manifest["settings"]["kv_budget_gb"] == budget_gb
    assert answers(bounded) == expected
    stats = bounded.generator.caches.stats()
    assert stats["evictions"] > 0 and stats["misses"] > 3 and stats["hits"] > 0
    assert stats["bytes"] <= stats["budget_bytes"]
    # the counters are on disk: another process (a fresh open) sees the same
    reopened = DocumentStore.open(tmp_path / "bounded", tiny_llm)
    assert {k: reopened.generator.caches.stats()[k] for k in ("hits", "misses", "evictions")} == \
        {k: stats[k] for k in ("hits", "misses", "evictions")}
    assert DocumentStore.open(tmp_path / "bounded").cache_stats() == stats  # without a model
    # a later run without --kv-budget-gb keeps the budget
    store, _ = index_store([Document("new", "A new fact.")], tmp_path / "bounded", IndexSettings(**base), llm=tiny_llm,
                           progress=False)
    assert json.loads((tmp_path / "bounded" / "manifest.json").read_text())["settings"]["kv_budget_gb"] == budget_gb


def test_a_cache_evicted_between_retrieval_and_loading_is_encoded_again(tmp_path, tiny_llm):
    base = dict(model=str(tiny_llm.path), storage_dtype="float32")
    store, _ = index_store(FACTS, tmp_path / "s", IndexSettings(**base, lazy_kv=True), llm=tiny_llm, progress=False)
    caches = store.generator.caches
    digests = caches.add([FACTS[0].render()], progress=False)
    reference = caches.load(digests[0]).keys.clone()
    caches.path_for(digests[0]).unlink()  # another process evicted it meanwhile
    assert (caches.load(digests[0]).keys == reference).all()
    assert caches.path_for(digests[0]).is_file()


@pytest.mark.parametrize("error", [errno.ENOENT, errno.ESTALE], ids=["removed here", "removed by another NFS client"])
def test_a_cache_removed_while_it_is_opened_is_encoded_again(tmp_path, tiny_llm, monkeypatch, error):
    """The file is there when the reader looks and gone when it reads: removed by another process
    between the two (ENOENT), or by another host while this one had it open on NFS (ESTALE)."""
    import pced.kv.format

    base = dict(model=str(tiny_llm.path), storage_dtype="float32")
    store, _ = index_store(FACTS, tmp_path / "s", IndexSettings(**base), llm=tiny_llm, progress=False)
    caches = store.generator.caches
    digests = caches.add([FACTS[0].render()], progress=False)
    reference = caches.load(digests[0]).keys.clone()
    path = caches.path_for(digests[0])
    real_open, removed = pced.kv.format.open_regular, []

    def open_regular(opened):
        if Path(opened) == path and not removed:
            removed.append(opened)
            path.unlink()  # the other side removes it now
            if error == errno.ESTALE:
                raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), str(opened))
        return real_open(opened)

    monkeypatch.setattr(pced.kv.format, "open_regular", open_regular)
    assert (caches.load(digests[0]).keys == reference).all()
    assert removed and path.is_file()  # written again: the current generation holds the document


def test_index_says_what_the_caches_will_take(tmp_path, tiny_llm, capsys):
    base = dict(model=str(tiny_llm.path), storage_dtype="float32")
    _, report = index_store(FACTS, tmp_path / "s", IndexSettings(**base), llm=tiny_llm)
    config = tiny_llm.model.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 4
    assert report["estimate"]["bytes_per_token"] == per_token
    files = list((tmp_path / "s" / "kv" / "kv").glob("*/*.safetensors"))
    tensor_bytes = sum(p.stat().st_size for p in files)
    # the files hold exactly the estimated tensors plus each file's header
    assert report["estimate"]["bytes"] <= tensor_bytes <= report["estimate"]["bytes"] + 4096 * len(files)
    assert "KiB per document token" in capsys.readouterr().err
