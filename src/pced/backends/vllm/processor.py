"""vLLM logits processors that run PCED's group decision (``groups.py``) inside the engine.

Two adapters over the same ``apply_groups``, one per model-runner interface of vLLM 0.32:

- ``PCEDLogitsProcessor``: the V1 runner (the CPU build): ``update_state(BatchUpdate)`` tracks
  which batch row holds which group member (added / removed / moved), ``apply(logits)`` decides.
- ``PCEDLogitsProcessorV2``: Model Runner V2 (the GPU default): ``add_request(slot, params)``
  records a slot's member, ``apply(logits, ctx)`` maps rows to slots with ``ctx``.

Pass the class explicitly (``LLM(..., logits_processors=[PCEDLogitsProcessor])``), never as an
entry point. Requests without ``extra_args["pced"]`` are left untouched. Group states live in
``GROUPS`` of this process (the engine must run in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
for the caller to read the trace); the caller removes a group's state when it has read it.
"""

from __future__ import annotations

import torch

from .groups import GroupMember, GroupState, Row, apply_groups

GROUPS: dict[str, GroupState] = {}

try:  # the base classes only exist where vLLM is installed; the logic below needs none of them
    from vllm.v1.sample.logits_processor import LogitsProcessor as _V1Base
except ImportError:  # pragma: no cover - exercised where vLLM is absent
    _V1Base = object
try:
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as _V2Base
except ImportError:  # pragma: no cover
    _V2Base = object


def check_params(sampling_params) -> GroupMember | None:
    """The request's group member, after refusing what PCED cannot honour on an engine."""
    member = GroupMember.from_args(getattr(sampling_params, "extra_args", None))
    if member is None:
        return None
    if getattr(sampling_params, "temperature", 0.0) > 1e-5:
        raise ValueError("pced on vLLM decodes greedily: sampling (temperature > 0) is not supported for PCED requests")
    penalties = (getattr(sampling_params, "repetition_penalty", 1.0) != 1.0,
                 getattr(sampling_params, "presence_penalty", 0.0) != 0.0,
                 getattr(sampling_params, "frequency_penalty", 0.0) != 0.0)
    if any(penalties):
        raise ValueError("penalties change each row's logits before the PCED rule; they are refused on PCED requests")
    return member


class PCEDLogitsProcessor(_V1Base):
    """vLLM V1 runner interface."""

    def __init__(self, vllm_config=None, device=None, is_pin_memory: bool = False):
        if vllm_config is not None and getattr(vllm_config, "speculative_config", None):
            raise ValueError("pced is refused with speculative decoding: drafted tokens bypass the group decision")
        self.rows: dict[int, tuple[GroupMember, list[int]]] = {}  # batch index -> (member, its output token ids)

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        check_params(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax

    def update_state(self, batch_update) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _prompt, output_ids in batch_update.added:
            member = check_params(params)
            if member is None:
                self.rows.pop(index, None)
            else:
                self.rows[index] = (member, output_ids)
        for first, second, direction in batch_update.moved:
            a, b = self.rows.pop(first, None), self.rows.pop(second, None)
            if a is not None:
                self.rows[second] = a
            if b is not None and getattr(direction, "name", "") == "SWAP":
                self.rows[first] = b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        rows = [Row(index, member, len(output)) for index, (member, output) in self.rows.items()]
        return apply_groups(logits, rows, GROUPS)


class PCEDLogitsProcessorV2(_V2Base):
    """Model Runner V2 interface: per-slot state, rows mapped to slots by the step's context."""

    def __init__(self, vllm_config=None, req_states=None):
        self.req_states = req_states
        self.slots: dict[int, GroupMember] = {}

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        check_params(sampling_params)

    def add_request(self, req_idx: int, sampling_params) -> bool:
        member = check_params(sampling_params)
        if member is None:
            self.slots.pop(req_idx, None)
            return False
        self.slots[req_idx] = member
        return True

    def apply(self, logits: torch.Tensor, ctx) -> torch.Tensor:
        if not self.slots:
            return logits
        slots = ctx.expanded_idx_mapping.tolist()
        positions = ctx.pos.tolist()  # a row's position = tokens so far - 1
        prompt_len = self.req_states.prompt_len.np
        rows = [Row(index, self.slots[slot], positions[index] + 1 - int(prompt_len[slot]))
                for index, slot in enumerate(slots) if slot in self.slots]
        return apply_groups(logits, rows, GROUPS) if rows else logits
