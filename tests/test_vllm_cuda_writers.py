"""pced's vLLM connector against the contracts of vLLM 0.32's CUDA KV writers, checked on a CPU.

The connector hands each attention layer's writer ``[tokens, kv_heads, head_size]`` keys and values.
The CUDA writers (``reshape_and_cache_flash`` for FlashAttention, FlashInfer and Flex; the Triton
writer) read only ``key.stride(0)`` and assume the heads of a row contiguous (``helpers.
cuda_cache_writers`` transcribes them, reading memory as the kernels do). A load must leave every
byte of the paged cache as the forward's own keys and values would through the same writer: for a
request whose prefix was a prefix-cache hit (its document alone: one stored segment), one that loads
prefix and document, several loads in a step, each tensor-parallel rank's heads, every layout the
backend may be given, ``auto`` and fp8 caches."""

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from helpers.cuda_cache_writers import BACKENDS, attention_layer, cache_bytes, forward_rows, paged_caches

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

DOCS = ["Mira Quell painted the harbor of Elumia in 1887, the year the lighthouse burned down and the town rebuilt "
        "it in stone, brick by brick, over three long winters.",
        "The grey heron is the national bird of Elumia; its feathers are on the flag of the island and on its coins."]
BLOCK = 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(2)]  # the tiny model's two layers


@pytest.fixture(scope="module")
def stores(tmp_path_factory, tiny_llm):
    from pced.kv.store import KVStore
    from pced.text.prompts import RAG_TEMPLATE, PromptBuilder

    out = {}
    for dtype in ("float16", "int8"):
        kv = KVStore(tmp_path_factory.mktemp(dtype), tiny_llm, PromptBuilder(tiny_llm.tokenizer, RAG_TEMPLATE),
                     storage_dtype=dtype)
        kv.add(DOCS, progress=False)
        out[dtype] = kv
    return out


def store_rows(kv, digest: str, layer: int, heads: slice, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """Tokens start..end-1 of prefix + document, as the forward computed them: [tokens, heads, head_size]."""
    parts = [kv.prefix().on("cpu", torch.float32), kv.load(digest).on("cpu", torch.float32)]
    keys = torch.cat([k for k, _ in parts], dim=2)[layer, heads, start:end]
    values = torch.cat([v for _, v in parts], dim=2)[layer, heads, start:end]
    return keys.transpose(0, 1).to(dtype), values.transpose(0, 1).to(dtype)


def plans(kv) -> dict[str, list[tuple[str, int]]]:
    """(digest, first token to load) per request of a step: the load starts where the prefix cache's
    whole blocks end (v1/core/sched/scheduler.py:969-1027)."""
    prefix = len(kv.builder.prefix_ids)
    after = -(-prefix // BLOCK) * BLOCK  # the first block boundary past the prefix: the document alone
    first, second = kv.digests(DOCS)
    return {"document alone": [(first, after)], "prefix and document": [(first, 0)],
            "several loads": [(first, after), (second, BLOCK), (second, 0)]}


def connector_for(layers: dict, dtype: torch.dtype, tp: tuple[int, int], monkeypatch):
    import vllm.distributed.parallel_state as parallel_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from pced.backends.vllm.connector import PCEDStoreConnector

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: tp[0])
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: tp[1])
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(), cache_config=SimpleNamespace(block_size=BLOCK),
                             compilation_config=SimpleNamespace(static_forward_context=layers),
                             model_config=SimpleNamespace(dtype=dtype))
    connector = PCEDStoreConnector(config, KVConnectorRole.WORKER, None)
    connector.register_kv_caches({name: layer.kv_cache for name, layer in layers.items()})
    return connector


def cases():
    for backend, (_, layouts) in BACKENDS.items():
        for layout in layouts:
            yield pytest.param(backend, layout, "auto", torch.bfloat16, id=f"{backend}-{layout}-bf16")
        if backend in ("FLASH_ATTN", "TRITON_ATTN"):
            yield pytest.param(backend, layouts[0], "fp8", torch.bfloat16, id=f"{backend}-{layouts[0]}-fp8")
    yield pytest.param("FLASH_ATTN", "LBNHC", "auto", torch.float16, id="FLASH_ATTN-LBNHC-fp16")


@pytest.mark.parametrize("plan", ["document alone", "prefix and document", "several loads"])
@pytest.mark.parametrize("backend,layout,cache_dtype,dtype", list(cases()))
def test_a_load_writes_the_paged_cache_the_forward_would(stores, backend, layout, cache_dtype, dtype, plan,
                                                          monkeypatch):
    from pced.backends.vllm.connector import StoreLoad, StoreLoads
    from pced.backends.vllm.kv_layout import rank_heads
    from pced.backends.vllm.store_kv import StoreSpec, ids_digest

    for storage, tp in [("float16", (1, 0)), ("int8", (1, 0)), ("float16", (2, 0)), ("float16", (2, 1))]:
        kv = stores[storage]
        total_heads, head_size = kv.prefix().keys.shape[1], kv.prefix().keys.shape[3]
        heads = rank_heads(total_heads, *tp)
        local = heads.stop - heads.start
        cache_torch = torch.uint8 if cache_dtype != "auto" else dtype
        scales = (0.5, 0.25) if cache_dtype != "auto" else (1.0, 1.0)
        loaded, expected = ({name: attention_layer(backend, cache, local, head_size, cache_dtype, *scales)
                             for name, cache in zip(NAMES, paged_caches(NAMES, 24, BLOCK, local, head_size,
                                                                        cache_torch, layout))}
                            for _ in range(2))
        loads, next_block = [], 1  # block 0 is vLLM's null block
        for i, (digest, start) in enumerate(plans(kv)[plan]):
            tokens = len(kv.builder.prefix_ids) + len(kv.builder.context_ids([DOCS[kv.digests(DOCS).index(digest)]]))
            blocks = list(range(next_block, next_block + -(-tokens // BLOCK)))[::-1]  # scattered, descending
            next_block += len(blocks)
            spec = StoreSpec(str(kv.root.resolve()), digest, len(kv.builder.prefix_ids), tokens, ids_digest([]))
            loads.append(StoreLoad(f"r{i}", spec, start, [blocks]))
            slots = torch.tensor([blocks[t // BLOCK] * BLOCK + t % BLOCK for t in range(start, tokens)])
            for index, name in enumerate(NAMES):
                layer = expected[name]
                keys, values = store_rows(kv, digest, index, heads, start, tokens, dtype)
                layer.impl.do_kv_cache_update(layer, forward_rows(keys, 2), forward_rows(values, 2), layer.kv_cache,
                                              slots)
        connector = connector_for(loaded, dtype, tp, monkeypatch)
        connector.bind_connector_metadata(StoreLoads([BLOCK], loads))
        connector.start_load_kv(None)
        for name in NAMES:
            connector.wait_for_layer_load(name)
        assert not connector.get_block_ids_with_load_errors()
        got, want = cache_bytes(loaded[NAMES[0]].kv_cache), cache_bytes(expected[NAMES[0]].kv_cache)
        assert want.any(), "the expected cache was written"
        assert torch.equal(got, want), f"{storage} store, tp={tp}: {(got != want).sum()} bytes differ"


def test_an_int8_load_carries_its_bytes_to_the_device_dequantizes_there_and_reads_nothing_back(stores, monkeypatch):
    """The stored int8 values and their float32 scales cross to the device (about half of float16's
    bytes), dequantized after the copy; the load path makes no read from the device to the host
    (``helpers.host_reads``: on a GPU each would stall the host until the device caught up)."""
    from helpers.host_reads import HostReads

    from pced.backends.vllm.connector import StoreLoad, StoreLoads
    from pced.backends.vllm.store_kv import StoreSpec

    kv = stores["int8"]
    heads, head_size = kv.prefix().keys.shape[1], kv.prefix().keys.shape[3]
    digest = kv.digests(DOCS)[0]
    prefix = len(kv.builder.prefix_ids)
    tokens = prefix + len(kv.builder.context_ids(DOCS[:1]))
    written = []

    class Recorder:
        num_kv_heads = heads
        head_size = kv.prefix().keys.shape[3]

        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
            written.append((key, value))

    layers = {name: SimpleNamespace(kv_cache=torch.zeros(1), impl=Recorder(), kv_sharing_target_layer_name=None,
                                    attn_backend=SimpleNamespace(forward_includes_kv_cache_update=False))
              for name in NAMES}
    connector = connector_for(layers, torch.bfloat16, (1, 0), monkeypatch)
    spec = StoreSpec(str(kv.root.resolve()), digest, prefix, tokens, "")
    for _ in range(2):  # the second load: files verified, the steady state
        written.clear()
        connector.bind_connector_metadata(StoreLoads([BLOCK], [StoreLoad("r", spec, 0, [list(range(1, 20))])]))
        before = connector.loader.bytes_to_device if connector._loader else 0
        with HostReads() as reads:
            connector.start_load_kv(None)
            for name in NAMES:
                connector.wait_for_layer_load(name)
            failed = connector.get_block_ids_with_load_errors()
    assert not failed and reads.events == []
    per_layer = tokens * heads * (2 * head_size + 4) + 2 * heads * head_size * 4  # int8 K, V, value scales; key scales
    assert connector.loader.bytes_to_device - before == len(NAMES) * per_layer
    for index, (key, value) in enumerate(written):
        want = store_rows(kv, digest, index, slice(None), 0, tokens, torch.bfloat16)
        assert torch.equal(key, want[0]) and torch.equal(value, want[1])
