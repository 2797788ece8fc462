"""A preallocated KV cache written in place (as gpt-fast does), plugged into transformers' Cache API.

Row b of the batch owns a fixed buffer of ``capacity`` slots per layer. ``valid[b, j]`` says
whether slot j holds a real token for row b; padding slots are masked out. Every forward
passes explicit position ids and, where some slot is padding, a 4-D additive mask built here, so
rows may hold prompts of different lengths (padding in the middle of a row is fine) while every
row sees exactly the positions and keys of its own sequential prompt. Where every slot is real
(All, Single, the prefix and document encoders) no mask is built: attention is plain causal.
"""

from __future__ import annotations

import inspect
import threading
import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import use_pced_attention


class BufferLayer(CacheLayerMixin):
    """One layer's keys/values [B, H, capacity, D]; ``update`` writes at the cursor, never concatenates.

    With ``slot`` set (a [1] long tensor: the static decode step) it writes one token there and
    returns the whole buffer: the same shapes every step, no Python-int cursor in the graph."""

    is_sliding = False
    is_compileable = True
    slot: torch.Tensor | None = None

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int = 0):
        super().__init__()
        self.keys, self.values = keys, values
        self.length = length
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.slot is not None:
            self.keys.index_copy_(2, self.slot, key_states)
            self.values.index_copy_(2, self.slot, value_states)
            return self.keys, self.values
        end = self.length + key_states.shape[-2]
        if end > self.keys.shape[-2]:
            raise RuntimeError(f"KV buffer full: {end} slots needed, {self.keys.shape[-2]} allocated")
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        # transformers 5.0-5.3 pass the queries' cache_position tensor (cache_utils.py:123 of 5.0.0),
        # 5.4 and later their count (cache_utils.py:48 of 5.4.0)
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.keys.shape[-2]

    def get_max_cache_shape(self) -> int:  # get_max_length's name and abstract method before 5.13 (cache_utils.py:54 of 5.0.0)
        return self.get_max_length()


class BufferCache(Cache):
    """All layers' buffers: keys/values of shape [layers, B, H, capacity, D]."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int = 0):
        super().__init__(layers=[BufferLayer(k, v, length) for k, v in zip(keys, values)])
        self.key_buffer, self.value_buffer = keys, values

    @classmethod
    def allocate(cls, model: torch.nn.Module, batch: int, capacity: int, zero: bool = True,
                 reuse: bool = False) -> "BufferCache":
        """Buffers for ``batch`` rows of ``capacity`` slots. With ``zero=False`` the caller must write
        (or zero) every slot a query can see, masked ones included: 0 * garbage may be NaN. With
        ``reuse`` (and ``zero=False``) on a CPU model, the memory of an earlier such buffer of this
        model that nothing references any more is taken again (``SpareBuffer``)."""
        config = model.config.get_text_config(decoder=True)
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        param = next(model.parameters())
        shape = (config.num_hidden_layers, batch, heads, capacity, head_dim)
        if reuse and not zero and param.device.type == "cpu":
            spare = SpareBuffer.of(model)
            numel = torch.Size(shape).numel()
            flat = spare.take(2 * numel, param.dtype)
            cache = cls(flat[:numel].view(shape), flat[numel : 2 * numel].view(shape))
            weakref.finalize(cache, spare.give_back, flat)
            return cache
        make = torch.zeros if zero else torch.empty
        return cls(make(shape, dtype=param.dtype, device=param.device), make(shape, dtype=param.dtype, device=param.device))

    @property
    def length(self) -> int:
        return self.layers[0].length

    def set_length(self, length: int) -> None:
        for layer in self.layers:
            layer.length = length

    def write_at(self, slot: torch.Tensor | None) -> None:
        """Static decode steps from now on write at ``slot`` ([1] long, advanced by the caller on the
        device) and attend over the full capacity; slots not yet written are zeroed once (attention
        gives them weight 0, and 0 * uninitialised memory may be NaN). None: back to the cursor."""
        if slot is not None:
            self.key_buffer[:, :, :, self.length :] = 0
            self.value_buffer[:, :, :, self.length :] = 0
        for layer in self.layers:
            layer.slot = slot


class SpareBuffer:
    """The memory of one CPU batch buffer, kept between questions for the next one.

    Fresh memory costs a page fault and a zeroed page per 4 KiB on first write: writing the caches
    of 16 documents of 256 tokens into a fresh buffer took 90 ms of CPU here, into a written one
    14 ms (experiments/cpu_kernels.py). A buffer comes back when its ``BufferCache`` is collected and
    is lent again only if no view of it is left (its storage's use count), so no live tensor ever
    shares it; the largest one seen is kept (one per model, while the model lives)."""

    _by_model: "weakref.WeakKeyDictionary[torch.nn.Module, SpareBuffer]" = weakref.WeakKeyDictionary()
    _models_lock = threading.Lock()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flat: torch.Tensor | None = None

    @classmethod
    def of(cls, model: torch.nn.Module) -> "SpareBuffer":
        with cls._models_lock:
            if model not in cls._by_model:
                cls._by_model[model] = cls()
            return cls._by_model[model]

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat CPU tensor of at least ``numel`` elements (uninitialised), the spare one if it fits."""
        with self._lock:
            flat, self._flat = self._flat, None
        if flat is not None and flat.dtype == dtype and flat.numel() >= numel and _unshared(flat):
            return flat
        return torch.empty(numel, dtype=dtype)

    def give_back(self, flat: torch.Tensor) -> None:
        """Called as a buffer's cache is collected (its attributes still hold views then: ``take``
        checks that none is left); the larger of the kept and the returned memory is kept."""
        with self._lock:
            if self._flat is None or self._flat.numel() < flat.numel():
                self._flat = flat

    def drop(self) -> None:
        """Forget the kept memory (the next buffer is fresh)."""
        with self._lock:
            self._flat = None

    @property
    def nbytes(self) -> int:
        flat = self._flat
        return 0 if flat is None else flat.numel() * flat.element_size()


def _unshared(flat: torch.Tensor) -> bool:
    """No tensor but ``flat`` uses its memory (a view that outlived its cache keeps it from being lent)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return use_count is not None and use_count(flat.untyped_storage()._cdata) <= 2  # flat, and the storage asked


_CACHE_KEYWORD: dict[type, str] = {}


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword under which ``model``'s forward takes its cache. transformers 5.24 renamed it
    ``cache`` and deprecated ``past_key_values`` (removed in 5.40: ``@deprecate_kwarg("past_key_values",
    "5.40.0", new_name="cache")`` on ``LlamaForCausalLM.forward``, models/llama/modeling_llama.py:427 of
    5.24.0, warning with a FutureWarning on every call, utils/deprecation.py:171); 5.0 to 5.23 know only
    ``past_key_values`` (modeling_llama.py:461 of 5.0.0, :432 of 5.23.0). The signature says which:
    ``deprecate_kwarg`` keeps it readable through ``functools.wraps`` (utils/deprecation.py:121)."""
    kind = type(model)
    if kind not in _CACHE_KEYWORD:
        parameters = inspect.signature(kind.forward).parameters
        _CACHE_KEYWORD[kind] = "cache" if "cache" in parameters else "past_key_values"
    return _CACHE_KEYWORD[kind]


def additive_mask(valid: torch.Tensor, start: int, query_length: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, q, start+q] mask: query i (slot start+i) sees valid slots j <= start+i."""
    total = start + query_length
    slots = torch.arange(total, device=valid.device)
    queries = torch.arange(start, total, device=valid.device)
    allowed = valid[:, None, None, :total] & (slots[None, :] <= queries[:, None])[None, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=valid.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


@torch.inference_mode()
def forward_slots(
    model: torch.nn.Module,
    cache: BufferCache,
    valid: torch.Tensor,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    last_only: bool = True,
    padded: bool | None = None,
    **model_kwargs,
) -> torch.Tensor:
    """Run ``input_ids [B, q]`` at the cache cursor; returns logits [B, V] (last position) or [B, q, V].

    ``valid`` must already mark which of the new slots hold real tokens (left padding stays False).
    ``padded`` says whether any slot up to the new ones is padding, when the caller knows (rows
    do): None reads it from ``valid``, a device-to-host sync that a GPU decode step should not pay.
    """
    use_pced_attention(model)  # masked GQA without the math kernel on CUDA (see kv/attention.py)
    start, query_length = cache.length, input_ids.shape[1]
    if padded is None:
        padded = not bool(valid[:, : start + query_length].all())
    if model_kwargs or padded:
        mask = additive_mask(valid, start, query_length, cache.key_buffer.dtype)
    else:  # every slot holds a real token: plain causal attention, with no [q, total] mask tensor
        mask = None  # (the model's own mask builder; SDPA takes its is_causal path where it can)
    out = model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=mask,
        **{cache_keyword(model): cache},
        use_cache=True,
        logits_to_keep=1 if last_only else 0,
        **model_kwargs,  # reach the attention function (transformers passes them through)
    )
    logits = out.logits
    return logits[:, -1] if last_only else logits


@torch.no_grad()
def decode_one_token(model: torch.nn.Module, cache: BufferCache, valid: torch.Tensor, token: torch.Tensor,
                     position: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """The static decode step (gpt-fast's shape): ``token``/``position`` [B, 1] and ``slot`` [1] are
    device tensors, the cache writes at ``slot`` (``BufferCache.write_at``) and every row attends
    over the whole capacity under its validity mask. Same shapes every step, no host value: the
    step ``torch.compile`` can trace once (and CUDA graphs can replay). Returns logits [B, V]."""
    valid.index_fill_(1, slot, True)
    keyword = cache_keyword(model)  # a dictionary hit: the prefill's forward_slots looked it up
    dtype = cache.key_buffer.dtype
    mask = torch.zeros(valid.shape[0], 1, 1, valid.shape[1], dtype=dtype, device=valid.device)
    mask = mask.masked_fill(~valid[:, None, None, :], torch.finfo(dtype).min)
    out = model(input_ids=token, position_ids=position, attention_mask=mask, **{keyword: cache}, use_cache=True,
                logits_to_keep=1)
    return out.logits[:, -1]
