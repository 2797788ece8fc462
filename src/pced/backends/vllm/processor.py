"""vLLM logits processors that run PCED's group decision (``groups.py``) inside the engine.

Two adapters over the same ``apply_groups``, one per model-runner interface of vLLM 0.32:

- ``PCEDLogitsProcessor``: the V1 runner (the CPU build): ``update_state(BatchUpdate)`` tracks
  which batch row holds which group member (added / removed / moved), ``apply(logits)`` decides.
- ``PCEDLogitsProcessorV2``: Model Runner V2 (the GPU default where Triton is present):
  ``add_request(slot, params)`` records a slot's member, ``apply(logits, ctx)`` maps rows to slots
  with the step's host-side arrays (``ctx.idx_mapping_np``, ``ctx.seq_lens_upper_bound_np``), so the
  step reads nothing back from the device but the rule's choice.

vLLM builds the processors itself from classes; ``processor_class(groups, v2)`` makes the class
for one engine, bound to that engine's ``GroupRegistry`` (no process-wide state): the engine asks
vLLM which runner it will use and passes that class. Requests without ``extra_args["pced"]`` are
left untouched, and so are the rows of groups that are not open.
"""

from __future__ import annotations

import torch

from .groups import GroupMember, GroupRegistry, Row, apply_groups

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


def check_config(vllm_config) -> None:
    if vllm_config is not None and getattr(vllm_config, "speculative_config", None):
        raise ValueError("pced is refused with speculative decoding: drafted tokens bypass the group decision")


class PCEDLogitsProcessor(_V1Base):
    """vLLM V1 runner interface (``groups``: the engine's registry, set by ``processor_class``)."""

    groups: GroupRegistry

    def __init__(self, vllm_config=None, device=None, is_pin_memory: bool = False):
        check_config(vllm_config)
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
        return apply_groups(logits, rows, self.groups)


class PCEDLogitsProcessorV2(_V2Base):
    """Model Runner V2 interface: per-slot state, rows mapped to slots by the step's context.
    Speculative decoding is refused, so a row is a request: row i = batch position i."""

    groups: GroupRegistry

    def __init__(self, vllm_config=None, req_states=None):
        check_config(vllm_config)
        self.prompt_len = req_states.prompt_len.np  # host copy of every slot's prompt length (vLLM keeps it)
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
        # host arrays: batch position -> slot, and tokens visible to the token sampled now (exact
        # without speculative decoding) = prompt + generated; nothing here reads the device
        slots, seen = ctx.idx_mapping_np.tolist(), ctx.seq_lens_upper_bound_np.tolist()
        rows = [Row(index, self.slots[slot], int(seen[index]) - int(self.prompt_len[slot]))
                for index, slot in enumerate(slots) if slot in self.slots]
        rows = [row for row in rows if row.generated >= 0]  # a prompt still prefilling has no next token yet
        return apply_groups(logits, rows, self.groups) if rows else logits


def processor_class(groups: GroupRegistry, v2: bool) -> type:
    """The logits-processor class to hand one engine's ``LLM(logits_processors=[...])``: the V2
    interface when vLLM will run Model Runner V2, bound to the engine's group registry."""
    base = PCEDLogitsProcessorV2 if v2 else PCEDLogitsProcessor
    return type(base.__name__, (base,), {"groups": groups, "__module__": base.__module__})
