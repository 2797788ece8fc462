"""From a stored segment (``pced.kv``: ``[layers, kv_heads, tokens, head_dim]``) to what vLLM's
attention backends write into their paged KV cache. Plain torch: no vLLM import.

The connector does not place bytes in the paged cache itself: it hands each attention layer's own
writer, ``impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)``, the keys and values
the forward pass would have computed, exactly as the forward hands them
(``model_executor/layers/attention/attention.py:724-746``, ``unified_kv_cache_update``): key and
value as ``[tokens, kv_heads, head_size]`` (the layer views them so: ``attention.py:535-538``) and
one flat slot per token. So every layout, ISA and cache dtype a backend has stays its own business,
and a segment arrives as the forward's own output would:

- the CPU build (``CPU_ATTN``) views a (block, head) page as ``[2 * block_size, head_size]``, keys
  in the first half and values in the second (``v1/attention/backends/cpu_attn.py:411-416``), and
  its writer (``:464-489``, ``cpu_attn_reshape_and_cache``) lays them out per ISA: with AVX-512
  (``vec``) a block's keys are stored channel-major, ``[head_size, block_size]``, its values
  token-major (measured: key[t, c] at page element ``c * block_size + t``), other ISAs (AMX, NEON)
  their own way;
- FlashAttention (``FLASH_ATTN``) and Triton read a block as ``[block_size, heads, 2 * head_size]``,
  key then value (``kv_cache.transpose(1, 2).split(head_size, dim=-1)``: ``flash_attn.py:1252``,
  ``:1443``; ``triton_attn.py:796``), written by ``reshape_and_cache_flash`` (``flash_attn.py:1430-1460``),
  an fp8 cache scaled on the way in.

With tensor parallelism each rank holds some of the KV heads: rank r holds shard ``r // replicas``
of ``max(1, heads // tp)`` heads, where ``replicas = max(1, tp // heads)``
(``model_executor/layers/linear.py:1053-1058`` and ``:1303``: QKVParallelLinear's k/v shard).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kv.segment import DocKV


def rank_heads(total_heads: int, tp_size: int, rank: int) -> slice:
    """The KV heads tensor-parallel rank ``rank`` of ``tp_size`` holds."""
    local = max(1, total_heads // tp_size)
    replicas = max(1, tp_size // total_heads)
    first = (rank // replicas) * local
    return slice(first, first + local)


def slots_of(block_ids: list[int], block_size: int, start: int, end: int, skip: int | None = None) -> torch.Tensor:
    """Flat slots (``block_id * block_size + offset``) of a request's tokens ``start..end-1`` from its
    block ids, as the runner's slot mapping numbers them (a backend splitting blocks into smaller
    kernel blocks keeps the same flat numbering: ``v1/kv_cache_interface.py:407-429``). Tokens in
    block ``skip`` get -1, a slot every writer skips (``csrc/cache_kernels.cu:338-342``,
    ``v1/attention/ops/triton_reshape_and_cache_flash.py:61-64``)."""
    tokens = torch.arange(start, end)
    blocks = torch.tensor(block_ids, dtype=torch.long)[tokens // block_size]
    slots = blocks * block_size + tokens % block_size
    return slots if skip is None else torch.where(blocks == skip, -1, slots)


@dataclass
class Chunk:
    """Tokens ``lo..hi-1`` of one stored segment."""

    kv: DocKV
    lo: int
    hi: int


def segment_chunks(segments: list[DocKV], start: int, end: int) -> list[Chunk]:
    """Tokens ``start..end-1`` of the prompt the segments make one after the other (prefix, document)."""
    chunks, offset = [], 0
    for kv in segments:
        lo, hi = max(start, offset), min(end, offset + kv.n_tokens)
        if lo < hi:
            chunks.append(Chunk(kv, lo - offset, hi - offset))
        offset += kv.n_tokens
    if offset < end or not chunks:
        raise ValueError(f"the stored segments hold {offset} tokens, tokens {start}..{end - 1} were asked for")
    return chunks


def stored_parts(chunk: Chunk, layer: int, heads: slice) -> list[torch.Tensor]:
    """One layer of a chunk as it lies in the file: keys and values ``[heads, tokens, head_dim]`` (and
    an int8 cache's scales), views of the memory-mapped file, nothing read yet."""
    kv, lo, hi = chunk.kv, chunk.lo, chunk.hi
    parts = [kv.keys[layer, heads, lo:hi], kv.values[layer, heads, lo:hi]]
    if kv.quantized:
        parts += [kv.key_scale[layer, heads], kv.value_scale[layer, heads, lo:hi]]
    return parts


def rows_of(parts: list[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``stored_parts`` (wherever they now are: on a GPU after the copy) as the forward's keys and
    values, contiguous ``[tokens, heads, head_dim]`` in ``dtype``; int8 dequantized here, keys per
    channel and values per token (``kv.segment``), in float32 as the transformers backend does."""
    keys, values = parts[0], parts[1]
    if len(parts) == 4:
        keys = keys.to(torch.float32) * parts[2]
        values = values.to(torch.float32) * parts[3]
    return token_major(keys, dtype), token_major(values, dtype)


def token_major(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[heads, tokens, head_dim]`` as a contiguous ``[tokens, heads, head_dim]`` in ``dtype`` (one copy).
    A transposed view will not do: the CUDA writers read a row's heads as contiguous (``check_writer_rows``)."""
    out = torch.empty((rows.shape[1], rows.shape[0], rows.shape[2]), dtype=dtype, device=rows.device)
    return out.copy_(rows.transpose(0, 1))


def check_writer_rows(keys: torch.Tensor, values: torch.Tensor, tokens: int, heads: int, head_dim: int) -> None:
    """Refuse rows a CUDA writer would misread. ``reshape_and_cache_flash`` reads only ``key.stride(0)``
    and takes a row's heads as contiguous (vLLM 0.32 ``csrc/cache_kernels.cu:871-872``, ``:348``,
    ``:384``; the Triton writer likewise: ``v1/attention/ops/triton_reshape_and_cache_flash.py:72``,
    ``:106-108``): a ``[tokens, heads, head_dim]`` view of ``[heads, tokens, head_dim]`` memory would
    hand heads 1..H-1 another token's values, silently."""
    for name, rows in (("keys", keys), ("values", values)):
        if tuple(rows.shape) != (tokens, heads, head_dim) or not rows.is_contiguous():
            raise RuntimeError(f"pced store connector: {name} for the KV writer must be a contiguous "
                               f"[{tokens}, {heads}, {head_dim}] tensor, got shape {tuple(rows.shape)} "
                               f"strides {rows.stride()}")


def prompt_rows(segments: list[DocKV], layer: int, heads: slice, start: int, end: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``start..end-1`` of one layer of the prompt the segments make (prefix, document), computed
    on the segments' own device as a load computes them on its."""
    rows = [rows_of(stored_parts(chunk, layer, heads), dtype) for chunk in segment_chunks(segments, start, end)]
    return (torch.cat([k for k, _ in rows]), torch.cat([v for _, v in rows])) if len(rows) > 1 else rows[0]
