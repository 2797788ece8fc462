"""``CacheTiers``: where document caches live between questions (the settings of ``pced.kv.tiers``,
apart from its torch code, so that the command line reads the defaults without loading torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import UserError

GIB = 1 << 30


@dataclass(frozen=True)
class CacheTiers:
    """Where document caches live between questions. Defaults written once, here."""

    gpu_cache_gb: float | None = None  # device-resident pool (GiB of dense caches, LRU); 0 = none; None: by device
    pinned_staging: bool = True  # CUDA: host-to-device copies through pinned buffers
    # gpu_cache_gb None: none on a CPU model; on CUDA this share of the device memory free when the
    # store opens (after the model's weights): an 8B bf16 model on an 80 GB GPU gets ~12 GiB, ~48
    # documents of 2048 tokens kept resident
    cuda_free_share: float = 0.2

    def __post_init__(self) -> None:
        if self.gpu_cache_gb is not None and (not math.isfinite(self.gpu_cache_gb) or self.gpu_cache_gb < 0):
            raise UserError(f"gpu_cache_gb must be a finite number >= 0, got {self.gpu_cache_gb!r}")
        if not 0 <= self.cuda_free_share < 1:
            raise UserError(f"cuda_free_share must be in [0, 1), got {self.cuda_free_share!r}")

    def budget_bytes(self, device) -> int:
        """The pool's budget on ``device`` (a ``torch.device``): the setting, or by device where it is None."""
        import torch

        if self.gpu_cache_gb is not None:
            return int(self.gpu_cache_gb * GIB)
        if device.type != "cuda":
            return 0
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * self.cuda_free_share)
