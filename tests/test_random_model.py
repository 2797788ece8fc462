"""A random model is built in its target dtype: no float32 copy of its weights is ever allocated."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pced.bench.random_model import random_model

pytestmark = pytest.mark.transformers_api  # models and attention transformers builds


class Float32Bytes(TorchDispatchMode):
    """Bytes of every float32 tensor an operation produces."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32 and tensor.device.type != "meta":
                self.bytes += tensor.numel() * 4
        return out


def test_a_bfloat16_random_model_never_holds_float32_weights():
    with Float32Bytes() as counted:
        llm = random_model("tiny", device="cpu", dtype="bfloat16")
    weights = sum(p.numel() for p in llm.model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in llm.model.parameters())
    assert counted.bytes < 0.05 * weights * 4  # the rotary frequencies only, not a float32 model
