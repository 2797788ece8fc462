"""pced's attention function: SDPA in a layout every backend's fast kernel accepts, for masked GQA.

pced's forwards (PCED's padded rows, the document encoder after a cached prefix) give SDPA an
attention mask with grouped-query attention (fewer key/value heads than query heads). PyTorch's
CUDA kernels split on exactly that: flash takes GQA but no mask, memory-efficient takes a mask
but no GQA, so ``enable_gqa`` with a mask runs the math kernel (an fp32 score tensor per layer).
This function picks, per call, a layout that keeps the fast kernels and never copies keys where
it need not (the reasons and sources are in docs/attention.md):

- one query token (the decode step) with a mask: the query heads are packed onto their key/value
  head, ``[B, Hq, 1, D] -> [B, Hkv, Hq/Hkv, D]``, so heads match, no key is copied and the
  ``[B, 1, 1, kv]`` mask broadcasts (what transformers >= 5.23 does itself, ``pack_gqa``);
- several query tokens with a mask: on CUDA the keys are repeated per group (``repeat_kv``: equal
  heads, so the memory-efficient kernel takes the mask); elsewhere SDPA's native ``enable_gqa``
  (the CPU kernel takes both);
- no mask and fewer queries than keys (documents encoded after the stored prefix): a lower-right causal bias (``torch.nn.attention.bias.causal_lower_right``), which
  flash runs with native GQA and no mask tensor at all;
- anything else: transformers' own SDPA function, unchanged.

It is registered under ``PCED_ATTENTION`` in transformers' ``AttentionInterface`` when first
used (``use_pced_attention``), and a model is switched to it only if it runs "sdpa", once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

PCED_ATTENTION = "pced_sdpa"
_registered = False


def _grouped(query: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hq, q, D] -> [B, Hkv, groups * q, D]: each key/value head's query heads side by side."""
    batch, heads, q_len, dim = query.shape
    return query.reshape(batch, heads // groups, groups * q_len, dim)


def _repeat_kv(states: torch.Tensor, groups: int) -> torch.Tensor:
    batch, heads, length, dim = states.shape
    return states[:, :, None].expand(batch, heads, groups, length, dim).reshape(batch, heads * groups, length, dim)


def repeats_keys_for_mask(device: torch.device) -> bool:
    """Whether several masked queries get repeated keys (CUDA: flash refuses the mask, memory-efficient
    refuses GQA) rather than SDPA's native GQA (the CPU kernel takes both)."""
    return device.type == "cuda"


def pced_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [B, Hq, q, D], key/value [B, Hkv, kv, D]; returns
    [B, q, Hq, D]. The mask, when given, is [B, 1, q, kv] (boolean or additive)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_len, dim = query.shape
    kv_len = key.shape[2]
    plain = (dropout or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None
             or kwargs.get("softcap") is not None or kwargs.get("output_attentions"))
    if plain or (attention_mask is not None and attention_mask.shape[1] != 1):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if attention_mask is None:
        if q_len == 1 or q_len == kv_len or not (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
            return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                          is_causal=is_causal, **kwargs)
        if groups > 1 and repeats_keys_for_mask(query.device) and query.dtype not in (torch.float16, torch.bfloat16):
            # flash (the only CUDA kernel with GQA) takes half precision only; memory-efficient takes
            # the lower-right bias in float32 with equal heads (torch/nn/attention/bias.py)
            key, value, groups = _repeat_kv(key, groups), _repeat_kv(value, groups), 1
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(q_len, kv_len),
                                             scale=scaling, enable_gqa=groups > 1)
        return out.transpose(1, 2).contiguous(), None
    if q_len == 1 and query.device.type == "cpu" and not torch.compiler.is_compiling():
        spans = row_spans(kwargs.get(ROW_LAYOUT), batch, kv_len)
        if spans is not None:
            out = segmented_decode(_grouped(query, groups), key, value, attention_mask, spans, scaling)
            return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None
    if groups == 1:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    elif q_len == 1:  # the decode step: pack the query heads onto their key/value head
        out = F.scaled_dot_product_attention(_grouped(query, groups), key, value, attn_mask=attention_mask,
                                             scale=scaling).reshape(batch, heads, 1, dim)
    elif repeats_keys_for_mask(query.device):  # equal heads: the memory-efficient kernel takes the mask
        out = F.scaled_dot_product_attention(query, _repeat_kv(key, groups), _repeat_kv(value, groups),
                                             attn_mask=attention_mask, scale=scaling)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


# Attention by each row's own length pays one kernel call per run of rows instead of one for the
# batch; measured on the embedded model (experiments/cpu_kernels.py --attention), it wins once the
# masked slots it skips are at least this share of the batch's slots.
SEGMENTED_MIN_SKIPPED_SHARE = 0.3
ROW_LAYOUT = "pced_row_layout"  # the model keyword that carries it to this function


def row_spans(layout, batch: int, kv_len: int) -> tuple | None:
    """How a decode step's rows split into an unmasked head and a shared tail, or None where reading
    every slot (one SDPA call) is the better plan.

    ``layout`` is what the rows know on the host (``ExpertRows.row_layout``): per row ``(end, resume)``,
    its valid slots being [0, end) and [resume, kv) (end == resume: no gap), so no step reads the
    mask back. ``c`` = the smallest ``resume``: before it every row's valid slots are one run from
    slot 0, so each run of rows with the same end is one unmasked call over exactly its keys; from
    ``c`` on, one call for the whole batch (masked where a row resumes later)."""
    if layout is None or len(layout) != batch:
        return None
    c = min(resume for _, resume in layout)
    ends = [min(end, c) for end, _ in layout]
    skipped = sum(c - end for end in ends)
    # c == kv_len: no row's keys resume after a gap (nothing past the cursor yet): no tail to join
    if not 0 < c < kv_len or skipped < SEGMENTED_MIN_SKIPPED_SHARE * batch * kv_len:
        return None
    runs, start = [], 0
    for row in range(1, batch + 1):
        if row == batch or ends[row] != ends[start]:
            runs.append((start, row, ends[start]))
            start = row
    return c, runs, all(resume == c for _, resume in layout)


def segmented_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     spans: tuple, scale: float | None) -> torch.Tensor:
    """One query token per row (``query`` [B, Hkv, G, D], query heads packed onto their key/value
    head) over each row's own keys: an unmasked call per run of rows over slots [0, end), a masked
    call for all rows over [c, kv), joined exactly by their log-sum-exps. Returns [B, Hkv, G, D]."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    c, runs, tail_unmasked = spans
    tail_mask = None if tail_unmasked else mask[..., c : key.shape[2]]
    if tail_mask is not None and tail_mask.dtype == torch.bool:  # the kernel takes an additive mask only
        tail_mask = torch.zeros(tail_mask.shape, dtype=query.dtype).masked_fill_(~tail_mask, float("-inf"))
    tail_out, tail_lse = flash(query, key[:, :, c:], value[:, :, c:], scale=scale, attn_mask=tail_mask)[:2]
    head_out, head_lse = torch.zeros_like(tail_out), torch.full_like(tail_lse, float("-inf"))
    for first, last, end in runs:
        if end > 0:
            out, lse = flash(query[first:last], key[first:last, :, :end], value[first:last, :, :end], scale=scale)[:2]
            head_out[first:last], head_lse[first:last] = out, lse
    total = torch.logaddexp(head_lse, tail_lse)  # a part without keys has lse -inf: weight 0 (not 0 * NaN)
    out = (head_out.float() * torch.exp(head_lse - total)[..., None]
           + tail_out.float().nan_to_num_(0.0) * torch.exp(tail_lse - total)[..., None])
    return out.to(query.dtype)


def pced_mask(*args, attention_mask: torch.Tensor | None = None, mask_function=None, **kwargs):
    """The model's own mask builder under ``PCED_ATTENTION``: no mask where nothing is padded and the
    pattern is causal (``pced_attention_forward`` then aligns causality to the last key), else SDPA's."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if attention_mask is None and mask_function in (None, causal_mask_function):
        return None
    if mask_function is not None:
        kwargs["mask_function"] = mask_function
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register() -> str:
    """Register the function (and its mask builder) with transformers, once; returns its name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(PCED_ATTENTION, pced_attention_forward)
        AttentionMaskInterface.register(PCED_ATTENTION, pced_mask)
        _registered = True
    return PCED_ATTENTION


def use_pced_attention(model: torch.nn.Module) -> None:
    """Switch a model that runs transformers' "sdpa" to pced's function (a superset of it); a model
    loaded with another implementation (eager, flash, APE's) keeps it."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return
    model.set_attn_implementation(register())
