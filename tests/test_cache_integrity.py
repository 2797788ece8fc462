"""Damaged caches never pass: NaN, finite garbage and truncation are one-line errors, pced verify
finds them all, and a cache written before checksums that holds NaN is stopped before the rule."""

import struct

import pytest
import torch
from safetensors.torch import save_file

from pced.decoding.sampling import SamplingConfig
from pced.cli import main
from pced.decoding.loop import DecodingError
from pced.documents import Candidate, Document
from pced.kv.format import CacheError, mmap_safetensors, verify_cache_dir
from pced.store import IndexSettings, index_store

DOCS = [Document("zorblax", "The Zorblax Company makes tidal clocks. It was founded by Mira Quell.", "Zorblax"),
        Document("quell", "Mira Quell was born in the town of Oskvale.", "Mira Quell"),
        Document("oskvale", "Oskvale is a fishing town on Lake Tarnow.", "Oskvale")]
QUESTION = "Where was the founder of Zorblax born?"


@pytest.fixture
def store(tmp_path, tiny_llm):
    store, _ = index_store(DOCS, tmp_path / "s", IndexSettings(model=str(tiny_llm.path), storage_dtype="float32"),
                           llm=tiny_llm, progress=False)
    return store


def cache_path(store, doc: Document):
    kv = store.generator.caches
    return kv.path_for(kv.digests([doc.render()])[0])


def data_offset(path) -> int:
    with open(path, "rb") as handle:
        return 8 + struct.unpack("<Q", handle.read(8))[0]


def overwrite(path, values: torch.Tensor) -> None:
    """Overwrite the start of the tensor bytes in place, leaving header and checksum as they were."""
    raw = values.numpy().tobytes()
    with open(path, "r+b") as handle:
        handle.seek(data_offset(path))
        handle.write(raw)


def answer(store):
    candidates = [Candidate(d, 0.9 - 0.1 * i) for i, d in enumerate(DOCS)]
    return store.generator.answer(candidates, QUESTION, sampling=SamplingConfig(max_new_tokens=3))


def test_intact_caches_carry_a_checksum_and_answer(store):
    meta, _ = mmap_safetensors(cache_path(store, DOCS[0]))
    assert meta["checksum"].startswith("crc32:")
    assert answer(store).token_ids


@pytest.mark.parametrize("damage, message", [
    (lambda path: overwrite(path, torch.full((64,), float("nan"))), "do not match its checksum"),
    (lambda path: overwrite(path, torch.full((64,), 3.0)), "do not match its checksum"),
    (lambda path: path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]), "truncated"),
    (lambda path: path.write_bytes(path.read_bytes()[:5]), "truncated"),
])
def test_damaged_cache_is_a_clear_error_and_verify_finds_it(store, capsys, damage, message):
    path = cache_path(store, DOCS[1])
    damage(path)
    with pytest.raises(CacheError, match=message) as error:
        answer(store)
    assert str(path) in str(error.value) and "\n" not in str(error.value)
    assert main(["verify", str(store.root)]) == 1
    out = capsys.readouterr()
    assert "1 damaged" in out.out and message in out.err
    assert main(["verify", str(store.root), "--remove"]) == 0 and not path.exists()
    capsys.readouterr()
    # the next index run re-encodes what was removed, and the answer is whole again
    _, report = index_store(DOCS, store.root, store.settings, llm=store.llm, progress=False)
    assert report["kv_encoded"] == 1 and main(["verify", str(store.root)]) == 0


def test_old_cache_without_checksum_holding_nan_is_stopped_before_the_rule(store):
    path = cache_path(store, DOCS[2])
    meta, tensors = mmap_safetensors(path)
    keys = tensors["keys"].clone()
    keys[0, 0, 0, :4] = float("nan")
    del meta["checksum"]  # as written before checksums existed
    save_file({"keys": keys, "values": tensors["values"].clone()}, str(path), metadata=meta)
    with pytest.raises(DecodingError, match="non-finite logits from 'oskvale'"):
        answer(store)
    report = verify_cache_dir(store.root / "kv")
    assert len(report["damaged"]) == 1 and "non-finite" in report["damaged"][0]
    assert report["without_checksum"] == 0  # the damaged file is counted as damaged, not as old


def test_cli_reports_a_damaged_cache_in_one_line(store, capsys, tiny_model_dir):
    overwrite(cache_path(store, DOCS[0]), torch.full((64,), 7.0))
    code = main(["ask", str(store.root), QUESTION, "--model", str(tiny_model_dir), "--top-k", "3", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "do not match its checksum" in err[0]
