"""Settings vLLM 0.32 refuses for a model, decided from tiny configs in pced's process
(``pced.backends.vllm.fit``): tensor parallelism against the attention and key-value heads, the
window, and the KV cache one sequence of the window needs."""

import pytest
from transformers import DeepseekV3Config, LlamaConfig, MistralConfig

from pced.backends.vllm.fit import engine_refusal, model_window
from pced.backends.vllm.settings import VLLMSettings

pytestmark = pytest.mark.transformers_api  # configs transformers builds (their text config, RoPE parameters)


def llama(heads: int = 4, kv: int = 2, **extra) -> LlamaConfig:
    return LlamaConfig(**{"vocab_size": 64, "hidden_size": 16 * heads, "intermediate_size": 128, "num_hidden_layers": 2,
                          "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": 16,
                          "max_position_embeddings": 2048, **extra})


def refusal(config, cuda: bool = False, tokenizer_max_length: int | None = None, **settings) -> str | None:
    return engine_refusal(config, VLLMSettings(**settings), cuda=cuda, tokenizer_max_length=tokenizer_max_length)


def test_tensor_parallel_size_must_split_the_attention_heads():
    embedded = llama(heads=9, kv=3)  # the embedded model's heads
    assert refusal(embedded, tensor_parallel_size=2) == (
        "tensor parallel size 2 does not fit this model: vLLM splits its 9 attention heads evenly over the ranks; "
        "sizes that fit: 1, 3, 9")
    assert refusal(embedded, tensor_parallel_size=3) is None
    assert refusal(embedded, tensor_parallel_size=9) is None  # 3 ranks replicate each key-value head


def test_tensor_parallel_size_must_split_the_key_value_heads_or_replicate_each_on_whole_ranks():
    config = llama(heads=12, kv=4)
    assert refusal(config, tensor_parallel_size=2) is None  # 2 key-value heads a rank
    assert refusal(config, tensor_parallel_size=4) is None
    assert refusal(config, tensor_parallel_size=12) is None  # each key-value head on 3 ranks
    message = refusal(config, tensor_parallel_size=6)  # divides the 12 heads, not the 4 key-value heads
    assert message.startswith("tensor parallel size 6 does not fit this model: vLLM splits its 4 key-value heads")
    assert message.endswith("sizes that fit: 1, 2, 4, 12")
    assert refusal(llama(heads=8, kv=8), tensor_parallel_size=8) is None  # no grouped-query attention


def test_max_model_len_must_fit_the_window_vllm_derives(monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    config = llama()
    assert refusal(config, max_model_len=2048) is None
    assert refusal(config, max_model_len=2049) == (
        "max model len 2049 is longer than this model's 2048-token window, which vLLM refuses "
        "(VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 overrides it); give 2048 or less")
    assert refusal(config, tokenizer_max_length=1024, max_model_len=1025).startswith(
        "max model len 1025 is longer than this model's 1024-token window")
    assert refusal(config, tokenizer_max_length=int(1e30), max_model_len=2048) is None  # the tokenizer sets no limit
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert refusal(config, max_model_len=4096) is None


def test_the_window_scales_with_rope_as_vllm_scales_it():
    linear = llama(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    assert model_window(linear) == 8192 and refusal(linear, max_model_len=8192) is None
    llama3 = llama(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
                                    "rope_theta": 10000.0})
    assert model_window(llama3) == 2048  # its max_position_embeddings is already the scaled window


def test_one_sequence_of_the_window_must_fit_the_kv_cache_given(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    # 2 layers x 2 key-value heads x (16 + 16) x 4 bytes = 512 B a token: a block of 32 is 16 KiB;
    # 64 tokens take 2 blocks, beside the one block the pool holds back: 48 KiB
    config, needed = llama(), 3 * 32 * 512
    assert refusal(config, max_model_len=64, kv_cache_gb=needed / 2**30) is None
    message = refusal(config, max_model_len=64, kv_cache_gb=(needed - 1) / 2**30)
    assert message.startswith("a KV cache of 4.57") and "cannot hold one sequence of 64 tokens" in message
    # unset, the window is the model's (2048 tokens: 1 MiB); on CUDA at most 16,384 tokens
    assert refusal(config, kv_cache_gb=1 / 1024) is not None and refusal(config, kv_cache_gb=1.1 / 1024) is None
    long = llama(max_position_embeddings=1 << 20)
    assert "one sequence of 16384 tokens" in refusal(long, cuda=True, kv_cache_gb=0.001)
    assert refusal(long, cuda=True, kv_cache_gb=16384 * 256 / 2**30 * 1.01) is None  # "auto": 2-byte keys and values


def test_the_kv_cache_edge_is_vllms_own(monkeypatch):
    """The embedded model's shape in float32 with 32-token blocks: vLLM's engine refused 0.3529 GiB
    and started with 0.353 GiB (257 blocks: one sequence of 8192 tokens and the null block)."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    embedded = LlamaConfig(vocab_size=64, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192)
    assert "it needs 0.353 GiB for the engine" in refusal(embedded, kv_cache_gb=0.3529)
    assert refusal(embedded, kv_cache_gb=0.353) is None


def test_the_cpu_builds_kv_cache_space_replaces_the_size_given(monkeypatch):
    long = llama(max_position_embeddings=1 << 20)  # float32 on the CPU: 512 MiB a sequence
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert refusal(long, kv_cache_gb=100) is None
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")
    assert refusal(long, kv_cache_gb=100).startswith("a KV cache of 0 GiB a rank (VLLM_CPU_KVCACHE_SPACE) cannot hold")
    assert refusal(long, cuda=True, kv_cache_gb=100) is None  # the CPU build's variable only


def test_the_kv_cache_given_is_the_whole_engines_split_over_its_ranks(monkeypatch):
    """Each rank holds its share of the key-value heads and gets its share of --kv-cache-gb."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    config, needed = llama(), 3 * 32 * 512
    assert refusal(config, max_model_len=64, kv_cache_gb=(needed - 1) / 2**30) is not None
    assert refusal(config, max_model_len=64, tensor_parallel_size=2, kv_cache_gb=needed / 2**30) is None
    message = refusal(config, max_model_len=64, tensor_parallel_size=2, kv_cache_gb=(needed - 2) / 2**30)
    assert "over 2 ranks cannot hold one sequence of 64 tokens" in message, message
    assert f"it needs {needed / 2**30:.3g} GiB for the engine, {needed / 2 / 2**30:.3g} a rank" in message, message


def test_models_with_windowed_layers_are_left_to_vllm():
    windowed = MistralConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, sliding_window=256)
    assert refusal(windowed, kv_cache_gb=1e-6) is None


def test_latent_attention_turns_the_store_connector_off_and_refuses_it_asked_for_before_an_engine_starts():
    """Left to pced (the default), the store's KV is off for a model the connector cannot serve, with the
    one line that says why; asked for (--store-kv), it is refused in one line."""
    from pced.backends.vllm.fit import with_store_kv

    latent = DeepseekV3Config(vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                              q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    resolved, note = with_store_kv(latent, VLLMSettings())
    assert resolved.store_kv is False
    assert note.startswith("pced's store connector cannot serve deepseek_v3's multi-head latent attention")
    assert note.endswith("reading documents' KV from the store is off (vLLM's prefix cache still serves a document "
                         "asked about again)")
    assert refusal(latent) is None  # left to pced: started without the connector
    message = refusal(latent, store_kv=True)
    assert message.startswith("pced's store connector cannot serve deepseek_v3's multi-head latent attention")
    assert message.endswith("with --no-store-kv")
    assert refusal(latent, store_kv=False) is None
    assert refusal(latent, kv_transfer_config=None, store_kv=False, tensor_parallel_size=4) is None
    plain, note = with_store_kv(llama(), VLLMSettings())
    assert plain.store_kv is True and note is None

def test_offloading_on_the_cpu_build_and_the_store_behind_a_users_tiers_for_latent_attention_are_refused(tmp_path):
    """vLLM's OffloadingConnector refuses to start on its CPU build (v1/kv_offload/cpu/spec.py:199-203),
    after the model loaded; the store chained behind a user's own tiers (--store-kv) runs pced's
    connector, which cannot serve latent attention."""
    import json

    offload, lmcache = tmp_path / "offload.json", tmp_path / "lmcache.json"
    offload.write_text(json.dumps({"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "connectors": [{"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}]}}))
    lmcache.write_text(json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}))
    message = refusal(llama(), kv_transfer_config=str(offload))
    assert message.startswith(f"--kv-transfer-config {offload}: vLLM's OffloadingConnector copies KV between a GPU")
    assert refusal(llama(), cuda=True, kv_transfer_config=str(offload)) is None
    latent = DeepseekV3Config(vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                              q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    assert refusal(latent, kv_transfer_config=str(lmcache)) is None  # the file alone: pced's connector is not in it
    assert refusal(latent, kv_transfer_config=str(lmcache), store_kv=True).endswith("with --no-store-kv")


def test_the_engines_memory_is_split_over_its_ranks_where_pced_sets_it():
    """--kv-cache-gb is the whole engine's (vLLM's kv_cache_memory_bytes is a rank's), and so is the CPU
    build's default memory share (vLLM's CPU worker takes the share for each rank); a share given is
    passed on as vLLM reads it, as is each GPU's."""
    three = VLLMSettings(kv_cache_gb=0.75, tensor_parallel_size=3)
    assert three.engine_args()["kv_cache_memory_bytes"] == 2**28
    assert VLLMSettings(kv_cache_gb=0.75).engine_args()["kv_cache_memory_bytes"] == 3 * 2**28
    assert VLLMSettings(tensor_parallel_size=3).for_platform(cuda=False).gpu_memory_utilization == pytest.approx(0.1)
    assert VLLMSettings(tensor_parallel_size=3).for_platform(cuda=True).gpu_memory_utilization == 0.85
    given = VLLMSettings(tensor_parallel_size=3, gpu_memory_utilization=0.3)
    assert given.for_platform(cuda=False).gpu_memory_utilization == 0.3
