"""A model's identity: where it lives does not matter, its weights and architecture do."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pced.documents import Document
from pced.fingerprint import legacy_model_fingerprint
from pced.llm import load_model
from pced.store import DocumentStore, IndexSettings, StoreError, index_store

DOCS = [Document("a", "Mira Quell was born in Oskvale."), Document("b", "Oskvale is a fishing town.")]


def copy_model(source, target):
    shutil.copytree(source, target)
    return target


def index(root, model_dir, docs=DOCS):
    llm = load_model(model_dir, device="cpu", dtype="float32")
    return index_store(docs, root, IndexSettings(model=str(model_dir), storage_dtype="float32"), llm=llm,
                       progress=False)


def test_a_moved_or_copied_model_keeps_its_store_and_other_weights_are_refused(tmp_path, tiny_model_dir):
    first = copy_model(tiny_model_dir, tmp_path / "models" / "first")
    store, _ = index(tmp_path / "s", first)
    moved = tmp_path / "elsewhere" / "renamed"
    moved.parent.mkdir()
    shutil.move(first, moved)  # the folder the store recorded is gone
    llm = load_model(moved, device="cpu", dtype="float32")
    assert llm.fingerprint == store.manifest["model"]["fingerprint"]
    opened = DocumentStore.open(tmp_path / "s", llm)
    assert opened.generator.caches.load(opened.generator.caches.digests([DOCS[0].render()])[0]).n_tokens > 0
    store, report = index(tmp_path / "s", moved, DOCS + [Document("c", "A third document.")])
    assert report["added"] == 1 and report["kv_encoded"] == 1 and store.manifest["model"]["path"] == str(moved)

    changed = copy_model(moved, tmp_path / "models" / "changed")
    weights = load_file(changed / "model.safetensors")
    name = next(iter(sorted(weights)))
    weights[name] = weights[name] + 1e-3
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(StoreError, match="its weights differ"):
        DocumentStore.open(tmp_path / "s", load_model(changed, device="cpu", dtype="float32"))

    wider = copy_model(moved, tmp_path / "models" / "wider")
    config = json.loads((wider / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (wider / "config.json").write_text(json.dumps(config))
    with pytest.raises(StoreError, match="architecture differs .*rms_norm_eps"):
        DocumentStore.open(tmp_path / "s", load_model(wider, device="cpu", dtype="float32"))


def test_a_store_recorded_with_the_old_path_dependent_fingerprint_still_opens_after_a_move(tmp_path, tiny_model_dir):
    from transformers import AutoConfig

    first = copy_model(tiny_model_dir, tmp_path / "first")
    index(tmp_path / "s", first)
    root = tmp_path / "s"
    old = legacy_model_fingerprint(first, AutoConfig.from_pretrained(first), str(first))
    manifest = json.loads((root / "manifest.json").read_text())  # rewrite it all as older pced recorded it
    model = manifest["model"]
    manifest["model"] = {"name": model["name"], "path": model["path"], "fingerprint": old,
                         "tokenizer_hash": model["tokenizer_hash"]}
    (root / "manifest.json").write_text(json.dumps(manifest))
    kvstore = json.loads((root / "kv" / "kvstore.json").read_text())
    kvstore["model_fingerprint"] = old
    (root / "kv" / "kvstore.json").write_text(json.dumps(kvstore))
    for path in [root / "kv" / "prefix.safetensors", *(root / "kv" / "kv").glob("*/*.safetensors")]:
        from safetensors import safe_open

        with safe_open(path, "pt") as handle:
            meta = dict(handle.metadata())
        meta["model_fingerprint"] = old
        save_file(load_file(path), path, metadata=meta)
    moved = tmp_path / "moved"
    shutil.move(first, moved)
    store = DocumentStore.open(root, load_model(moved, device="cpu", dtype="float32"))
    digest = store.generator.caches.digests([DOCS[1].render()])[0]
    assert torch.isfinite(store.generator.caches.load(digest).keys.float()).all()
    store, report = index(root, moved, DOCS + [Document("c", "A third document.")])
    assert report["added"] == 1 and report["kv_encoded"] == 1
