"""The worker side of pced's connector: one step's loads from the store into vLLM's paged KV cache,
layer by layer, through each attention layer's own writer.

vLLM runs a step's synchronous loads before its forward (``v1/worker/kv_connector_model_runner_mixin.py:79-90``,
``v1/worker/gpu/kv_connector.py:87-89``) and asks for each layer just before that layer's attention
(``wait_for_layer_load``, from ``unified_attention_with_output``'s wrapper:
``model_executor/layers/attention/kv_transfer_utils.py:45-51``, ``attention.py:765-767``). So on a
GPU a load is queued, not waited for: a thread of the loader copies each layer's stored bytes from
the memory-mapped files into a pinned host buffer (two of them, in turn), then queues on a stream of
its own the host-to-device copy (non-blocking), the dequantization of an int8 cache (on the device,
so the link carries one byte a value), the turn to ``[tokens, heads, head_dim]`` in the model's
dtype, and the layer's writer; then it records an event. ``wait_for_layer_load`` makes the forward's
stream wait for that event, without the host waiting: layer l's attention runs while layer l + 1 is
read and copied. The loader's stream first waits for the forward's stream, which has zeroed the
step's new blocks (``v1/worker/gpu_model_runner.py:1199-1202``).

On a CPU the same steps run in ``start`` itself, in order, with no thread, stream or staging: the
"copy to the device" is the memory-mapped slice.

Asynchronous loads (``load_kv_async`` with ``get_finished``) were not chosen: vLLM then parks the
request (``WAITING_FOR_REMOTE_KVS``) and schedules it in a later step (``v1/core/sched/scheduler.py:1319-1341``),
a step of latency for every question, where the layer pipeline overlaps the copy with the forward
of the same step.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

from .kv_layout import Chunk, check_writer_rows, rows_of, stored_parts

log = logging.getLogger("pced.vllm")
ALIGN = 64  # bytes: every staged tensor starts on a boundary any dtype's view accepts


@dataclass
class LayerSlot:
    """One attention layer the loader writes: its index in the stored caches, and its KV cache group."""

    index: int
    name: str
    layer: Any
    group: int = 0


@dataclass
class Job:
    """One step's loads: every layer gets the chunks in order, then one writer call per layer."""

    chunks: list[Chunk]
    slots: list[torch.Tensor]  # one flat slot per token, per KV cache group (-1: not stored)
    blocks: set[int]  # every block the loads write: all of them failed if the job fails


class PinnedRing:
    """Two page-locked host buffers used in turn; one is refilled only after the copy that read it
    finished (its event), so the thread waits, never the forward."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.events: list[Any] = [None, None]
        self.turn = 0

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        turn, self.turn = self.turn, 1 - self.turn
        if self.events[turn] is not None:
            self.events[turn].synchronize()
        if self.buffers[turn] is None or self.buffers[turn].numel() < nbytes:
            self.buffers[turn] = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
        return turn, self.buffers[turn]


class StoreLoader:
    """Loads into the layers of one worker (its tensor-parallel rank's ``heads``), in model ``dtype``."""

    def __init__(self, layers: list[LayerSlot], heads: slice, dtype: torch.dtype) -> None:
        self.layers, self.heads, self.dtype = layers, heads, dtype
        self.device = layers[0].layer.kv_cache.device if layers else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.ring = PinnedRing() if self.cuda else None
        self.bytes_to_device = 0  # stored bytes that crossed to the device (or would, on a CPU)
        self._ready: dict[str, tuple[threading.Event, Any]] = {}
        self._thread: threading.Thread | None = None
        self._failed: set[int] = set()
        self._lock = threading.Lock()

    # -- the step ----------------------------------------------------------------------------
    def start(self, job: Job) -> None:
        self._join()  # a previous step's thread, if a layer was never waited for
        if not self.cuda:
            self._run(job)
            return
        self._ready = {slot.name: (threading.Event(), torch.cuda.Event()) for slot in self.layers}
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # after the new blocks were zeroed
        with torch.cuda.stream(self.stream):
            job.slots = [s.pin_memory().to(self.device, non_blocking=True) for s in job.slots]
        self._thread = threading.Thread(target=self._run, args=(job,), name="pced-store-load", daemon=True)
        self._thread.start()

    def wait(self, name: str) -> None:
        """The forward's stream waits until ``name``'s rows are written; the host does not."""
        ready = self._ready.get(name)
        if ready is None:
            return
        ready[0].wait()
        torch.cuda.current_stream(self.device).wait_event(ready[1])

    def finish(self) -> set[int]:
        """End the step (vLLM asks for failed blocks after its forward): the blocks of loads that failed."""
        self._join()
        with self._lock:
            failed, self._failed = self._failed, set()
        return failed

    def _join(self) -> None:
        """Every queued write ordered before whatever the forward's stream runs next."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            for _, event in self._ready.values():
                torch.cuda.current_stream(self.device).wait_event(event)
            self._ready = {}

    # -- one layer at a time ---------------------------------------------------------------------
    def _run(self, job: Job) -> None:
        done = 0
        try:
            with contextlib.ExitStack() as scope:
                if self.cuda:  # a new thread starts on device 0 and its default stream
                    scope.enter_context(torch.cuda.device(self.device))
                    scope.enter_context(torch.cuda.stream(self.stream))
                for done, slot in enumerate(self.layers):
                    self._load_layer(job, slot)
                    if self.cuda:
                        ready, event = self._ready[slot.name]
                        event.record(self.stream)
                        ready.set()
                done = len(self.layers)
        except Exception as exc:  # a file gone or damaged mid-load: vLLM recomputes those tokens
            log.warning("pced store connector: loading failed (%s); vLLM recomputes these tokens", exc)
            with self._lock:
                self._failed.update(job.blocks)
        finally:
            for slot in self.layers[done:]:
                if slot.name in self._ready:
                    ready, event = self._ready[slot.name]
                    event.record(self.stream)
                    ready.set()

    def _load_layer(self, job: Job, slot: LayerSlot) -> None:
        parts = [stored_parts(chunk, slot.index, self.heads) for chunk in job.chunks]
        flat = [t for chunk in parts for t in chunk]
        self.bytes_to_device += sum(t.numel() * t.element_size() for t in flat)
        if self.cuda:
            flat = self._to_device(flat)
        rows, at = [], 0
        for own in parts:
            rows.append(rows_of(flat[at:at + len(own)], self.dtype))
            at += len(own)
        keys = torch.cat([k for k, _ in rows]) if len(rows) > 1 else rows[0][0]
        values = torch.cat([v for _, v in rows]) if len(rows) > 1 else rows[0][1]
        layer, slots = slot.layer, job.slots[slot.group]
        check_writer_rows(keys, values, len(slots), layer.impl.num_kv_heads, layer.impl.head_size)
        layer.impl.do_kv_cache_update(layer, keys, values, layer.kv_cache, slots)

    def _to_device(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors through one pinned buffer and one non-blocking copy; views of the device copy."""
        turn, buffer = self.ring.take(staged_size(tensors))
        offsets = stage_into(tensors, buffer)
        size = staged_size(tensors)
        device = torch.empty(size, dtype=torch.uint8, device=self.device)
        device.copy_(buffer[:size], non_blocking=True)
        event = torch.cuda.Event()
        event.record(self.stream)
        self.ring.events[turn] = event
        return [device[at:at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                for t, at in zip(tensors, offsets)]


def staged_size(tensors: list[torch.Tensor]) -> int:
    return sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors)


def stage_into(tensors: list[torch.Tensor], buffer: torch.Tensor) -> list[int]:
    """Copy the tensors (views of the mapped files) one after the other into ``buffer`` (uint8), each
    aligned; their offsets. This is the host's share of a load on a GPU: one pass over the bytes."""
    offsets, at = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        buffer[at:at + nbytes].view(t.dtype).view(t.shape).copy_(t)
        offsets.append(at)
        at += -(-nbytes // ALIGN) * ALIGN
    return offsets
