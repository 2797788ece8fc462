"""The logits processors as vLLM 0.32 loads and calls them: each class passes the loader of its own
runner (vLLM's code, called here), a group closed while a step is in flight is skipped, and the
processor's step reads nothing back from the device beyond the rule's own choice."""

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pced.backends.vllm.groups import GroupMember, GroupRegistry, GroupState, Row, apply_groups
from pced.backends.vllm.processor import PCEDLogitsProcessor, PCEDLogitsProcessorV2, processor_class
from pced.rule import ContrastiveRule, RuleConfig

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
RULE = RuleConfig(beta="dynamic", gamma=2.5)
RELEVANCE = (0.9, 0.6, 0.3)


def members(group: str) -> list[GroupMember]:
    return [GroupMember(group, m, RELEVANCE, RULE) for m in range(len(RELEVANCE) + 1)]


def params(member: GroupMember | None = None):
    return SimpleNamespace(extra_args=member.to_args() if member else None, temperature=0.0, repetition_penalty=1.0,
                           presence_penalty=0.0, frequency_penalty=0.0)


def v2_processor(groups: GroupRegistry, prompt_len: list[int]):
    """The V2 class built by vLLM's own V2 builder, as Model Runner V2 builds it."""
    from vllm.v1.worker.gpu.sample.logits_processor.loader import build_custom_logits_processors

    req_states = SimpleNamespace(device=torch.device("cpu"), max_num_reqs=len(prompt_len), vocab_size=20,
                                 all_token_ids=None, prompt_len=SimpleNamespace(np=np.array(prompt_len)),
                                 prefill_len=None, total_len=None)
    built = build_custom_logits_processors(SimpleNamespace(speculative_config=None), req_states, False,
                                           [processor_class(groups, v2=True)])
    assert len(built) == 1
    return built[0]


@needs_vllm
def test_each_class_passes_the_loader_of_its_runner_and_only_that_one():
    from vllm.v1.sample.logits_processor import _load_custom_logitsprocs, validate_logits_processors_parameters
    from vllm.v1.worker.gpu.sample.logits_processor.loader import (_load_v2_logitsprocs,
                                                                   build_custom_logits_processors_params_validator)
    from vllm.exceptions import VLLMValidationError

    groups = GroupRegistry()
    v1, v2 = processor_class(groups, v2=False), processor_class(groups, v2=True)
    assert issubclass(v1, PCEDLogitsProcessor) and issubclass(v2, PCEDLogitsProcessorV2) and v1.groups is groups is v2.groups
    assert _load_custom_logitsprocs([v1])[-1] is v1  # V1 runner: vllm/v1/sample/logits_processor/__init__.py
    assert _load_v2_logitsprocs([v2])[-1] is v2  # Model Runner V2: v1/worker/gpu/sample/logits_processor/loader.py
    with pytest.raises(ValueError, match="is not a subclass of"):  # what passing the V1 class to V2 did (loader.py:87-93)
        _load_v2_logitsprocs([v1])
    validate = build_custom_logits_processors_params_validator([v2])  # what the input processor runs per request
    validate(params(members("g")[1]))
    with pytest.raises(VLLMValidationError, match="greedily"):
        validate(SimpleNamespace(**{**vars(params(members("g")[1])), "temperature": 0.7}))
    validate_logits_processors_parameters([v1], params(members("g")[1]))


@needs_vllm
def test_v2_processor_built_by_vllm_decides_from_host_arrays():
    group = members("q")
    groups = GroupRegistry()
    groups.open("q", GroupState.start(group[0]))
    processor = v2_processor(groups, [10, 12, 11, 9, 5])
    assert [processor.add_request(slot, params(m)) for slot, m in zip((3, 0, 2, 1), group)] == [True] * 4
    assert processor.add_request(4, params()) is False
    logits = torch.randn(5, 20)
    rows = [logits[r].clone() for r in (3, 4, 0, 2)]  # member m sits in slot (3, 0, 2, 1)[m], at the row below
    expected = ContrastiveRule(RULE, torch.tensor(RELEVANCE)).choose(torch.stack(rows))
    ctx = SimpleNamespace(idx_mapping_np=np.array([2, 4, 1, 3, 0]), seq_lens_upper_bound_np=np.array([11, 5, 12, 9, 10]),
                          expanded_idx_mapping=None, pos=None)  # device tensors: never read
    untouched = logits[1].clone()
    processor.apply(logits, ctx)
    assert all(int(logits[i].argmax()) == expected.token and logits[i].isfinite().sum() == 1 for i in (0, 2, 3, 4))
    assert torch.equal(logits[1], untouched)
    assert groups.close("q").winners == [expected.winner]


def test_a_group_closed_while_its_step_is_in_flight_is_skipped_not_raised():
    """The order an abandoned question produces under async scheduling: the caller closes the group,
    then the engine runs the step it had already scheduled for the group's rows."""
    group = members("gone")
    groups = GroupRegistry()
    groups.open("gone", GroupState.start(group[0]))
    processor = processor_class(groups, v2=False)()
    outputs = {m.member: [] for m in group}
    processor.update_state(SimpleNamespace(removed=[], moved=[], added=[(i, params(m), [1], outputs[m.member])
                                                                        for i, m in enumerate(group)]))
    processor.apply(torch.randn(4, 20))  # step 0 decided
    for member in group:
        outputs[member.member].append(0)  # one token generated (whatever it was): the rows now need token 1
    groups.close("gone")
    logits = torch.randn(4, 20)
    before = logits.clone()
    processor.apply(logits)  # the step in flight: the tape it would need is gone with the group
    assert torch.equal(logits, before) and len(groups) == 0
    with pytest.raises(RuntimeError, match="ahead of its group's tape"):  # an open group that lost its tape still fails
        groups.open("gone", GroupState.start(group[0]))
        processor.apply(torch.randn(4, 20))


class HostReads(TorchDispatchMode):
    """Counts the operations that read a tensor's value back to the host."""

    READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.equal.default", "aten.is_nonzero.default"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(func) in self.READS:
            self.count += 1
        elif str(func).startswith("aten._to_copy") and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]).type == "cpu" and args[0].device.type != "cpu":
            self.count += 1
        return func(*args, **kwargs)


def test_the_processor_step_adds_no_host_read_to_the_rules_own():
    """One step of two groups: the reads counted in ``apply_groups`` are exactly those of the rule's
    two choices on the same logits (forcing and row bookkeeping read nothing), and a step of a group
    whose rows all lag behind its tape (no choice to make) reads nothing at all."""
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    with HostReads() as rule_reads:
        for half in (logits[:4], logits[4:]):
            ContrastiveRule(RULE, torch.tensor(RELEVANCE)).choose(half.clone())
    a, b = members("a"), members("b")
    groups = GroupRegistry()
    for g in (a, b):
        groups.open(g[0].group, GroupState.start(g[0]))
    with HostReads() as step_reads:
        apply_groups(logits.clone(), [Row(i, m, 0) for i, m in enumerate(a + b)], groups)
    assert rule_reads.count > 0 and step_reads.count == rule_reads.count
    with HostReads() as lagging_reads:  # every row replays token 0 of the tape
        apply_groups(torch.randn(8, 50), [Row(i, m, 0) for i, m in enumerate(a + b)], groups)
    assert lagging_reads.count == 0


@needs_vllm
def test_v2_step_reads_no_device_tensor_of_the_context():
    """Model Runner V2 hands device tensors (``expanded_idx_mapping``, ``pos``) beside host copies;
    on CPU tensors a read would pass unseen, so the device tensors here are meta tensors: any
    ``.tolist()`` or ``int()`` of them raises."""
    group = members("m")
    groups = GroupRegistry()
    groups.open("m", GroupState.start(group[0]))
    processor = v2_processor(groups, [7, 7, 7, 7])
    for slot, member in enumerate(group):
        processor.add_request(slot, params(member))
    meta = torch.empty(4, dtype=torch.long, device="meta")
    ctx = SimpleNamespace(idx_mapping_np=np.arange(4), seq_lens_upper_bound_np=np.full(4, 7), expanded_idx_mapping=meta,
                          idx_mapping=meta, pos=meta, input_ids=meta, expanded_local_pos=meta)
    logits = torch.randn(4, 20)
    processor.apply(logits, ctx)
    assert (logits.isfinite().sum(dim=1) == 1).all()
