"""The logits processors as vLLM 0.32 loads and calls them: each class passes the loader of its own
runner (vLLM's code, called here), an abandoned question's rows leave without disturbing the others,
and a step reads the device once, whatever the number of groups."""

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers.host_reads import HostReads
from pced.backends.vllm import channel
from pced.backends.vllm.groups import GroupMember
from pced.backends.vllm.processor import PCEDLogitsProcessor, PCEDLogitsProcessorV2, processor_class
from pced.decoding.rule import ContrastiveRule, RuleConfig

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
RULE = RuleConfig(beta="dynamic", gamma=2.5)
RELEVANCE = (0.9, 0.6, 0.3)


def members(group: str) -> list[GroupMember]:
    return [GroupMember(group, m, RELEVANCE, RULE) for m in range(len(RELEVANCE) + 1)]


def params(member: GroupMember | None = None):
    return SimpleNamespace(extra_args=member.to_args() if member else None, temperature=0.0, repetition_penalty=1.0,
                           presence_penalty=0.0, frequency_penalty=0.0, logprobs=0 if member else None)


def v2_processor(prompt_len: list[int]):
    """The V2 class built by vLLM's own V2 builder, as Model Runner V2 builds it."""
    from vllm.v1.worker.gpu.sample.logits_processor.loader import build_custom_logits_processors

    lengths = SimpleNamespace(np=np.array(prompt_len))
    req_states = SimpleNamespace(device=torch.device("cpu"), max_num_reqs=len(prompt_len), vocab_size=20,
                                 all_token_ids=None, prompt_len=lengths, prefill_len=lengths, total_len=None)
    config = SimpleNamespace(speculative_config=None, model_config=SimpleNamespace(logprobs_mode="processed_logits"),
                             parallel_config=SimpleNamespace(enable_batch_sharded_sampling=False))
    built = build_custom_logits_processors(config, req_states, False, [processor_class(v2=True)])
    assert len(built) == 1
    return built[0]


@needs_vllm
def test_each_class_passes_the_loader_of_its_runner_and_only_that_one():
    from vllm.v1.sample.logits_processor import _load_custom_logitsprocs, validate_logits_processors_parameters
    from vllm.v1.worker.gpu.sample.logits_processor.loader import (_load_v2_logitsprocs,
                                                                   build_custom_logits_processors_params_validator)
    from vllm.exceptions import VLLMValidationError

    v1, v2 = processor_class(v2=False), processor_class(v2=True)
    assert v1 is PCEDLogitsProcessor and v2 is PCEDLogitsProcessorV2  # module-level: they pickle by name
    assert _load_custom_logitsprocs([v1])[-1] is v1  # V1 runner: vllm/v1/sample/logits_processor/__init__.py
    assert _load_custom_logitsprocs(["pced.backends.vllm.processor:PCEDLogitsProcessor"])[-1] is v1  # by name too
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
    processor = v2_processor([10, 12, 11, 9, 5])
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
    assert processor.table.get("q").winners == [expected.winner]
    assert channel.read_record(float(logits[3, expected.token])) == (expected.winner, False)  # the amateur, slot 3


def test_an_abandoned_question_leaves_and_the_others_go_on():
    """The order an abandoned question produces: pced aborts its requests; the step already
    scheduled still decides its rows (nobody reads them), then the engine removes them from the
    batch. The group is parked, the question beside it is decided as before."""
    gone, kept = members("gone"), members("kept")
    processor = processor_class(v2=False)()
    outputs = {(m.group, m.member): [] for m in gone + kept}
    processor.update_state(SimpleNamespace(removed=[], moved=[], added=[
        (i, params(m), [1], outputs[m.group, m.member]) for i, m in enumerate(gone + kept)]))
    logits = torch.randn(8, 20)
    processor.apply(logits)
    for i, m in enumerate(gone + kept):
        outputs[m.group, m.member].append(int(logits[i].argmax()))
    processor.apply(torch.randn(8, 20))  # the step in flight when the abort arrived: decided, unread
    for i, m in enumerate(gone + kept):
        outputs[m.group, m.member].append(0)  # whatever it emitted
    processor.update_state(SimpleNamespace(removed=[0, 1, 2, 3], added=[], moved=[]))
    assert processor.table.get("gone") is None and "gone" in processor.table.parked
    tape = processor.table.get("kept").tape
    logits = torch.randn(8, 20)
    processor.apply(logits)
    assert len(tape) == 3 and all(int(logits[i].argmax()) == tape[2] for i in range(4, 8))


@pytest.mark.parametrize("count", [1, 2, 4])
def test_one_host_read_per_step_whatever_the_number_of_groups(count):
    """Steps of 1, 2 and 4 groups through the V1 processor, as vLLM drives it (``update_state``,
    then ``apply``): the first step (betas learned), a step with frozen betas, a step where one
    expert of every group lags (it missed step 1 and replays token 1 while the others decide token
    2): one read of the device each, the ``.tolist()`` of the decided tokens and winners, counted by
    ``helpers.host_reads``. A step whose rows all replay the tape reads nothing."""
    groups = [members(f"g{i}") for i in range(count)]
    batch = [m for g in groups for m in g]
    outputs = [[] for _ in batch]
    processor = processor_class(v2=False)()
    processor.update_state(SimpleNamespace(removed=[], moved=[],
                                           added=[(i, params(m), [1], outputs[i]) for i, m in enumerate(batch)]))
    lagging = {i for i, m in enumerate(batch) if m.member == len(RELEVANCE)}
    reads = []
    for step in range(3):
        logits = torch.randn(len(batch), 2048)
        with HostReads() as counted:
            processor.apply(logits)
        reads.append(counted.events)
        for i in range(len(batch)):
            if not (step == 1 and i in lagging):  # step 1: the lagging experts' tokens are not emitted yet
                outputs[i].append(int(logits[i].argmax()))
    assert reads == [["tolist"]] * 3
    for i in range(len(batch)):  # every row a step behind the tape: a replay, no decision
        del outputs[i][1:]
    with HostReads() as counted:
        processor.apply(torch.randn(len(batch), 2048))
    assert counted.count == 0
    assert all(processor.table.get(g[0].group).complete == 2 and processor.table.get(g[0].group).degraded == 1
               for g in groups)


@needs_vllm
def test_v2_step_reads_no_device_tensor_of_the_context():
    """Model Runner V2 hands device tensors (``expanded_idx_mapping``, ``pos``) beside host copies;
    on CPU tensors a read would pass unseen, so the device tensors here are meta tensors: any
    ``.tolist()`` or ``int()`` of them raises."""
    group = members("m")
    processor = v2_processor([7, 7, 7, 7])
    for slot, member in enumerate(group):
        processor.add_request(slot, params(member))
    meta = torch.empty(4, dtype=torch.long, device="meta")
    ctx = SimpleNamespace(idx_mapping_np=np.arange(4), seq_lens_upper_bound_np=np.full(4, 7), expanded_idx_mapping=meta,
                          idx_mapping=meta, pos=meta, input_ids=meta, expanded_local_pos=meta)
    logits = torch.randn(4, 20)
    processor.apply(logits, ctx)
    assert (logits.isfinite().sum(dim=1) == 1).all()


@needs_vllm
def test_a_group_enters_the_scheduler_whole():
    """The engine core may step between two of a question's adds; the scheduler holds a group's
    requests until all N+1 have arrived, then adds them in member order. Aborting a held request
    drops it; requests of no group pass straight through."""
    from pced.backends.vllm.admission import GroupAdmission, scheduler_class

    class Recorded:  # what vLLM's scheduler receives, past the mixin
        def __init__(self):
            self.added, self.finished = [], []

        def add_request(self, request):
            self.added.append(request.request_id)

        def finish_requests(self, request_ids, status):
            self.finished.append(request_ids)
            return []

    class Held(GroupAdmission, Recorded):
        pass

    def request(rid, member=None):
        return SimpleNamespace(request_id=rid, sampling_params=params(member))

    scheduler, group, other = Held(), members("g"), members("h")
    scheduler.add_request(request("prefill"))
    for m in (2, 0, 3):
        scheduler.add_request(request(f"g-{m}", group[m]))
    scheduler.add_request(request("h-0", other[0]))
    assert scheduler.added == ["prefill"] and set(scheduler.held) == {"g", "h"}
    scheduler.add_request(request("g-1", group[1]))
    assert scheduler.added == ["prefill", "g-0", "g-1", "g-2", "g-3"] and set(scheduler.held) == {"h"}
    scheduler.finish_requests(["h-0"], None)
    assert scheduler.held == {} and scheduler.finished == [["h-0"]]
    assert scheduler_class(False).endswith("admission.GroupScheduler")
    assert scheduler_class(True).endswith("admission.AsyncGroupScheduler")
