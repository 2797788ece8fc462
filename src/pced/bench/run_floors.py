"""One bench run's floors: the machine's limits, the GEMM peak at the run's own shapes, and the
floor and measured / floor of each time the bench reports (what its JSON, tables and plots read).

A backend enters as a ``WorkShape`` and each timed configuration as its rows (``method_spans``), so
the run needs to know nothing of how a backend works.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from .floors import Floor, RowSpan, WorkShape, decode_attended, decode_floor, gemm_shapes, ttft_floor
from .machine import MachineLimits, describe, gemm_name, machine_limits


def method_spans(builder, method: str, doc_lengths: Sequence[int], question: str) -> list[RowSpan]:
    """The rows of ``method`` over documents of ``doc_lengths`` cached tokens (``builder``: the run's
    ``PromptBuilder``). PCED: the amateur (prefix, then the question without a context separator) and
    one row per document; APE: one row over every cached document; ``all``: one row prefilling it all."""
    prefix, suffix = len(builder.prefix_ids), len(builder.suffix_ids(question))
    if method == "pced":
        return [RowSpan(prefix, len(builder.suffix_ids(question, with_context=False)))] + \
            [RowSpan(prefix + n, suffix) for n in doc_lengths]
    if method == "ape":
        return [RowSpan(prefix + sum(doc_lengths), suffix)]
    return [RowSpan(0, prefix + sum(doc_lengths) + suffix)]


def ratio(measured: float | None, floor: float | None) -> float | None:
    if measured is None or floor is None or measured != measured or not floor:
        return None
    return measured / floor


@dataclass
class RunFloors:
    limits: MachineLimits
    gemm_names: list[str]  # the run's GEMM shapes, whose best rate is the peak
    peak: float
    peak_name: str
    shapes: list[WorkShape]  # the run's backends' work, as measured for

    @classmethod
    def measure(cls, runs: Iterable[tuple[WorkShape, Sequence[RowSpan]]], device: str | torch.device = "cpu",
                remeasure: bool = False, threads: int | None = None) -> "RunFloors":
        """The limits for ``runs`` (each a backend's shape and one configuration's rows): cached, or
        measured once, GEMMs at every shape the runs multiply (in each shape's dtype); with
        ``threads`` torch threads where given (an engine computing in processes of its own:
        ``Backend.bench_threads``), this process's otherwise."""
        own = torch.get_num_threads()
        torch.set_num_threads(threads or own)
        try:
            return cls._measure(runs, device, remeasure)
        finally:
            torch.set_num_threads(own)

    @classmethod
    def _measure(cls, runs: Iterable[tuple[WorkShape, Sequence[RowSpan]]], device: str | torch.device,
                 remeasure: bool) -> "RunFloors":
        by_dtype: dict[str, set] = {}
        shapes: list[WorkShape] = []
        for shape, spans in runs:
            by_dtype.setdefault(shape.gemm_dtype, set()).update(gemm_shapes(shape, spans))
            if shape not in shapes:
                shapes.append(shape)
        limits, names = None, []
        for dtype, gemms in sorted(by_dtype.items()):
            torch_dtype = getattr(torch, dtype)
            limits = machine_limits(device, sorted(gemms), torch_dtype, remeasure=remeasure and limits is None)
            names += [gemm_name(torch_dtype, *g) for g in sorted(gemms)]
        if limits is None:
            limits = machine_limits(device, remeasure=remeasure)
        peak, peak_name = limits.gemm_peak(names)
        return cls(limits, names, peak, peak_name, shapes)

    def header(self) -> str:
        return describe(self.limits, self.gemm_names)

    def to_json(self) -> dict:
        return {"machine": self.limits.to_json(), "gemm_peak_flop_s": self.peak, "gemm_peak_shape": self.peak_name,
                "gemm_rates_flop_s": {n: self.limits.gemm[n] for n in self.gemm_names},
                "page_cache_b_s": self.limits.page_cache, "memory_bandwidth_b_s": self.limits.memory_bandwidth}

    def decode(self, shape: WorkShape, spans: Sequence[RowSpan], new_tokens: int) -> Floor:
        return decode_floor(shape, decode_attended(spans, new_tokens), self.limits.memory_bandwidth, self.peak)

    def ttft(self, shape: WorkShape, spans: Sequence[RowSpan], cache_bytes: float) -> Floor:
        return ttft_floor(shape, spans, cache_bytes, self.limits.memory_bandwidth, self.peak, self.limits.page_cache)

    def annotate(self, summary: dict, shape: WorkShape, spans: Sequence[RowSpan], new_tokens: int,
                 cache_bytes: float, resident: bool = False) -> dict:
        """Add the floors of one timed configuration to its ``summary`` (``ttft_s``, ``decode_per_token_s``
        and, with ``resident``, ``ttft_resident_s``: caches already in place, nothing to read)."""
        decode, ttft = self.decode(shape, spans, new_tokens), self.ttft(shape, spans, cache_bytes)
        summary.update(decode_floor_s=decode.floor_s, decode_bandwidth_floor_s=decode.memory_s,
                       decode_vs_floor=ratio(summary.get("decode_per_token_s"), decode.floor_s),
                       ttft_floor_s=ttft.floor_s, ttft_vs_floor=ratio(summary.get("ttft_s"), ttft.floor_s))
        floors = {"decode": decode.to_json(), "ttft": ttft.to_json()}
        if resident:
            in_place = self.ttft(shape, spans, 0.0)
            summary.update(ttft_resident_floor_s=in_place.floor_s,
                           ttft_resident_vs_floor=ratio(summary.get("ttft_resident_s"), in_place.floor_s))
            floors["ttft_resident"] = in_place.to_json()
        summary["floors"] = floors
        return summary


def with_floor(value: float | None, floor: float | None, scale: float = 1.0, digits: int = 3) -> str:
    """"0.106 [0.031, 3.4x]": a measured time, its floor and measured / floor (``scale``: 1000 for ms)."""
    if value is None or value != value:
        return "n/a"
    text = f"{value * scale:.{digits}f}"
    if floor:
        text += f" [{floor * scale:.{digits}f}, {value / floor:.1f}x]"
    return text
