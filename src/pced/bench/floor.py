"""The memory-bandwidth floor of a decode step: the bytes a step must read over the bytes per
second the device copies.

A decode step reads every weight once (the output layer included; the input embedding only for
the new token's row, so it is left out unless tied to the output layer) and, per row, the keys and
values of every token that row attends to. No implementation can decode faster than
``bytes / bandwidth``; ``pced bench`` prints it beside each measured decode time. The bandwidth
is measured, not looked up: the median of a few large device-to-device copies, counting the
bytes read and written.
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch


def copy_bandwidth(device: torch.device, megabytes: int | None = None, repeats: int = 5) -> float:
    """Bytes per second moved (read + write) by ``dst.copy_(src)`` on ``device``: median of ``repeats``."""
    device = torch.device(device)
    megabytes = megabytes or (1024 if device.type == "cuda" else 256)
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a decode step reads (the input embedding only if tied to the output layer)."""
    seen, total = set(), 0
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and output.weight.data_ptr() == embedding.data_ptr()
    for param in model.parameters():
        if param.data_ptr() in seen or (param is embedding and not tied):
            continue
        seen.add(param.data_ptr())
        total += param.numel() * param.element_size()
    return total


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of keys and values one token holds across all layers."""
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * heads * head_dim * element


def step_bytes(model: torch.nn.Module, row_tokens: Sequence[int]) -> int:
    """Bytes one decode step reads: the weights once, each row's keys and values."""
    return weight_bytes(model) + kv_bytes_per_token(model) * int(sum(row_tokens))


def decode_floor_s(model: torch.nn.Module, row_tokens: Sequence[int], bandwidth: float) -> float:
    return step_bytes(model, row_tokens) / bandwidth
