"""What the bench asks of llama.cpp: a GGUF's ``WorkShape`` and its own kernels' step time.

- The work: the GGUF's tensors' bytes as shipped (quantized), read from the file's header; the
  matrices' weights per token; the KV cache in the context's cache type (f16: 2 bytes an element;
  q8_0: 34 bytes a block of 32). Sliding-window layers are counted as attending every cell.
- The kernels: one decode step of R sequences, each holding one or two cells, so that the step is
  the weights' quantized matrix products (its attention is a few cells a row); the best of a few
  steps. The bench turns it into FLOP/s and reports it beside the floor, never as the floor: the
  step's fixed costs (building the graph, copying the logits out) count against it.
"""

from __future__ import annotations

import time
from pathlib import Path

from ...backend import WorkShape


def _field(reader, name: str, default=None):
    """A scalar (or the largest of a per-layer array) from a GGUF header."""
    field = reader.fields.get(name)
    if field is None:
        return default
    values = [field.parts[i] for i in field.data]
    if field.types and field.types[0].name == "STRING":
        return bytes(values[0]).decode()
    return max(v.item() if hasattr(v, "item") else int(v[0]) for v in values)


def kv_element_bytes(cache_type: str) -> float:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[cache_type.upper()]]
    return size / block


def gguf_work_shape(path: str | Path, cache_type: str) -> WorkShape:
    """``cache_type``: llama.cpp's KV cache type as run (f16, q8_0)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    layers = int(_field(reader, f"{arch}.block_count"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    width = int(_field(reader, f"{arch}.embedding_length"))
    key_dim = int(_field(reader, f"{arch}.attention.key_length", width // heads))
    value_dim = int(_field(reader, f"{arch}.attention.value_length", key_dim))
    tensors = {t.name: t for t in reader.tensors}
    tied = "output.weight" not in tensors
    output = tensors["token_embd.weight" if tied else "output.weight"]
    weights = sum(int(t.n_bytes) for t in tensors.values()) - (0 if tied else int(tensors["token_embd.weight"].n_bytes))
    # GGUF dimensions are (ne0, ne1) = (inner, outer): a matrix multiplies a vector of ne0 into ne1
    layer_matrices = [t for name, t in tensors.items() if name.startswith("blk.") and len(t.shape) == 2
                      and min(int(d) for d in t.shape) > 1]
    cell = layers * kv_heads * (key_dim + value_dim) * kv_element_bytes(cache_type)
    types = sorted({t.tensor_type.name for t in layer_matrices})
    return WorkShape(
        weight_bytes=weights,
        matmul_params=sum(int(t.n_elements) for t in layer_matrices) + int(output.n_elements),
        output_params=int(output.n_elements),
        layers=layers, heads=heads, key_dim=key_dim, value_dim=value_dim,
        kv_bytes_per_cell=cell,
        matrices=tuple(sorted({(int(t.shape[0]), int(t.shape[1])) for t in layer_matrices})),
        output=(int(output.shape[0]), int(output.shape[1])),
        described_as=f"{'/'.join(types)} weights {weights / 1e9:.3f} GB (GGUF tensors), {cache_type} KV "
                     f"{cell:,.0f} B/token")


def kernel_step(model, rows: int, repeats: int = 3) -> tuple[float, int]:
    """(best seconds, cells each row attends) of one decode step of ``rows`` rows (``model``: a ``LlamaModel``)."""
    from .model import LlamaContext

    token = 1  # any id of the vocabulary: the cost does not depend on it
    best, cells = float("inf"), 0
    with model.lock:
        ctx = LlamaContext(model, max(256, rows * (repeats + 2)), rows, model.threads)
        try:
            ctx.decode([token] * rows, [0] * rows, list(range(rows)), [True] * rows)  # warm-up: position 0
            for step in range(1, repeats + 1):
                started = time.perf_counter()
                ctx.decode([token] * rows, [step] * rows, list(range(rows)), [True] * rows)
                elapsed = time.perf_counter() - started
                if elapsed < best:
                    best, cells = elapsed, step + 1
        finally:
            ctx.free()
    return best, cells
