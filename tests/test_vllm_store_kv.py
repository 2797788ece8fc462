"""What pced's vLLM connector reads and hands vLLM, without vLLM: each request's store parameters,
the rows it writes (the transformers backend's own cache values, as the forward hands keys to an
attention writer), and the KV heads of each tensor-parallel rank."""

import pytest
import torch

from pced.backends.vllm.engine import group_prompts
from pced.backends.vllm.kv_layout import prompt_rows, rank_heads, slots_of
from pced.backends.vllm.store_kv import PARAMS_KEY, StoreSpec, group_params, ids_digest
from pced.documents import Candidate, Document
from pced.kv.store import KVStore
from pced.text.prompts import RAG_TEMPLATE, PromptBuilder

DOCS = ["Mira Quell painted the harbor of Elumia in 1887, the year the lighthouse burned.",
        "The grey heron is the national bird of Elumia; its feathers are on the flag."]
QUESTION = "Who painted the harbor?"


@pytest.fixture
def store(tmp_path, tiny_llm):
    def make(dtype: str, documents=DOCS) -> KVStore:
        kv = KVStore(tmp_path / dtype, tiny_llm, PromptBuilder(tiny_llm.tokenizer, RAG_TEMPLATE), storage_dtype=dtype)
        kv.add(list(documents), progress=False)
        return kv
    return make


def test_each_row_names_the_prefix_and_its_stored_document_and_nothing_it_cannot_supply(store):
    kv = store("float16", DOCS[:1])  # the second document is not stored (a request's own document)
    candidates = [Candidate(Document(str(i), d), 0.5) for i, d in enumerate(DOCS)]
    prompts = group_prompts(kv.builder, candidates, QUESTION)
    specs = [StoreSpec.from_params(p) for p in group_params(kv, prompts, [None] + DOCS)]
    prefix = len(kv.builder.prefix_ids)
    assert [s.digest for s in specs] == [None, kv.digests(DOCS[:1])[0], None]
    assert [s.tokens for s in specs] == [prefix, prefix + len(kv.builder.context_ids(DOCS[:1])), prefix]
    for spec, prompt in zip(specs, prompts):
        assert spec.prefix_tokens == prefix and spec.kv_dir == str(kv.root.resolve())
        assert spec.available(prompt) and spec.ids == ids_digest(prompt[:spec.tokens])
        assert prompt[:spec.tokens] == kv.builder.prefix_ids + (kv.builder.context_ids(DOCS[:1]) if spec.digest else [])
    expert = specs[1]
    assert not expert.available(prompts[2])  # another prompt: its first tokens are not the stored ones
    assert not expert.available(prompts[1][:expert.tokens])  # nothing left to compute: vLLM needs a token
    kv.path_for(expert.digest).unlink()
    assert not expert.available(prompts[1])  # removed since: vLLM prefills it
    assert StoreSpec.from_params({PARAMS_KEY: {"kv_dir": "x"}}) is None and StoreSpec.from_params(None) is None


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_the_rows_are_the_transformers_backends_cache_values_token_by_token(store, dtype):
    kv = store(dtype)
    prefix, document = kv.prefix(), kv.load(kv.digests(DOCS[:1])[0])
    keys = torch.cat([prefix.on("cpu")[0], document.on("cpu")[0]], dim=2)  # what the transformers buffer holds
    values = torch.cat([prefix.on("cpu")[1], document.on("cpu")[1]], dim=2)
    total, heads = keys.shape[2], slice(0, keys.shape[1])
    for layer in range(keys.shape[0]):
        for start, end in [(0, total), (prefix.n_tokens - 3, total), (prefix.n_tokens + 5, total - 2)]:
            k, v = prompt_rows([prefix, document], layer, heads, start, end, torch.float32)
            # [tokens, heads, head_dim]: the orientation the forward hands an attention layer's writer
            assert torch.equal(k, keys[layer, :, start:end].transpose(0, 1).float())
            assert torch.equal(v, values[layer, :, start:end].transpose(0, 1).float())
    with pytest.raises(ValueError, match="hold"):
        prompt_rows([prefix, document], 0, heads, 0, total + 1, torch.float32)


def test_a_float32_store_holds_a_plain_forward_of_prefix_and_document_at_their_absolute_positions(store, tiny_llm):
    kv = store("float32")
    ids = kv.builder.prefix_ids + kv.builder.context_ids(DOCS[:1])
    with torch.inference_mode():
        cache = tiny_llm.model(torch.tensor([ids]), use_cache=True).past_key_values
    prefix, document = kv.prefix(), kv.load(kv.digests(DOCS[:1])[0])
    for layer in range(len(cache.layers)):
        k, v = prompt_rows([prefix, document], layer, slice(None), 0, len(ids), torch.float32)
        assert torch.allclose(k, cache.layers[layer].keys[0].transpose(0, 1), atol=1e-5)
        assert torch.allclose(v, cache.layers[layer].values[0].transpose(0, 1), atol=1e-5)


def test_tensor_parallel_ranks_hold_the_kv_heads_vllm_gives_them():
    # QKVParallelLinear: heads split in contiguous shards; fewer heads than ranks are replicated
    assert [rank_heads(8, 2, r) for r in range(2)] == [slice(0, 4), slice(4, 8)]
    assert [rank_heads(3, 1, 0)] == [slice(0, 3)]
    assert [rank_heads(2, 4, r) for r in range(4)] == [slice(0, 1), slice(0, 1), slice(1, 2), slice(1, 2)]
    assert [rank_heads(4, 4, r) for r in range(4)] == [slice(r, r + 1) for r in range(4)]


def test_slots_follow_the_requests_blocks():
    assert slots_of([7, 2, 9], 4, 2, 10).tolist() == [30, 31, 8, 9, 10, 11, 36, 37]


def test_a_files_checksum_is_checked_once_per_node_and_again_when_the_file_changes(store, tmp_path):
    """Workers of one node share a record of verified files (markers in a directory of their user's);
    a second worker process (the process's own record forgotten) skips the whole-file read, a file
    rewritten in place is checked again, and a marker directory others could write is not trusted."""
    import os

    from pced.backends.vllm.store_files import NodeVerified, StoreFiles
    from pced.kv.format import VERIFIED, CacheError

    kv = store("float16")
    prefix = len(kv.builder.prefix_ids)
    spec = StoreSpec(str(kv.root.resolve()), kv.digests(DOCS[:1])[0], prefix,
                     prefix + len(kv.builder.context_ids(DOCS[:1])), "")
    node = NodeVerified(tmp_path / "verified")
    VERIFIED.forget()
    first = StoreFiles(node)
    first.segments(spec)
    first.segments(spec)
    assert first.checksums == 2  # the prefix and the document, once
    VERIFIED.forget()  # another worker process on the node
    second = StoreFiles(node)
    second.segments(spec)
    assert second.checksums == 0
    path = kv.path_for(spec.digest)
    data = bytearray(path.read_bytes())
    data[-64:] = bytes(64)
    path.write_bytes(bytes(data))  # same size, new bytes
    VERIFIED.forget()
    with pytest.raises(CacheError, match="checksum"):
        StoreFiles(node).segments(spec)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    VERIFIED.forget()
    untrusted = NodeVerified(shared)
    StoreFiles(untrusted).segments(StoreSpec(spec.kv_dir, None, prefix, prefix, ""))
    assert not any(shared.iterdir())  # nothing written where others could forge a marker
    VERIFIED.forget()


def test_a_users_own_tiers_come_first_and_the_store_last():
    """``tiered_config``: a user's kv_transfer_config (vLLM's offloading, LMCache, or a MultiConnector of
    them) with pced's connector as the last child of vLLM's MultiConnector, which loads from the first
    child that offers tokens (vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py:434-453).
    The scheduler reads the failure policy from the top level only (v1/core/sched/scheduler.py:183-184):
    recompute, so a damaged store file is recomputed, unless the user chose otherwise."""
    from pced.backends.vllm.store_kv import connector_config, reads_store, tiered_config

    offload = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"cpu_bytes_to_use": 8 << 30}}
    tiers = tiered_config(offload)
    assert tiers == {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                     "kv_connector_extra_config": {"connectors": [offload, connector_config()]}}
    assert reads_store(tiers) and reads_store(connector_config()) and not reads_store(offload) and not reads_store(None)
    lmcache = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail",
             "kv_connector_extra_config": {"connectors": [offload, lmcache], "other": 1}}
    chained = tiered_config(multi)
    assert chained["kv_connector_extra_config"] == {"connectors": [offload, lmcache, connector_config()], "other": 1}
    assert chained["kv_load_failure_policy"] == "fail" and multi["kv_connector_extra_config"]["connectors"] == [offload, lmcache]
    assert tiered_config(chained) == chained  # the store once
    assert tiered_config({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_consumer"})["kv_role"] == "kv_consumer"
