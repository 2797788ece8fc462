"""GPU timings wait for the work they time: ``synchronized_time`` synchronises a CUDA device."""

import pytest
import torch

from pced.backends.clock import synchronized_time


def test_cuda_devices_are_synchronised_and_cpus_are_not(monkeypatch):
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    first = synchronized_time("cpu")
    assert synced == []
    second = synchronized_time("cuda:0")
    assert synced == [torch.device("cuda:0")] and second >= first


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_timing_covers_the_kernel_not_its_launch():
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    started = synchronized_time(a.device)
    for _ in range(20):
        a = a @ a / 64
    elapsed = synchronized_time(a.device) - started
    assert torch.cuda.current_stream().query() and elapsed > 0  # nothing was left queued when the clock was read
