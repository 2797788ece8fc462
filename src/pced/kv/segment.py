"""One cache segment (a document's or the prefix's keys and values), its storage forms, and how it
reaches the device a batch buffer lives on.

Storage dtypes: ``float16`` (default), ``bfloat16`` and ``float32`` are stored as such. ``int8`` is
symmetric 8-bit with the scales KIVI (Liu et al., 2024) found right for each tensor: **keys per
channel** (one scale per layer, head and channel over the segment's tokens: a few key channels
carry outliers) and **values per token** (one scale per layer, head and token). The scales are
float32 and small: 4 bytes per value head and token plus a fixed 4 bytes per key channel, so a
token costs ``2 * head_dim + 4`` bytes per layer and head instead of float16's ``4 * head_dim``
(0.52x at head_dim 64, 0.51x at 128). Dequantization happens on the segment's destination device
(the GPU for a GPU model), so disk, the page cache and the host-to-device copy all carry the
smaller bytes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

STORAGE_TORCH_DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16,
                        "int8": torch.int8}
INT8_MAX = 127.0


@dataclass
class DocKV:
    """keys/values [layers, kv_heads, tokens, head_dim]; int8 segments carry their scales:
    ``key_scale`` [layers, kv_heads, 1, head_dim], ``value_scale`` [layers, kv_heads, tokens, 1]."""

    keys: torch.Tensor
    values: torch.Tensor
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None

    @property
    def n_tokens(self) -> int:
        return self.keys.shape[2]

    @property
    def quantized(self) -> bool:
        return self.key_scale is not None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors as stored in a file (names are the file's)."""
        out = {"keys": self.keys, "values": self.values}
        if self.quantized:
            out.update(key_scale=self.key_scale, value_scale=self.value_scale)
        return out

    def stored_as(self, storage_dtype: str) -> "DocKV":
        """This segment on the CPU in a storage dtype (int8: quantized)."""
        if storage_dtype == "int8":
            keys, key_scale = quantize_int8(self.keys, token_dim=2, per_token=False)
            values, value_scale = quantize_int8(self.values, token_dim=2, per_token=True)
            return DocKV(keys.cpu(), values.cpu(), key_scale.cpu(), value_scale.cpu())
        dtype = STORAGE_TORCH_DTYPES[storage_dtype]
        return DocKV(self.keys.to("cpu", dtype), self.values.to("cpu", dtype))

    def on(self, device: torch.device | str, dtype: torch.dtype | None = None,
           staging: "PinnedStaging | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) readable on ``device``, dequantized; ready to be written into a buffer there.

        A float segment already on the device is returned as is (the buffer write converts the
        dtype). From the CPU to a CUDA device the bytes go through ``staging`` (pinned memory,
        non-blocking copies) when one is given. ``dtype`` is the dtype of dequantized values
        (default float32); float segments keep theirs.
        """
        device = torch.device(device)
        moved = {name: _to_device(t, device, staging) for name, t in self.tensors().items()}
        if not self.quantized:
            return moved["keys"], moved["values"]
        out = dtype or torch.float32
        keys = (moved["keys"].to(torch.float32) * moved["key_scale"]).to(out)
        values = (moved["values"].to(torch.float32) * moved["value_scale"]).to(out)
        return keys, values

    def dense(self, device: torch.device | str, dtype: torch.dtype, staging: "PinnedStaging | None" = None) -> "DocKV":
        """A float copy of this segment on ``device`` in ``dtype`` (what a device-resident pool keeps)."""
        keys, values = self.on(device, dtype, staging)
        own = keys.data_ptr() != self.keys.data_ptr()  # else still a view of the stored (mapped) tensor
        return DocKV(keys.to(dtype, copy=not own), values.to(dtype, copy=not own))


def quantize_int8(x: torch.Tensor, token_dim: int, per_token: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8: (q, scale) with x ~ q * scale; the scale is one per token (``per_token``) or one
    per channel over all tokens (keys). An all-zero group gets scale 1 (q = 0 there, exactly)."""
    x = x.float()
    reduce = -1 if per_token else token_dim
    absmax = x.abs().amax(dim=reduce, keepdim=True)
    scale = torch.where(absmax > 0, absmax / INT8_MAX, torch.ones_like(absmax))
    q = torch.round(x / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def _to_device(tensor: torch.Tensor, device: torch.device, staging: "PinnedStaging | None") -> torch.Tensor:
    if tensor.device == device:
        return tensor
    if staging is not None and tensor.device.type == "cpu" and device.type == "cuda":
        return staging.copy(tensor, device)
    return tensor.to(device)


class PinnedStaging:
    """Host-to-GPU copies through reused page-locked buffers, two of them in turn.

    A memory-mapped cache is pageable: CUDA copies it through a small driver buffer at a fraction
    of the link's speed. Here the CPU copies a segment into pinned memory, then the GPU pulls it
    with a non-blocking copy while the CPU fills the other buffer with the next segment. A buffer
    is reused only after the copy that read it has finished (a CUDA event per buffer).
    """

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.events: list = [None, None]
        self.turn = 0
        self.bytes_copied = 0
        self._lock = threading.Lock()  # one staging is shared by the store's prefix and its pool's loads

    def copy(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        with self._lock:
            return self._copy(tensor, device)

    def _copy(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        turn, self.turn = self.turn, 1 - self.turn
        if self.events[turn] is not None:
            self.events[turn].synchronize()  # the copy that last read this buffer has finished
        nbytes = tensor.numel() * tensor.element_size()
        if self.buffers[turn] is None or self.buffers[turn].numel() < nbytes:
            self.buffers[turn] = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
        staged = self.buffers[turn][:nbytes].view(tensor.dtype).view(tensor.shape)
        staged.copy_(tensor)
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        out.copy_(staged, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        self.events[turn] = event
        self.bytes_copied += nbytes
        return out
