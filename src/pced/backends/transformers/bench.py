"""What the bench asks of a torch model (the transformers backend, and vLLM, which runs the same
weights in the same dtype on a CPU): its ``WorkShape``, read off the model as loaded.

The weights a decode step reads are every parameter once, the input embedding excepted unless it
is the output layer (a step looks up one row of it per token); keys and values are held in the
model's dtype (the batch buffer is allocated in it, ``pced.kv.buffer``).
"""

from __future__ import annotations

import torch

from ...backend import WorkShape


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a decode step reads (the input embedding only if tied to the output layer).
    A model on the meta device (loaded without weights) counts the same: its tensors have no
    storage to compare, so a tied weight is known by being the same parameter."""
    seen, total = set(), 0
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and _storage(output.weight) == _storage(embedding)
    for param in model.parameters():
        if _storage(param) in seen or (param is embedding and not tied):
            continue
        seen.add(_storage(param))
        total += param.numel() * param.element_size()
    return total


def _storage(param: torch.Tensor) -> int:
    return id(param) if param.is_meta else param.data_ptr()


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of keys and values one token holds across all layers."""
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * heads * head_dim * element


def torch_work_shape(model: torch.nn.Module) -> WorkShape:
    config = model.config.get_text_config(decoder=True)
    output = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    weights, cell = weight_bytes(model), kv_bytes_per_token(model)
    return WorkShape(
        weight_bytes=weights,
        matmul_params=sum(m.weight.numel() for m in linears),  # the output layer is one of them
        output_params=output.weight.numel(),
        layers=config.num_hidden_layers, heads=heads, key_dim=head_dim, value_dim=head_dim,
        kv_bytes_per_cell=cell,
        matrices=tuple(sorted({(m.in_features, m.out_features) for m in linears if m is not output})),
        output=(output.weight.shape[1], output.weight.shape[0]),
        gemm_dtype=dtype,
        described_as=f"{dtype} weights {weights / 1e9:.3f} GB, {dtype} KV {cell:,} B/token")
