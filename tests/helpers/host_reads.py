"""Count the reads from the device to the host during decoding, on a CPU.

On a CPU every tensor is already on the host, so a read cannot be seen as a copy: it is counted by
what a GPU would have to wait for. At the Python level (``TorchFunctionMode``): ``.tolist()``,
``.item()``, ``bool()``/``int()``/``float()``/``__index__`` of a tensor, ``.numpy()``, ``.cpu()``,
``nonzero``. Below it (``TorchDispatchMode``, for reads the Python level does not see, such as
indexing with a 0-d tensor): ``aten._local_scalar_dense``, ``aten.nonzero``, ``aten.is_nonzero``,
``aten.equal``, and any copy to the CPU from another device. A read counted at the Python level is
not counted again for the ops it dispatches.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

READ_METHODS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
                torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu,
                torch.Tensor.nonzero, torch.nonzero}
READ_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
            torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default}


class HostReads:
    """``with HostReads() as reads: ...``; ``reads.count`` and ``reads.events`` (names, in order)."""

    def __init__(self):
        self.events: list[str] = []
        self._depth = 0
        counter = self

        class Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func in READ_METHODS and counter._depth == 0:
                    counter.events.append(getattr(func, "__name__", str(func)))
                    counter._depth += 1
                    try:
                        return func(*args, **(kwargs or {}))
                    finally:
                        counter._depth -= 1
                return func(*args, **(kwargs or {}))

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if counter._depth == 0:
                    if func in READ_OPS:
                        counter.events.append(str(func))
                    elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
                        source = args[1] if func is torch.ops.aten.copy_.default else args[0]
                        target = args[0].device if func is torch.ops.aten.copy_.default else kwargs.get("device")
                        if target is not None and torch.device(target).type == "cpu" and source.device.type != "cpu":
                            counter.events.append(str(func))
                return func(*args, **kwargs)

        self._modes = (Functions(), Ops())

    @property
    def count(self) -> int:
        return len(self.events)

    def __enter__(self) -> "HostReads":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def reads_per_step(generation) -> list[list[str]]:
    """Iterate ``generation``; the reads between one streamed step and the next (the model's forward
    for the previous token, the rule, the processors, the draw, the packet): one list per step after
    the first (whose list would also hold the prefill)."""
    per_step, seen = [], 0
    with HostReads() as reads:
        for _ in generation:
            per_step.append(reads.events[seen:])
            seen = reads.count
    return per_step[1:]
