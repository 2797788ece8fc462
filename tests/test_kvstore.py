"""Stored caches: round trips, dtype tolerances, incremental adds, refusals and damage."""

import json
import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from pced.decoding.sampling import SamplingConfig
from pced.methods.pced import Expert, PCEDGeneration
from pced.kv.format import CacheError
from pced.kv.store import KVStore
from pced.kv.encode import encode_documents, encode_prefix
from pced.llm import load_model
from pced.text.prompts import ICL_TEMPLATE, RAG_TEMPLATE, PromptBuilder
from pced.decoding.rule import RuleConfig

DOCS = ["Mira Quell founded Zorblax.", "Oskvale lies on Lake Tarnow. " * 10, "Short one."]
QUESTION = "Where was the founder born?"


def first_step_logits(llm, builder, prefix, caches):
    experts = [Expert(f"d{i}", 0.5, lambda kv=kv: kv) for i, kv in enumerate(caches)]
    generation = PCEDGeneration(llm, prefix, experts, builder.suffix_ids(QUESTION), builder.suffix_ids(QUESTION, False),
                            RuleConfig(), SamplingConfig(max_new_tokens=1))
    list(generation)
    return generation.last_logits


@pytest.fixture(scope="module")
def fresh(tiny_llm):
    builder = PromptBuilder(tiny_llm.tokenizer, RAG_TEMPLATE)
    prefix = encode_prefix(tiny_llm, builder.prefix_ids)
    caches = [encode_documents(tiny_llm, prefix, [builder.context_ids([d])])[0] for d in DOCS]
    return builder, first_step_logits(tiny_llm, builder, prefix, caches)


@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-5), ("float16", 5e-3), ("bfloat16", 5e-2), ("int8", 0.3)])
def test_stored_caches_reproduce_fresh_prefill(tiny_llm, fresh, tmp_path, dtype, tolerance):
    builder, reference = fresh
    store = KVStore(tmp_path, tiny_llm, builder, storage_dtype=dtype)
    digests = store.add(DOCS, batch_size=2, progress=False)
    reopened = KVStore(tmp_path, tiny_llm, builder, storage_dtype=dtype)
    caches = [reopened.load(d) for d in digests]
    assert caches[0].keys.dtype == getattr(torch, dtype)
    logits = first_step_logits(tiny_llm, builder, reopened.prefix(), caches)
    assert (logits - reference).abs().max().item() <= tolerance


def test_incremental_add_skips_stored_documents(tiny_llm, tmp_path):
    builder = PromptBuilder(tiny_llm.tokenizer)
    store = KVStore(tmp_path, tiny_llm, builder, "float32")
    first = store.add(DOCS[:2], progress=False)
    stamps = {d: store.path_for(d).stat().st_mtime_ns for d in first}
    both = store.add(DOCS, progress=False)
    assert both[:2] == first
    assert {d: store.path_for(d).stat().st_mtime_ns for d in first} == stamps
    assert len(list((tmp_path / "kv").rglob("*.safetensors"))) == 3
    assert not list(tmp_path.rglob(".tmp-*"))
    meta = json.loads((tmp_path / "kvstore.json").read_text())
    assert meta["template"] == "rag" and meta["storage_dtype"] == "float32"
    # atomic writes go through mkstemp (0600); the result has a plain open's mode, readable by others
    umask = os.umask(0o022)
    os.umask(umask)
    for path in [tmp_path / "kvstore.json", *(tmp_path / "kv").rglob("*.safetensors")]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path


def test_store_for_another_template_or_model_is_refused(tiny_llm, tiny_model_dir, tmp_path):
    store = KVStore(tmp_path, tiny_llm, PromptBuilder(tiny_llm.tokenizer, RAG_TEMPLATE), "float32")
    store.add(DOCS[:1], progress=False)
    with pytest.raises(CacheError, match="template"):
        KVStore(tmp_path, tiny_llm, PromptBuilder(tiny_llm.tokenizer, ICL_TEMPLATE), "float32")
    with pytest.raises(CacheError, match="storage_dtype"):
        KVStore(tmp_path, tiny_llm, PromptBuilder(tiny_llm.tokenizer, RAG_TEMPLATE), "float16")
    other = load_model(tiny_model_dir, device="cpu", dtype="float32")
    other.fingerprint = "0123456789abcdef"  # as if the weights had changed
    with pytest.raises(CacheError, match="model_fingerprint"):
        KVStore(tmp_path, other, PromptBuilder(other.tokenizer, RAG_TEMPLATE), "float32")


def test_damaged_or_foreign_cache_files_give_clear_errors(tiny_llm, tmp_path):
    builder = PromptBuilder(tiny_llm.tokenizer)
    store = KVStore(tmp_path, tiny_llm, builder, "float32")
    digest = store.add(DOCS[:1], progress=False)[0]
    path = store.path_for(digest)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(CacheError, match="damaged"):
        store.load(digest)
    save_file({"keys": torch.zeros(2, 2, 3, 16), "values": torch.zeros(2, 2, 3, 16)}, str(path), metadata={"model": "other"})
    with pytest.raises(CacheError, match="built for"):
        store.load(digest)
    with pytest.raises(CacheError, match="no cache"):
        store.load("ab" * 32)
    (tmp_path / "kvstore.json").write_text("{not json")
    with pytest.raises(CacheError, match="damaged"):
        KVStore(tmp_path, tiny_llm, builder, "float32")


def test_rows_without_padding_take_the_causal_path_with_the_same_logits(tiny_llm):
    """No [q, total] mask where every slot is real: the logits and the cache equal the masked path's."""
    from pced.kv.buffer import BufferCache, additive_mask, cache_keyword, forward_slots

    ids = torch.tensor([list(range(5, 45))])
    positions = torch.arange(40)[None]
    valid = torch.ones(1, 48, dtype=torch.bool)
    runs = []
    for masked in (False, True):
        cache = BufferCache.allocate(tiny_llm.model, 1, 48)
        if masked:  # the explicit-mask path, as padded rows take it
            kwargs = {"attention_mask": additive_mask(valid, 0, 40, cache.key_buffer.dtype)}
            with torch.inference_mode():
                kwargs[cache_keyword(tiny_llm.model)] = cache
                logits = tiny_llm.model(input_ids=ids, position_ids=positions, use_cache=True, **kwargs).logits[:, -1]
                step = tiny_llm.model(input_ids=torch.tensor([[7]]), position_ids=torch.tensor([[40]]),
                                      **{cache_keyword(tiny_llm.model): cache}, use_cache=True,
                                      attention_mask=additive_mask(valid, 40, 1, cache.key_buffer.dtype)).logits[:, -1]
        else:
            logits = forward_slots(tiny_llm.model, cache, valid, ids, positions)
            step = forward_slots(tiny_llm.model, cache, valid, torch.tensor([[7]]), torch.tensor([[40]]))
        runs.append((logits, step, cache.key_buffer[:, :, :, :41].clone()))
    (fast, fast_step, fast_keys), (masked, masked_step, masked_keys) = runs
    assert (fast - masked).abs().max().item() <= 1e-5
    assert (fast_step - masked_step).abs().max().item() <= 1e-5
    assert (fast_keys - masked_keys).abs().max().item() <= 1e-5
