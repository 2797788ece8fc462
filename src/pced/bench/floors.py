"""The floors of a decode step and of the time to first token: the bytes and FLOPs a backend must
move, over what this machine moves and computes (``pced.bench.machine``). No implementation of the
same work on the same machine can be faster; ``pced bench`` prints measured / floor.

A backend describes itself with a ``WorkShape`` (``Backend.work_shape``: what one token costs it
as it runs); a run is its rows, each a ``RowSpan``: the cells it starts from (prefix, its
document) and the tokens it prefills (the question suffix). Notation:

    W      bytes of weights a decode step reads, as the backend holds them (transformers on a CPU:
           fp32; llama.cpp: the GGUF's tensors as shipped). The input embedding is only looked up,
           so it is left out unless it is tied to the output layer
    P      weights multiplied per token: every linear map of every layer, and the output layer
    P_out  of which the output layer's (a prefill needs logits at each row's last token only)
    L, H   layers, query heads (GQA shares keys and values between heads, not the FLOPs)
    d_k, d_v   key and value width per head
    c      bytes of keys and values one cell holds across all layers, in the running cache's type
           (transformers: its buffer's dtype; llama.cpp: f16 or q8_0)
    R      rows; row r starts from s_r cells and prefills n_r tokens
    N      new tokens per answer; the bench's decode time is the mean over steps 1..N-1, and at step
           j row r attends a_r = s_r + n_r + j cells (its new token's included): on average
           a_r = s_r + n_r + N/2
    S      stored bytes of the k documents' caches (their files)
    B, F, C    memory bandwidth, GEMM peak, page-cache read rate (the machine's limits)

Decode step::

    bytes  = W + c · Σ_r a_r
    FLOPs  = 2 · P · R + 2 · L · H · (d_k + d_v) · Σ_r a_r
    floor  = max(bytes / B, FLOPs / F)

Time to first token::

    bytes  = W + c · Σ_r (s_r + n_r)
    FLOPs  = 2 · (P - P_out) · Σ_r n_r + 2 · P_out · R + 2 · L · H · (d_k + d_v) · Σ_r (n_r · s_r + n_r (n_r + 1) / 2)
    floor  = S / C + max(bytes / B, FLOPs / F)

Attention costs 2 · d_k FLOPs per head and attended cell for the scores and 2 · d_v for the
weighted values; a prefilled token i (from 0) of row r attends s_r + i + 1 cells. The caches' read
and the prefill add instead of overlapping: the suffix attends to the caches, and on a CPU the same
cores copy and compute. F is the best GEMM rate at the run's own shapes (every distinct weight
matrix at R rows for decode and at Σ n_r rows for the prefill, the output layer at R rows), in
fp32 on a CPU also for llama.cpp, whose quantized kernels' rate is reported beside, not used:
the floor is what this machine's arithmetic allows, not what one kernel achieves.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from ..backend import WorkShape  # a backend's description of itself (Backend.work_shape)


@dataclass(frozen=True)
class RowSpan:
    start: int  # s_r: cells before the prefill
    prefill: int  # n_r: tokens prefilled (the question suffix)


@dataclass(frozen=True)
class Floor:
    floor_s: float
    bytes: float
    flops: float
    memory_s: float  # bytes / B
    compute_s: float  # FLOPs / F
    read_bytes: float = 0.0  # S (time to first token)
    read_s: float = 0.0  # S / C

    @property
    def bound(self) -> str:
        """The binding term of max(bytes / B, FLOPs / F)."""
        return "compute" if self.compute_s >= self.memory_s else "memory"

    def to_json(self) -> dict:
        return {**asdict(self), "bound": self.bound}


def attention_flops(shape: WorkShape, cells: float) -> float:
    return 2 * shape.layers * shape.heads * (shape.key_dim + shape.value_dim) * cells


def decode_attended(spans: Sequence[RowSpan], new_tokens: int) -> list[float]:
    """a_r averaged over the timed decode steps 1..N-1."""
    return [s.start + s.prefill + new_tokens / 2 for s in spans]


def decode_work(shape: WorkShape, attended: Sequence[float]) -> tuple[float, float]:
    """(bytes, FLOPs) of one decode step whose rows attend ``attended`` cells each."""
    cells = float(sum(attended))
    return (shape.weight_bytes + shape.kv_bytes_per_cell * cells,
            2 * shape.matmul_params * len(attended) + attention_flops(shape, cells))


def prefill_work(shape: WorkShape, spans: Sequence[RowSpan]) -> tuple[float, float]:
    """(bytes, FLOPs) of the prefill of every row's tokens, logits at each row's last token only."""
    tokens = sum(s.prefill for s in spans)
    pairs = sum(s.prefill * s.start + s.prefill * (s.prefill + 1) / 2 for s in spans)
    flops = (2 * (shape.matmul_params - shape.output_params) * tokens + 2 * shape.output_params * len(spans)
             + attention_flops(shape, pairs))
    return shape.weight_bytes + shape.kv_bytes_per_cell * sum(s.start + s.prefill for s in spans), flops


def _floor(work: tuple[float, float], bandwidth: float, peak: float, read_bytes: float = 0.0,
           read_rate: float = float("inf")) -> Floor:
    data, flops = work
    memory_s, compute_s = data / bandwidth, flops / peak
    read_s = read_bytes / read_rate if read_bytes else 0.0
    return Floor(read_s + max(memory_s, compute_s), data, flops, memory_s, compute_s, read_bytes, read_s)


def decode_floor(shape: WorkShape, attended: Sequence[float], bandwidth: float, peak: float) -> Floor:
    return _floor(decode_work(shape, attended), bandwidth, peak)


def ttft_floor(shape: WorkShape, spans: Sequence[RowSpan], cache_bytes: float, bandwidth: float, peak: float,
               page_cache: float) -> Floor:
    """``cache_bytes``: S, read at ``page_cache`` bytes/s (0 where the caches are already in place)."""
    return _floor(prefill_work(shape, spans), bandwidth, peak, cache_bytes, page_cache)


def gemm_shapes(shape: WorkShape, spans: Sequence[RowSpan]) -> list[tuple[int, int, int]]:
    """(rows, inner, outer) of the run's GEMMs, whose best rate is F: decode and prefill."""
    rows, tokens = len(spans), sum(s.prefill for s in spans)
    shapes = {(rows, *shape.output)}
    for inner, outer in shape.matrices:
        shapes |= {(rows, inner, outer), (tokens, inner, outer)}
    return sorted(shapes)
