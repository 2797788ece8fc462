"""Wall-clock readings that mean the work is done: CUDA launches return before the kernels run, so
a GPU timing read without synchronising measures the launches (``torch.cuda.synchronize``)."""

from __future__ import annotations

import time

import torch


def synchronized_time(device: torch.device | str) -> float:
    """``time.perf_counter()`` once the work queued on ``device`` has finished (CUDA: after a
    synchronize; a CPU computes eagerly, so nothing to wait for)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
