"""vLLM logits processors that run PCED's group decision (``groups.py``) inside the engine.

Two adapters over the same ``apply_groups``, one per model-runner interface of vLLM 0.32:

- ``PCEDLogitsProcessor``: the V1 runner (the CPU build): ``update_state(BatchUpdate)`` tracks
  which batch row holds which group member (added / removed / moved), ``apply(logits)`` decides.
- ``PCEDLogitsProcessorV2``: Model Runner V2 (the GPU default where Triton is present):
  ``add_request(slot, params)`` records a slot's member, ``apply(logits, ctx)`` maps rows to slots
  with the step's host-side arrays (``ctx.idx_mapping_np``, ``ctx.seq_lens_upper_bound_np``).

Both are self-contained: vLLM builds them inside its worker processes (one per rank with tensor
parallelism), and everything they know comes from each request's ``extra_args`` and the step's own
inputs; each keeps its own ``GroupTable``. With tensor parallelism every rank samples the whole
batch from the same logits (gathered to every rank: ``model_executor/layers/logits_processor.py:
124-133``, ``use_all_gather`` is True on every platform but a few: ``platforms/interface.py:
1267-1269``) and feeds its own sampled tokens to its next step (no broadcast of them in
``v1/worker/gpu_model_runner.py``), so each rank's processor makes the same decision from the same
numbers, as vLLM's own greedy sampler does. The trace reaches pced through the carriers
(``channel``), read off rank 0's output (``v1/executor/multiproc_executor.py:548-562``).
Requests without ``extra_args["pced"]`` are left untouched.
"""

from __future__ import annotations

import torch

from .groups import GroupMember, GroupTable, Row, apply_groups

try:  # the base classes only exist where vLLM is installed; the logic below needs none of them
    from vllm.v1.sample.logits_processor import LogitsProcessor as _V1Base
except ImportError:  # pragma: no cover - exercised where vLLM is absent
    _V1Base = object
try:
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as _V2Base
except ImportError:  # pragma: no cover
    _V2Base = object

LOGPROBS_MODE = "processed_logits"  # the engine setting that returns the carriers (channel.py)


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
    if getattr(sampling_params, "logprobs", 0) != 0:
        raise ValueError("pced requests ask logprobs=0: the trace rides on the chosen token's processed logit")
    return member


def check_config(vllm_config) -> None:
    if vllm_config is None:
        return
    if getattr(vllm_config, "speculative_config", None):
        raise ValueError("pced is refused with speculative decoding: drafted tokens bypass the group decision")
    mode = getattr(getattr(vllm_config, "model_config", None), "logprobs_mode", LOGPROBS_MODE)
    if mode != LOGPROBS_MODE:
        raise ValueError(f"pced needs logprobs_mode={LOGPROBS_MODE!r} (the trace rides on the processed logits), got {mode!r}")
    if getattr(getattr(vllm_config, "parallel_config", None), "enable_batch_sharded_sampling", False):
        # each rank would sample only its share of the requests (v1/worker/gpu/sample/batch_shard.py:
        # 177-186), so no rank would see a whole group
        raise ValueError("pced is refused with batch-sharded sampling: a group's rows must be sampled together")


class PCEDLogitsProcessor(_V1Base):
    """vLLM V1 runner interface. The runner removes a request from its batch when it finishes and
    when it is not scheduled for a step (``v1/worker/gpu_model_runner.py:1213-1233``); the group
    table keeps the group for its return."""

    def __init__(self, vllm_config=None, device=None, is_pin_memory: bool = False):
        check_config(vllm_config)
        self.table = GroupTable()
        self.rows: dict[int, tuple[GroupMember, list[int]]] = {}  # batch index -> (member, its output token ids)

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        check_params(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax

    def _drop(self, index: int) -> None:
        held = self.rows.pop(index, None)
        if held is not None:
            self.table.leave(held[0])

    def update_state(self, batch_update) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:  # removed, added, moved: the order of v1/sample/logits_processor/interface.py:53-54
            self._drop(index)
        for index, params, _prompt, output_ids in batch_update.added:
            self._drop(index)  # an added request may replace the one at its index
            member = check_params(params)
            if member is not None:
                self.rows[index] = (member, output_ids)  # the runner's live list (interface.py:45-48)
                self.table.join(member)
        for first, second, direction in batch_update.moved:
            a, b = self.rows.pop(first, None), self.rows.pop(second, None)
            if b is not None and getattr(direction, "name", "") != "SWAP":
                self.table.leave(b[0])  # a one-way move overwrites the row it lands on
            if a is not None:
                self.rows[second] = a
            if b is not None and getattr(direction, "name", "") == "SWAP":
                self.rows[first] = b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        rows = [Row(index, member, len(output)) for index, (member, output) in self.rows.items()]
        return apply_groups(logits, rows, self.table)


class PCEDLogitsProcessorV2(_V2Base):
    """Model Runner V2 interface: per-slot state, rows mapped to slots by the step's context.
    Speculative decoding is refused, so a row is a request: row i = batch position i. A slot's
    member leaves its group when the slot is given to another request (V2 says no more:
    ``v1/worker/gpu/sample/logits_processor/interface.py:95-97``)."""

    def __init__(self, vllm_config=None, req_states=None):
        check_config(vllm_config)
        self.prompt_len = req_states.prompt_len.np  # host copies vLLM keeps of every slot's lengths
        prefill = getattr(req_states, "prefill_len", None)  # prompt + output so far on a resumption (interface.py:44-46)
        self.prefill_len = prefill.np if prefill is not None else self.prompt_len
        self.table = GroupTable()
        self.slots: dict[int, GroupMember] = {}

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        check_params(sampling_params)

    def add_request(self, req_idx: int, sampling_params) -> bool:
        previous = self.slots.pop(req_idx, None)
        if previous is not None:
            self.table.leave(previous)
        member = check_params(sampling_params)
        if member is None:
            return False
        self.slots[req_idx] = member
        self.table.join(member)
        return True

    def apply(self, logits: torch.Tensor, ctx) -> torch.Tensor:
        if not self.slots:
            return logits
        # host arrays: batch position -> slot, and tokens visible to the token sampled now (exact
        # without speculative decoding) = prompt + generated; nothing here reads the device. A row
        # whose (re)fill is not done has no next token yet: V2 samples none for it (sampler.py:190-194)
        slots, seen = ctx.idx_mapping_np.tolist(), ctx.seq_lens_upper_bound_np.tolist()
        rows = [Row(index, self.slots[slot], int(seen[index]) - int(self.prompt_len[slot]))
                for index, slot in enumerate(slots)
                if slot in self.slots and int(seen[index]) >= int(self.prefill_len[slot])]
        return apply_groups(logits, rows, self.table) if rows else logits


def processor_class(v2: bool) -> type:
    """The logits-processor class to hand ``LLM(logits_processors=[...])``: the V2 interface when
    vLLM will run Model Runner V2. A module-level class, so it pickles by name into vLLM's
    processes."""
    return PCEDLogitsProcessorV2 if v2 else PCEDLogitsProcessor
