"""The memory tiers a document cache passes through on its way into a batch buffer.

    disk (safetensors, memory-mapped)  ->  host page cache  ->  [pinned staging]  ->  device pool  ->  buffer

``CacheTiers`` says how the upper two are used; ``DevicePool`` is the device tier: dense caches
(dequantized, in the model's dtype) kept on the model's device under a byte budget, least
recently used first out. A document asked about again is then copied device-to-device into the
batch buffer instead of crossing the host link again. On a CUDA device the copies from the host
go through ``PinnedStaging`` (page-locked buffers, non-blocking) whether or not a budget is set.
On a CPU model a pool keeps dequantized copies in RAM (worth it for int8 stores only; off by default).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

import torch

from .segment import DocKV, PinnedStaging

from .tier_settings import GIB, CacheTiers  # noqa: F401 (the settings; re-exported)


def device_pool(tiers: CacheTiers, device: torch.device | str, dtype: torch.dtype) -> "DevicePool | None":
    """The device tier ``tiers`` asks for a model on ``device``, or None where caches go straight from
    the mapping to the buffer (a CPU model without a budget: today's zero-copy path)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    budget = tiers.budget_bytes(device)
    if budget == 0 and not cuda:
        return None
    staging = PinnedStaging() if cuda and tiers.pinned_staging else None
    return DevicePool(device, dtype, budget, staging)


class DevicePool:
    """Dense caches on one device under ``budget`` bytes, least recently used evicted first.

    ``get(key, read)`` returns the cache of ``key`` on the device, reading it with ``read()`` (a
    memory-mapped ``DocKV``, possibly int8) on a miss. A cache larger than the whole budget is
    returned without being kept. Thread-safe: the server's threads share one pool; misses of
    different caches read and verify their files at the same time (only the pinned staging's copy
    is one at a time, under its own lock), and threads missing the same cache wait for one read.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, budget: int, staging: PinnedStaging | None = None):
        self.device, self.dtype, self.budget, self.staging = torch.device(device), dtype, int(budget), staging
        self._entries: OrderedDict[str, DocKV] = OrderedDict()
        self._lock = threading.Lock()  # the table and counters: held for dictionary work only
        self._loading: dict[str, threading.Lock] = {}  # one per cache being read: its readers wait for one read
        self.bytes = 0
        self.counters = {"hits": 0, "misses": 0, "evictions": 0, "bytes_from_host": 0}

    def _hit(self, key: str) -> DocKV | None:
        with self._lock:
            kv = self._entries.get(key)
            if kv is not None:
                self._entries.move_to_end(key)
                self.counters["hits"] += 1
            return kv

    def get(self, key: str, read: Callable[[], DocKV]) -> DocKV:
        """A resident cache never waits behind another thread's disk read: the table's lock is not
        held while a miss reads and copies."""
        kv = self._hit(key)
        if kv is not None:
            return kv
        with self._lock:
            loading = self._loading.setdefault(key, threading.Lock())
        with loading:
            kv = self._hit(key)  # loaded by another thread while this one waited
            if kv is not None:
                return kv
            try:
                stored = read()
                return self._keep(key, stored, stored.dense(self.device, self.dtype, self.staging))
            finally:
                with self._lock:
                    self._loading.pop(key, None)

    def _keep(self, key: str, stored: DocKV, kv: DocKV) -> DocKV:
        with self._lock:
            self.counters["misses"] += 1
            self.counters["bytes_from_host"] += stored.nbytes
            size = kv.nbytes
            if 0 < size <= self.budget:
                self._entries[key] = kv
                self.bytes += size
                while self.bytes > self.budget:
                    _, old = self._entries.popitem(last=False)
                    self.bytes -= old.nbytes
                    self.counters["evictions"] += 1
            return kv

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict:
        """For /health and the bench: budget, bytes held, entries and counters."""
        return {"device": str(self.device), "budget_bytes": self.budget, "bytes": self.bytes,
                "entries": len(self._entries), "pinned_staging": self.staging is not None, **self.counters}


__all__ = ["CacheTiers", "DevicePool", "GIB", "device_pool"]
