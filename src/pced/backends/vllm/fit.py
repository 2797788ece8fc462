"""What vLLM 0.32 refuses of an engine's settings for a model, decided from the model's config in
pced's process, before any engine process starts (``engine_refusal``). vLLM finds the same faults
only once it runs: some while building its configuration, others in its engine process after
seconds to minutes of start-up, as a traceback there and a generic failure here.

Each rule is vLLM's own, read from its source (paths under ``vllm/``):

- tensor parallelism: the attention heads split evenly over the ranks (``config/model.py:1544-1551``);
  the key-value heads too, or each is replicated on a whole number of ranks when there are more
  ranks than heads (``QKVParallelLinear``: ``model_executor/layers/linear.py:1052-1058``, its
  ``divide`` asserting ``distributed/utils.py:51-62``);
- the window: ``max_model_len`` at most the length the config derives (the smallest of its length
  keys, ``transformers_utils/model_arch_config_convertor.py:394-427``, times a RoPE scaling factor,
  at most the tokenizer's ``model_max_length``), unless the config's own ``model_max_length``
  allows it or ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` is set (``config/model.py:2527-2667``);
- the KV cache, where its size is given (``kv_cache_memory_bytes``, per rank: pced passes
  ``--kv-cache-gb`` split over the ranks, ``VLLMSettings.rank_kv_cache_bytes``; on the CPU build
  ``VLLM_CPU_KVCACHE_SPACE`` GiB a rank where set, ``platforms/cpu.py:323-327``): one sequence of
  ``max_model_len`` tokens must fit beside the one block the pool holds back
  (``v1/core/kv_cache_utils.py:2627-2648``, the need ``:2337-2366``, the check ``:1003-1040``; a
  full-attention layer takes ``cdiv(max_model_len, block_size)`` pages,
  ``v1/kv_cache_interface.py:602-607``, a page ``block_size * kv_heads * (head_size + head_size_v)
  * dtype size``, ``:545-553``).

Where pced cannot know vLLM's figure exactly it errs towards letting vLLM decide: the KV check
counts only models whose every layer keeps full attention, and "auto" dtypes at 2 bytes (vLLM
casts a float32 config to a 16-bit type: ``config/model.py:2405-2428``).
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import Any

from .settings import VLLMSettings
from .store_kv import connector_names, store_kv_support

OFFLOADING = "OffloadingConnector"  # vLLM's offloading of GPU KV blocks to host memory (kv_connector/factory.py:212-216)

# config keys vLLM reads a window from (model_arch_config_convertor.py:396-413)
WINDOW_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
               "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
# RoPE types whose max_position_embeddings is already scaled (config/model.py:2595-2602)
PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
# where vLLM reads the key-value heads (model_arch_config_convertor.py:150-167)
KV_HEAD_KEYS = ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num", "num_attention_groups")
STATE_SPACE_KEYS = ("ssm_state_size", "mamba_d_state", "linear_conv_kernel_dim")  # hybrid models' recurrent layers
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "auto": 2}
UNSET_TOKENIZER_LENGTH = int(1e29)  # transformers' "no limit" (VERY_LARGE_INTEGER is 1e30)
GIB = 2**30


def engine_refusal(config: Any, settings: VLLMSettings, cuda: bool,
                   tokenizer_max_length: int | None = None) -> str | None:
    """Why vLLM will refuse to start an engine with ``settings`` for the model of ``config`` (a
    transformers config), in one line, or None. ``cuda``: the platform whose defaults fill what
    ``settings`` leave unset; ``tokenizer_max_length``: the tokenizer's ``model_max_length``."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return (tensor_parallel_refusal(text, settings.tensor_parallel_size)
            or window_refusal(config, settings.max_model_len, tokenizer_max_length)
            or kv_cache_refusal(config, settings, cuda, tokenizer_max_length)
            or (store_kv_refusal(config) if settings.store_kv is True else None)  # alone or behind the file's tiers
            or offload_refusal(settings, cuda))


def tensor_parallel_refusal(text: Any, size: int) -> str | None:
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    if size == 1 or not heads:
        return None
    kv = None if is_mla(text) else kv_heads(text)
    fits = [n for n in range(1, heads + 1) if splits(heads, kv, n)]
    if heads % size:
        what = f"its {heads} attention heads"
    elif kv is not None and not splits(heads, kv, size):
        what = f"its {kv} key-value heads (or a multiple of them, each replicated)"
    else:
        return None
    return (f"tensor parallel size {size} does not fit this model: vLLM splits {what} evenly over the ranks; "
            f"sizes that fit: {', '.join(map(str, fits))}")


def splits(heads: int, kv: int | None, size: int) -> bool:
    """Whether ``size`` ranks split ``heads`` attention and ``kv`` key-value heads as vLLM does."""
    return heads % size == 0 and (kv is None or (size % kv == 0 if size >= kv else kv % size == 0))


def kv_heads(text: Any) -> int:
    for key in KV_HEAD_KEYS:
        if getattr(text, key, None) is not None:
            return int(getattr(text, key))
    return int(text.num_attention_heads)


def is_mla(text: Any) -> bool:
    """Multi-head latent attention (DeepSeek V2/V3, Kimi K2, ...): one latent per token, no KV heads."""
    return getattr(text, "kv_lora_rank", None) is not None


def rope_layers(config: Any) -> list[dict]:
    """The config's RoPE parameters, one dict per layer type where nested (``iter_rope_parameters``:
    transformers_utils/config.py:644-653)."""
    rope = getattr(config, "rope_parameters", None)
    if not isinstance(rope, dict) or not rope:
        return []
    nested = all(isinstance(p, dict) for p in rope.values())
    return [p for p in rope.values() if p] if nested else [rope]


def model_window(config: Any, tokenizer_max_length: int | None = None) -> int | None:
    """The longest sequence vLLM derives from the config (None: no length key, vLLM assumes 2048)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    lengths = [int(getattr(text, key)) for key in WINDOW_KEYS if getattr(text, key, None) is not None]
    if getattr(text, "model_max_length", None):  # Command-R's key wins over the others (convertor.py:423-426)
        lengths = [int(text.model_max_length)]
    if not lengths:
        return None
    window = min(lengths)
    if tokenizer_max_length is not None and tokenizer_max_length < UNSET_TOKENIZER_LENGTH:
        window = min(window, int(tokenizer_max_length))
    factor = 1.0
    for parameters in rope_layers(config) if "gemma3" not in str(getattr(config, "model_type", "")) else []:
        if parameters.get("rope_type") not in PRESCALED_ROPE:
            factor = parameters.get("factor", factor) or 1.0
    return int(window * factor)


def engine_length(config: Any, settings: VLLMSettings, cuda: bool, tokenizer_max_length: int | None) -> int:
    """The engine's ``max_model_len``: the setting, else vLLM's default (the derived window; LongRoPE's
    original one: config/model.py:2624-2634) capped as ``engine.engine_plan`` caps it on CUDA."""
    if settings.max_model_len is not None:
        return settings.max_model_len
    window = model_window(config, tokenizer_max_length) or 2048
    if any(p.get("rope_type") == "longrope" for p in rope_layers(config)):
        window = int(getattr(config, "original_max_position_embeddings", window))
    cap = settings.for_platform(cuda).max_model_len
    return min(window, cap) if cap else window


def window_refusal(config: Any, max_model_len: int | None, tokenizer_max_length: int | None) -> str | None:
    window = model_window(config, tokenizer_max_length)
    if max_model_len is None or window is None or max_model_len <= window:
        return None
    if max_model_len <= (getattr(config, "model_max_length", None) or 0):
        return None
    if os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true"):
        return None
    return (f"max model len {max_model_len} is longer than this model's {window}-token window, which vLLM refuses "
            f"(VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 overrides it); give {window} or less")


def full_attention(text: Any) -> bool:
    """Every layer attends to every earlier token with its own keys and values (no window, latent, or
    state-space layers), so that vLLM's KV cache need is the formula above."""
    if is_mla(text) or any(getattr(text, key, None) for key in STATE_SPACE_KEYS):
        return False
    layer_types = getattr(text, "layer_types", None)
    if layer_types and any(kind != "full_attention" for kind in layer_types):
        return False
    return getattr(text, "sliding_window", None) is None or getattr(text, "use_sliding_window", True) is False


def kv_cache_size(settings: VLLMSettings, cuda: bool) -> tuple[int, str] | None:
    """The engine's KV cache a rank, in bytes, and the setting as said to a person, where it is given
    (None: vLLM sizes it from the memory free when it starts). On the CPU build
    ``VLLM_CPU_KVCACHE_SPACE``, when set, replaces ``kv_cache_memory_bytes`` (platforms/cpu.py:323-327)."""
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    if not cuda and space != "":
        try:
            return int(space) * GIB, f"{int(space)} GiB a rank (VLLM_CPU_KVCACHE_SPACE)"
        except ValueError:  # vLLM's own int() fails on it: its error, not one pced restates
            return None
    if settings.kv_cache_gb is None:
        return None
    ranks = settings.tensor_parallel_size
    return settings.rank_kv_cache_bytes(), f"{settings.kv_cache_gb:g} GiB" + (f" over {ranks} ranks" if ranks > 1 else "")


def kv_cache_refusal(config: Any, settings: VLLMSettings, cuda: bool, tokenizer_max_length: int | None) -> str | None:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    size = kv_cache_size(settings, cuda)
    if size is None or not full_attention(text):
        return None
    length = engine_length(config, settings, cuda, tokenizer_max_length)
    dtype = settings.for_platform(cuda).dtype
    heads = int(text.num_attention_heads)
    head_size = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    rank_heads = max(1, kv_heads(text) // settings.tensor_parallel_size)
    block = settings.block_size or 1
    block_bytes = int(text.num_hidden_layers) * block * rank_heads * 2 * head_size * DTYPE_BYTES.get(dtype, 2)
    needed = math.ceil(length / block) * block_bytes
    if needed <= size[0] - block_bytes:  # beside the pool's null block
        return None
    ranks = settings.tensor_parallel_size
    return (f"a KV cache of {size[1]} cannot hold one sequence of {length} tokens, which vLLM requires (it needs "
            f"{(needed + block_bytes) * ranks / GIB:.3g} GiB for the engine"
            + (f", {(needed + block_bytes) / GIB:.3g} a rank" if ranks > 1 else "")
            + "); give a larger --kv-cache-gb or a smaller --max-model-len")


def with_store_kv(config: Any, settings: VLLMSettings) -> tuple[VLLMSettings, str | None]:
    """``settings`` with ``store_kv`` decided for the model of ``config`` where it was left to pced (None):
    on where the connector can serve the model, else off, with the one line that says why (vLLM's prefix
    cache still serves repeated documents). Asked for (True) for a model it cannot serve, it is
    refused by ``engine_refusal`` instead."""
    if settings.store_kv is not None:
        return settings, None
    if settings.kv_transfer_config is not None:  # a user's own connector replaces pced's
        return replace(settings, store_kv=False), None
    allowed, reason = store_kv_support(config)
    if allowed:
        return replace(settings, store_kv=True), None
    return replace(settings, store_kv=False), (f"{reason}; reading documents' KV from the store is off (vLLM's "
                                               "prefix cache still serves a document asked about again)")


def offload_refusal(settings: VLLMSettings, cuda: bool) -> str | None:
    """vLLM's ``OffloadingConnector`` in a ``--kv-transfer-config`` on its CPU build: its worker refuses
    to start there (``v1/kv_offload/cpu/spec.py:199-203``), found in vLLM's engine process after the
    model loaded; said here in one line before."""
    if cuda or settings.kv_transfer_config is None or OFFLOADING not in connector_names(settings.kv_transfer()):
        return None
    return (f"--kv-transfer-config {settings.kv_transfer_config}: vLLM's {OFFLOADING} copies KV between a GPU and "
            "host memory and runs on CUDA and XPU GPUs only; on vLLM's CPU build the KV cache is in host memory "
            "already: leave it out")


def store_kv_refusal(config: Any) -> str | None:
    """Why pced's store connector cannot serve this model's KV (latent attention, recurrent layers),
    or None: the connector's own decision (``store_kv.store_kv_support``), taken here before an engine
    starts instead of when vLLM builds the connector inside it."""
    allowed, reason = store_kv_support(config)
    return None if allowed else f"{reason} with --no-store-kv"
