"""Which models pced's vLLM connector serves, from their configs alone (no weights): latent attention
(DeepSeek) and recurrent layers are refused, in one line, before an engine starts
(``store_kv_support``) and when the connector is built; a sliding-window hybrid (Gemma 3) is served
with vLLM's hybrid KV cache manager kept on, its sliding-window group's blocks before the window
(vLLM's null block) left unwritten."""

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from transformers import DeepseekV3Config, Gemma3Config, Gemma3TextConfig, LlamaConfig, Qwen3NextConfig

from pced.backends.vllm.store_kv import connector_config, store_kv_support

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
BLOCK = 16


def deepseek() -> DeepseekV3Config:
    return DeepseekV3Config(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                            n_routed_experts=4, intermediate_size=64, moe_intermediate_size=32)


def gemma3() -> Gemma3TextConfig:
    return Gemma3TextConfig(vocab_size=100, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, sliding_window=1024)


def test_latent_attention_and_recurrent_layers_are_refused_in_one_line_and_a_sliding_window_hybrid_is_served():
    allowed, reason = store_kv_support(deepseek())
    assert not allowed and "deepseek_v3" in reason and "latent" in reason and "\n" not in reason
    assert store_kv_support(deepseek().to_dict())[0] is False  # the model's config.json as read
    assert store_kv_support(SimpleNamespace(use_mla=True, hf_text_config=deepseek()))[0] is False  # vLLM's ModelConfig
    allowed, reason = store_kv_support(Qwen3NextConfig(num_hidden_layers=4))
    assert not allowed and "linear_attention" in reason
    for config in (gemma3(), Gemma3Config(text_config=gemma3().to_dict())):  # the text model and the multimodal one
        allowed, reason = store_kv_support(config)
        assert allowed and "hybrid KV cache manager" in reason
    assert store_kv_support(LlamaConfig(num_hidden_layers=2)) == (True, "")


@needs_vllm
def test_vllm_keeps_its_hybrid_kv_cache_manager_with_pceds_connector():
    """vLLM turns the manager off for a connector without SupportsHMA (config/vllm.py:2170-2192)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    assert KVConnectorFactory.supports_hma_config(KVTransferConfig(**connector_config()))


def connector(hf_config, role, kv_cache_config=None, layers=None):
    from pced.backends.vllm.connector import PCEDStoreConnector

    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(), cache_config=SimpleNamespace(block_size=BLOCK),
                             compilation_config=SimpleNamespace(static_forward_context=layers or {}),
                             model_config=SimpleNamespace(hf_config=hf_config, hf_text_config=hf_config,
                                                          dtype=torch.bfloat16))
    return PCEDStoreConnector(config, role, kv_cache_config)


@needs_vllm
def test_the_connector_refuses_latent_attention_when_built_and_builds_for_gemma3():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match="latent attention"):
            connector(deepseek(), role)
        assert connector(gemma3(), role).block_sizes == [BLOCK]


@needs_vllm
def test_a_hybrid_models_load_writes_each_group_in_its_own_blocks_and_skips_the_null_block(tiny_llm, tmp_path,
                                                                                        monkeypatch):
    """Two KV cache groups (full attention: layer 0; sliding window: layer 1), as vLLM's hybrid manager
    gives them: the sliding group's first blocks are the null block (id 0). Every byte equals what the
    forward's rows write through FlashAttention's writer, with the null block's tokens not written."""
    import vllm.distributed.parallel_state as parallel_state
    from helpers.cuda_cache_writers import attention_layer, cache_bytes, forward_rows, paged_caches
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from pced.backends.vllm.store_kv import group_params
    from pced.kv.store import KVStore
    from pced.text.prompts import RAG_TEMPLATE, PromptBuilder

    document = "The grey heron is the national bird of Elumia; its feathers are on the flag and on its coins."
    kv = KVStore(tmp_path / "kv", tiny_llm, PromptBuilder(tiny_llm.tokenizer, RAG_TEMPLATE), storage_dtype="float16")
    kv.add([document], progress=False)
    prompt = kv.builder.prefix_ids + kv.builder.context_ids([document]) + [5, 6, 7]
    params = group_params(kv, [prompt], [document])[0]
    tokens = len(prompt) - 3
    full = list(range(1, 1 + -(-len(prompt) // BLOCK)))
    sliding = [0, 0] + list(range(20, 20 + len(full) - 2))  # the window's blocks only
    groups = [SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=BLOCK), layer_names=[name])
              for name in ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")]
    kv_cache_config = SimpleNamespace(kv_cache_groups=groups)

    scheduler = connector(gemma3(), KVConnectorRole.SCHEDULER, kv_cache_config)
    request = SimpleNamespace(request_id="r", kv_transfer_params=params, prompt_token_ids=prompt)
    matched, _ = scheduler.get_num_new_matched_tokens(request, BLOCK)  # one block from the prefix cache
    assert matched == tokens - BLOCK
    scheduler.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: (full, sliding)), matched)
    meta = scheduler.build_connector_meta(None)

    heads, head_size = kv.prefix().keys.shape[1], kv.prefix().keys.shape[3]
    names = [g.layer_names[0] for g in groups]
    loaded, expected = ({name: attention_layer("FLASH_ATTN", cache, heads, head_size, "auto")
                         for name, cache in zip(names, paged_caches(names, 32, BLOCK, heads, head_size,
                                                                    torch.bfloat16, "LBNHC"))} for _ in range(2))
    stored = [kv.prefix().on("cpu", torch.float32), kv.load(kv.digests([document])[0]).on("cpu", torch.float32)]
    for index, (name, blocks) in enumerate(zip(names, (full, sliding))):
        rows = [torch.cat([part[i] for part in stored], dim=2)[index, :, BLOCK:tokens].transpose(0, 1)
                .to(torch.bfloat16) for i in (0, 1)]
        slots = torch.tensor([blocks[t // BLOCK] * BLOCK + t % BLOCK if blocks[t // BLOCK] else -1
                              for t in range(BLOCK, tokens)])
        layer = expected[name]
        layer.impl.do_kv_cache_update(layer, forward_rows(rows[0], 2), forward_rows(rows[1], 2), layer.kv_cache, slots)

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    worker = connector(gemma3(), KVConnectorRole.WORKER, kv_cache_config, loaded)
    worker.register_kv_caches({name: layer.kv_cache for name, layer in loaded.items()})
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    for name in names:
        worker.wait_for_layer_load(name)
    assert not worker.get_block_ids_with_load_errors()
    assert torch.equal(cache_bytes(loaded[names[0]].kv_cache), cache_bytes(expected[names[0]].kv_cache))
    null_page = loaded[names[1]].kv_cache[0]
    assert not null_page.any()  # the null block: never written
    assert scheduler.request_finished_all_groups(request, (full, sliding)) == (False, {"pced_store_tokens": matched})
