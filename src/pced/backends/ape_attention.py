"""APE, KV-cache merging (Yang et al., ICLR 2025: "Adaptive Parallel Encoding"), model-agnostic.

APE reuses exactly the per-document caches pced stores: the shared prefix at positions
``0..P-1`` and every document encoded on its own after it, at positions ``P..P+L_i-1``. One
row of the cache holds::

    slots [0, P)                 the prefix
    slots [P, P + sum L_i)       doc_1 | doc_2 | ... back to back (the "block"), each keeping
                                 the positions P.. baked into its stored keys
    slots [P + sum L_i, ...)     the question suffix, then the generated tokens, at positions
                                 P + max_i L_i, P + max_i L_i + 1, ... (APE: after the longest document)

The question and generated tokens attend to everything (prefix, every document, causal local
tokens), but not with one softmax. With ``x = q.k / sqrt(d)`` (plus the additive mask):

    A = prefix + local slots:  lse_a = logsumexp(x_A),        out_a = softmax(x_A) V_A
    B = document block:        lse_b = logsumexp(x_B / T),    out_b = softmax(x_B / T) V_B
                               lse_b' = S * T * lse_b
    out = (e^lse_a out_a + e^lse_b' out_b) / (e^lse_a + e^lse_b')

T is APE's attention temperature on the context tokens and S its scaling factor; defaults
T = S = 0.9 (APE's README). The ``S * T`` factor is the authors' code (``scale = scale *
temperature; lse_context = lse_context * scale`` on the LSE of the T-tempered context logits):
``T * logsumexp(x / T)`` is the block's log-mass expressed back in logit units (it tends to
max x as T -> 0), and S < 1 then shrinks the block's share against prefix + query. With
T = S = 1 the merge is exactly one softmax over all slots, i.e. plain attention over the
concatenation of independently encoded blocks (the tests check this).

The merge runs inside transformers' attention interface: ``ape_attention_forward`` is
registered under the name ``"pced_ape"`` (with SDPA's mask builder under the same name) the
first time APE runs. Called without ``ape_block`` it *is* pced's SDPA function
(``pced.kv.attention``), so the registration changes nothing for anyone else. The model is switched to it only around each
APE forward (``use_ape_attention``) and switched back afterwards, so a model loaded with eager
or flash attention keeps its own kernel for every other method; two threads decoding on one
model at the same moment would see each other's switch (exact only if the model's own
implementation is "sdpa", the pced default).

Supported model types are those whose attention layer hands post-RoPE ``(q, k, v)`` plus a
``scaling`` to the interface and adds nothing else to the logits: llama, mistral, qwen2,
qwen3 (checked against transformers 5.23; sliding-window layers and logit soft-capping are refused).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence, Union

import torch
from ..kv.attention import pced_attention_forward
from ..kv.buffer import BufferCache, forward_slots
from ..kv.segment import DocKV
from ..llm import LoadedModel
from .rows import CachedRows

APE_ATTENTION = "pced_ape"
APE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

DocumentCache = Union[DocKV, Callable[[], DocKV]]


# -- the merged attention, on plain tensors -------------------------------------------------------
def _as_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    return mask.to(dtype)


def ape_merged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    block: tuple[int, int],
    scaling: float,
    temperature: float,
    scale: float,
) -> torch.Tensor:
    """APE attention of ``query [B, Hq, q, D]`` over ``key/value [B, Hkv, kv, D]``; returns [B, Hq, q, D].

    Key slots ``block = (start, end)`` form the context block (temperature T, LSE scaled by S*T);
    all other slots are attended normally. ``attention_mask`` is additive (or boolean, True =
    visible), broadcastable to [B, 1 | Hq, q, kv]. Query heads share key heads in groups of
    Hq / Hkv (grouped-query attention, the layout of transformers' ``repeat_kv``) without
    materializing repeated keys. Logits, LSEs and the merge run in at least float32.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads")
    start, end = block
    if not 0 <= start < end <= kv_len:
        raise ValueError(f"APE block {block} is not a non-empty slot range inside the {kv_len} key slots")
    groups = heads // kv_heads
    compute = torch.promote_types(query.dtype, torch.float32)
    # One score matrix over all slots; the block's columns get 1/T, then each part is normalized
    # by its own LSE and re-weighted by the merge, so one matmul with V does both parts at once.
    grouped_query = query.reshape(batch, kv_heads, groups * q_len, dim)
    logits = torch.matmul(grouped_query, key.transpose(-1, -2)).to(compute).view(batch, kv_heads, groups, q_len, kv_len)
    in_block = torch.zeros(kv_len, dtype=torch.bool, device=query.device)
    in_block[start:end] = True
    column_scale = torch.full((kv_len,), scaling, dtype=compute, device=query.device)
    column_scale[start:end] = scaling / temperature
    logits = logits * column_scale
    if attention_mask is not None:
        mask = _as_additive(attention_mask, compute)
        logits = logits + (mask.reshape(mask.shape[0], kv_heads, groups, q_len, kv_len) if mask.shape[1] == heads else mask[:, :, None])
    lse_a = torch.logsumexp(logits.masked_fill(in_block, float("-inf")), dim=-1, keepdim=True)
    lse_b = torch.logsumexp(logits.masked_fill(~in_block, float("-inf")), dim=-1, keepdim=True)
    log_weights = torch.log_softmax(torch.cat([lse_a, scale * temperature * lse_b], dim=-1), dim=-1)
    # p_j = softmax_part(j)(x)_j * weight_part(j) = exp(x_j - lse_part + log weight_part)
    shift = torch.where(in_block, lse_b - log_weights[..., 1:], lse_a - log_weights[..., :1])
    probs = torch.exp(logits - shift).to(value.dtype).view(batch, kv_heads, groups * q_len, kv_len)
    out = torch.matmul(probs, value)
    return out.reshape(batch, heads, q_len, dim).to(query.dtype)


# -- the transformers attention function ----------------------------------------------------------
def ape_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    ape_block: tuple[int, int] | None = None,
    ape_temperature: float = 1.0,
    ape_scale: float = 1.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature; pced's SDPA function unless ``ape_block`` names the context slots."""
    if ape_block is None:
        return pced_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if dropout:
        raise ValueError("APE attention is an inference method; put the model in eval mode")
    if kwargs.get("softcap") is not None:
        raise ValueError("APE attention does not support attention-logit soft-capping")
    window = kwargs.get("sliding_window")
    if window is not None and key.shape[2] > window:
        raise ValueError(f"APE attention does not support sliding windows ({key.shape[2]} slots > window {window})")
    if ape_block[1] > key.shape[2] - query.shape[2]:
        raise ValueError(f"APE block {tuple(ape_block)} overlaps the {query.shape[2]} query slots at the end of the cache")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = ape_merged_attention(query, key, value, attention_mask, tuple(ape_block), scaling, ape_temperature, ape_scale)
    return out.transpose(1, 2).contiguous(), None


_registered = False


def register_ape_attention() -> str:
    """Register the APE function with transformers the first time APE runs; returns its name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(APE_ATTENTION, ape_attention_forward)
        # Outside forward_slots (which always passes a ready 4-D mask) the model builds its mask by
        # the attention name; SDPA's builder makes the fallback exact there too.
        AttentionMaskInterface.register(APE_ATTENTION, sdpa_mask)
        _registered = True
    return APE_ATTENTION


def check_ape_support(config: object) -> None:
    """Raise ValueError (naming the model type) unless APE's attention is exact for this architecture."""
    model_type = getattr(config, "model_type", None)
    if model_type not in APE_MODEL_TYPES:
        raise ValueError(
            f"APE is implemented for {', '.join(APE_MODEL_TYPES)} models; this model's type is {model_type!r}"
        )
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        raise ValueError(f"APE needs full-attention layers; this {model_type} model has {sorted(set(layer_types))}")
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError(f"APE does not support attention-logit soft-capping ({model_type})")


@contextmanager
def use_ape_attention(model: torch.nn.Module) -> Iterator[None]:
    """Switch ``model`` to the APE attention function for the duration, then restore its own."""
    previous = model.config._attn_implementation
    if previous == APE_ATTENTION:
        yield
        return
    model.set_attn_implementation(register_ape_attention())
    try:
        if model.config._attn_implementation != APE_ATTENTION:
            raise RuntimeError(f"{type(model).__name__} refused the APE attention function (it keeps {previous!r})")
        yield
    finally:
        model.set_attn_implementation(previous)


# -- the row ----------------------------------------------------------------------------------------
class APERows(CachedRows):
    """One row: prefix | doc_1 | ... | doc_N | suffix | generated, decoded with APE attention.

    ``documents`` are the stored per-document caches (or zero-argument loaders, so that loading
    counts in ``cache_load_s``), in ranked order.
    """

    def __init__(self, llm: LoadedModel, prefix: DocKV, documents: Sequence[DocumentCache], suffix_ids: Sequence[int],
                 max_new_tokens: int, temperature: float, scale: float):
        super().__init__(llm)
        check_ape_support(llm.model.config)
        if not suffix_ids:
            raise ValueError("the question suffix is empty")
        if temperature <= 0 or scale <= 0:
            raise ValueError(f"APE needs temperature > 0 and scale > 0, got T={temperature}, S={scale}")
        self.prefix, self.documents = prefix, list(documents)
        self.suffix_ids, self.max_new_tokens = list(suffix_ids), max_new_tokens
        self.temperature, self.scale = float(temperature), float(scale)
        self.block: tuple[int, int] | None = None

    def prefill(self) -> torch.Tensor:
        started = time.perf_counter()
        device = self.llm.device
        caches = [doc() if callable(doc) else doc for doc in self.documents]
        prefix_len = self.prefix.n_tokens
        lengths = [kv.n_tokens for kv in caches]
        total, longest = sum(lengths), max(lengths, default=0)
        suffix_len = len(self.suffix_ids)
        last_position = prefix_len + longest + suffix_len + self.max_new_tokens
        if self.llm.max_context and last_position > self.llm.max_context:
            raise ValueError(
                f"ape: positions reach {last_position} (prefix {prefix_len} + longest document {longest} + question "
                f"{suffix_len} + {self.max_new_tokens} new tokens), beyond the model's {self.llm.max_context}"
            )
        capacity = prefix_len + total + suffix_len + self.max_new_tokens
        cache = BufferCache.allocate(self.llm.model, 1, capacity)
        keys, values = self.prefix.on(self.llm.device)
        cache.key_buffer[:, 0, :, :prefix_len] = keys
        cache.value_buffer[:, 0, :, :prefix_len] = values
        slot = prefix_len
        for kv in caches:
            keys, values = kv.on(self.llm.device)
            cache.key_buffer[:, 0, :, slot : slot + kv.n_tokens] = keys
            cache.value_buffer[:, 0, :, slot : slot + kv.n_tokens] = values
            slot += kv.n_tokens
        cache.set_length(slot)
        valid = torch.zeros(1, capacity, dtype=torch.bool, device=device)
        valid[:, : slot + suffix_len] = True
        self.cache, self.valid = cache, valid
        self.block = (prefix_len, slot) if total else None  # no documents: plain attention
        self.timings["cache_load_s"] = time.perf_counter() - started
        self.stats.update(
            documents=len(caches),
            context_tokens=slot + suffix_len,
            max_position=last_position,
            temperature=self.temperature,
            scale=self.scale,
        )
        ids = torch.tensor([self.suffix_ids], device=device)
        positions = (prefix_len + longest + torch.arange(suffix_len, device=device))[None]
        logits = self.forward(ids, positions)
        self.position = positions[:, -1] + 1
        return logits

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.block is None:
            return super().forward(ids, positions)
        with use_ape_attention(self.llm.model):
            return forward_slots(
                self.llm.model, self.cache, self.valid, ids, positions,
                ape_block=self.block, ape_temperature=self.temperature, ape_scale=self.scale,
            )
