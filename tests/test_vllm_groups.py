"""PCED's group decision for serving engines, on synthetic batches (plain torch, no vLLM needed):
every row of a group emits the same token and carries its part of the trace, other requests are
untouched, lagging members follow the tape, groups live as long as their members, every group of a
step is decided in one batched computation that equals the rule group by group, and driving the
tiny model's rows through it reproduces the transformers backend."""

import itertools
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pced.backends.vllm import channel
from pced.backends.vllm.groups import GroupMember, GroupTable, Row, apply_groups
from pced.backends.vllm.processor import PCEDLogitsProcessor, check_params, processor_class
from pced.kv.encode import encode_documents, encode_prefix
from pced.methods.pced import Expert, PCEDGeneration
from pced.text.prompts import PromptBuilder
from pced.decoding.rule import AMATEUR, ContrastiveRule, RuleConfig
from pced.decoding.sampling import SamplingConfig

RULE = RuleConfig(beta="dynamic", gamma=2.5)
RELEVANCE = (0.9, 0.6, 0.3)


def members(group="q1", rule=RULE, relevance=RELEVANCE):
    return [GroupMember(group, m, relevance, rule) for m in range(len(relevance) + 1)]


def joined(*groups: list[GroupMember]) -> GroupTable:
    """A table whose groups' members are all in the batch (as the processor joins them on arrival)."""
    table = GroupTable()
    for group in groups:
        for member in group:
            table.join(member)
    return table


def forced(row: torch.Tensor) -> tuple[int, float]:
    """The one entry of a forced row above -inf: (token, carrier)."""
    kept = (row > float("-inf")).nonzero().flatten().tolist()
    assert len(kept) == 1
    return kept[0], float(row[kept[0]])


def test_complete_group_emits_one_token_everywhere_carries_its_trace_and_leaves_other_requests_alone():
    torch.manual_seed(0)
    group = members()
    logits = torch.randn(6, 50)
    # batch rows in engine order: a foreign request, then the group's members shuffled
    layout = [None, group[2], group[0], group[3], None, group[1]]
    rule = ContrastiveRule(RULE, torch.tensor(RELEVANCE))
    reference = rule.choose(torch.stack([logits[layout.index(m)] for m in group]))
    untouched = logits[[0, 4]].clone()
    table = joined(group)
    apply_groups(logits, [Row(i, m, 0) for i, m in enumerate(layout) if m is not None], table)
    carried = {m.member: forced(logits[i]) for i, m in enumerate(layout) if m is not None}
    assert {token for token, _ in carried.values()} == {reference.token}
    assert torch.equal(logits[[0, 4]], untouched)
    assert channel.read_record(carried[0][1]) == (reference.winner, False)  # the amateur's row: the winner
    assert channel.read_betas([carried[k][1] for k in (1, 2, 3)]) == rule.betas()  # experts: betas, bit for bit
    state = table.get("q1")
    assert state.tape == [reference.token] and state.winners == [reference.winner]
    assert (state.complete, state.degraded) == (1, 0) and state.betas() == rule.betas()


def test_lagging_member_follows_the_tape_and_incomplete_steps_are_counted_and_carried():
    torch.manual_seed(1)
    group = members()
    table = joined(group)
    # step 0: the third expert is not scheduled yet
    step0 = torch.randn(3, 40)
    apply_groups(step0, [Row(0, group[0], 0), Row(1, group[1], 0), Row(2, group[2], 0)], table)
    first, record = forced(step0[0])
    assert channel.read_record(record)[1] is True and forced(step0[1])[1] == channel.UNKNOWN  # degraded; no betas yet
    assert table.get("q1").degraded == 1 and table.get("q1").beta is None  # betas wait for a complete step
    # step 1: it arrives (nothing generated yet) while the others need their second token
    step1 = torch.randn(4, 40)
    apply_groups(step1, [Row(0, group[0], 1), Row(1, group[1], 1), Row(2, group[2], 1), Row(3, group[3], 0)], table)
    assert forced(step1[3]) == (first, channel.UNKNOWN)  # it catches up on exactly the token the others saw
    second = forced(step1[0])[0]
    assert {forced(step1[i])[0] for i in range(3)} == {second} and table.get("q1").degraded == 2
    # step 2: everyone at the frontier: a complete step, the same rule as the transformers backend
    step2 = torch.randn(4, 40)
    rule = ContrastiveRule(RULE, torch.tensor(RELEVANCE))
    expected = rule.choose(step2.clone())
    apply_groups(step2, [Row(i, group[i], 2) for i in range(4)], table)
    assert {forced(step2[i])[0] for i in range(4)} == {expected.token}
    assert [forced(step2[i])[1] for i in (1, 2, 3)] == rule.betas()  # frozen here, at the first complete step
    state = table.get("q1")
    assert state.tape == [first, second, expected.token] and state.complete == 1
    assert [channel.read_record(v) for v in state.records] == [(w, d) for w, d in zip(state.winners, (True, True, False))]
    # the amateur replays token 1 later: it carries that token's record, whatever happened since
    replay = torch.randn(1, 40)
    apply_groups(replay, [Row(0, group[0], 1)], table)
    assert forced(replay[0]) == (second, state.records[1])


def test_a_row_without_its_group_state_fails_its_question_not_the_engine():
    group = members("lost")
    table = joined(group)
    logits = torch.randn(2, 30)
    own = int(logits[1].argmax())
    apply_groups(logits, [Row(0, group[0], 0), Row(1, group[1], 5)], table)  # a row ahead of the tape
    assert forced(logits[1]) == (own, channel.LOST) and forced(logits[0])[1] == channel.LOST
    with pytest.raises(channel.GroupLost):
        channel.read_record(forced(logits[0])[1])


def test_two_groups_in_one_batch_decide_independently():
    torch.manual_seed(2)
    a, b = members("a"), members("b", relevance=(0.2, 0.8, 0.5))
    logits = torch.randn(8, 30)
    rows = [Row(i, m, 0) for i, m in enumerate(a + b)]
    expect_a = ContrastiveRule(RULE, torch.tensor(RELEVANCE)).choose(logits[:4].clone()).token
    expect_b = ContrastiveRule(RULE, torch.tensor((0.2, 0.8, 0.5))).choose(logits[4:].clone()).token
    random.Random(0).shuffle(rows)
    apply_groups(logits, rows, joined(a, b))
    assert [forced(logits[i])[0] for i in range(8)] == [expect_a] * 4 + [expect_b] * 4


SETTINGS = [RuleConfig(beta=beta, gamma=2.5, aggregation=aggregation, score_space=space, prior=prior)
            for aggregation, space, beta, prior in itertools.product(("max", "moe", "poe"), ("logits", "logprobs"),
                                                                     ("dynamic", "elementwise", 0.5), ("log", "standardized"))]


@pytest.mark.parametrize("rule", SETTINGS, ids=lambda r: f"{r.aggregation}-{r.score_space}-{r.beta}-{r.prior}")
def test_the_batched_step_equals_the_rule_group_by_group(rule):
    """Four groups in one step (two of the same size, batched together; one with a single document),
    two steps (betas learned, then frozen), the embedded model's vocabulary size: every token, winner
    and beta equals ``ContrastiveRule.choose`` on the group alone, exactly."""
    torch.manual_seed(3)
    relevances = [(0.9, 0.6, 0.3), (0.2, 0.8, 0.5), (0.7,), (0.4, 0.3, 0.35, 0.9)]
    groups = [members(f"g{i}", rule, r) for i, r in enumerate(relevances)]
    table = joined(*groups)
    rules = [ContrastiveRule(rule, torch.tensor(r)) for r in relevances]
    batch = [m for g in groups for m in g]
    for step in range(2):
        logits = torch.randn(len(batch), 49152) * 3
        expected, start = [], 0
        for group, reference in zip(groups, rules):
            choice = reference.choose(logits[start:start + len(group)].clone())
            expected.append((choice.token, choice.winner))
            start += len(group)
        apply_groups(logits, [Row(i, m, step) for i, m in enumerate(batch)], table)
        assert [(table.get(g[0].group).tape[-1], table.get(g[0].group).winners[-1]) for g in groups] == expected
        assert [table.get(g[0].group).betas() for g in groups] == [r.betas() for r in rules]


def test_rows_of_the_tiny_model_in_engine_order_reproduce_the_transformers_backend(tiny_llm):
    """An engine's view of the question: each member's logits computed by the model on its own
    sequence, rows in a shuffled order every step; the group decision must pick PCED's tokens."""
    builder = PromptBuilder(tiny_llm.tokenizer)
    question = "Where was the founder of Zorblax born?"
    docs = ["The Zorblax company was founded by Mira Quell.", "Mira Quell was born in Oskvale.", "Lake Tarnow is cold."]
    prefix = encode_prefix(tiny_llm, builder.prefix_ids)
    caches = encode_documents(tiny_llm, prefix, [builder.context_ids([d]) for d in docs])
    experts = [Expert(f"d{i}", r, lambda kv=kv: kv) for i, (kv, r) in enumerate(zip(caches, RELEVANCE))]
    reference = PCEDGeneration(tiny_llm, prefix, experts, builder.suffix_ids(question), builder.suffix_ids(question, False),
                               RULE, SamplingConfig(max_new_tokens=8, ignore_eos=True)).answer()
    prompts = [builder.prefix_ids + builder.suffix_ids(question, False)]
    prompts += [builder.prefix_ids + builder.context_ids([d]) + builder.suffix_ids(question) for d in docs]
    group, generated, carried = members("tiny"), [], []
    table = joined(group)
    order = random.Random(3)
    with torch.inference_mode():
        for step in range(8):
            rows = list(range(4))
            order.shuffle(rows)
            logits = torch.stack([tiny_llm.model(torch.tensor([prompts[m] + generated])).logits[0, -1] for m in rows])
            apply_groups(logits, [Row(i, group[m], step) for i, m in enumerate(rows)], table)
            token, record = forced(logits[rows.index(0)])
            generated.append(token)
            carried.append(channel.read_record(record)[0])
            betas = [forced(logits[rows.index(k)])[1] for k in (1, 2, 3)]
    assert generated == reference.token_ids
    assert carried == [s.winner for s in reference.trace] == table.get("tiny").winners
    assert betas == pytest.approx(reference.betas, abs=1e-5)


def test_groups_live_while_a_member_is_in_the_batch_and_come_back_from_the_parked():
    group = members("p")
    table = GroupTable(parked=2)
    for member in group:
        table.join(member)
    apply_groups(torch.randn(4, 20), [Row(i, m, 0) for i, m in enumerate(group)], table)
    state = table.get("p")
    for member in group:  # all unscheduled for a step (or preempted): parked, tape kept
        table.leave(member)
    assert table.get("p") is None and table.parked["p"] is state
    table.join(group[2])  # one comes back: the same state
    assert table.get("p") is state and len(state.tape) == 1
    table.leave(group[2])
    for name in ("x", "y"):  # two more groups park: the oldest is dropped past the limit
        other = members(name)[0]
        table.join(other)
        table.leave(other)
    assert list(table.parked) == ["x", "y"]


def params(member: GroupMember | None = None, **fields):
    return SimpleNamespace(extra_args=member.to_args() if member else None, temperature=0.0, repetition_penalty=1.0,
                           presence_penalty=0.0, frequency_penalty=0.0, logprobs=0 if member else None, **fields)


def test_v1_processor_tracks_added_moved_and_removed_rows():
    group = members("v1")
    processor = processor_class(v2=False)()
    outputs = {m.member: [] for m in group}
    update = SimpleNamespace(removed=[], moved=[], added=[(i, params(m), [1, 2], outputs[m.member]) for i, m in
                                                           enumerate(group)] + [(4, params(), [1], [])])
    processor.update_state(update)
    swap = SimpleNamespace(name="SWAP")
    processor.update_state(SimpleNamespace(removed=[], added=[], moved=[(0, 4, swap)]))  # amateur <-> foreign row
    logits = torch.randn(5, 20)
    foreign = logits[0].clone()
    processor.apply(logits)
    token = forced(logits[4])[0]
    assert all(forced(logits[i])[0] == token for i in (1, 2, 3)) and torch.equal(logits[0], foreign)
    for member in group:
        outputs[member.member].append(token)
    processor.update_state(SimpleNamespace(removed=[4, 1, 2, 3], added=[], moved=[]))
    assert processor.rows == {} and processor.table.get("v1") is None and processor.table.parked["v1"].tape == [token]


def test_v2_processor_maps_rows_to_slots_and_skips_rows_still_prefilling():
    group = members("v2")
    req_states = SimpleNamespace(prompt_len=SimpleNamespace(np=np.array([10, 12, 11, 9, 5])),
                                 prefill_len=SimpleNamespace(np=np.array([10, 12, 11, 9, 5])))
    processor = processor_class(v2=True)(req_states=req_states)
    assert [processor.add_request(slot, params(m)) for slot, m in zip((3, 0, 2, 1), group)] == [True] * 4
    assert processor.add_request(4, params()) is False
    logits = torch.randn(5, 20)
    foreign = logits[1].clone()
    # rows -> slots on the host; every PCED request is at its first generated token (tokens seen = prompt_len)
    ctx = SimpleNamespace(idx_mapping_np=np.array([0, 4, 3, 2, 1]), seq_lens_upper_bound_np=np.array([10, 5, 9, 11, 12]))
    processor.apply(logits, ctx)
    assert len({forced(logits[i])[0] for i in (0, 2, 3, 4)}) == 1 and torch.equal(logits[1], foreign)
    assert processor.table.get("v2").complete == 1
    # a chunk of a prefill (slot 3 has seen 7 of its 9 tokens) hands no row to the group: left as it is
    chunk = torch.randn(2, 20)
    before = chunk.clone()
    processor.apply(chunk, SimpleNamespace(idx_mapping_np=np.array([3, 4]), seq_lens_upper_bound_np=np.array([7, 6])))
    assert torch.equal(chunk, before)
    processor.add_request(3, params())  # the slot goes to another request: its member leaves the group
    assert processor.table.rows["v2"] == 3


def test_carriers_round_trip_exactly():
    for winner, degraded in itertools.product(range(-1, 40), (False, True)):
        value = channel.record_value(winner, degraded)
        assert channel.read_record(value) == (winner, degraded)
        device = channel.record_values(torch.tensor([winner]), torch.tensor([degraded]))
        assert float(device[0]) == value and channel.read_record(float(np.float32(value))) == (winner, degraded)
    assert channel.degraded_steps([0.0, -2.0, 3.0, -1.0]) == 2
    assert channel.read_betas([0.25, channel.UNKNOWN]) == [] and channel.read_betas([]) == []
    beta = float(torch.tensor(0.123456789, dtype=torch.float32))
    assert channel.read_betas([beta, 0.0]) == [beta, 0.0]


def test_unsupported_requests_are_refused():
    member = members()[1]
    with pytest.raises(ValueError, match="greedily"):
        check_params(SimpleNamespace(**{**vars(params(member)), "temperature": 0.7}))
    with pytest.raises(ValueError, match="penalties"):
        check_params(SimpleNamespace(**{**vars(params(member)), "repetition_penalty": 1.2}))
    with pytest.raises(ValueError, match="logprobs=0"):
        check_params(SimpleNamespace(**{**vars(params(member)), "logprobs": 5}))
    with pytest.raises(ValueError, match="speculative"):
        PCEDLogitsProcessor(SimpleNamespace(speculative_config=object()))
    with pytest.raises(ValueError, match="processed_logits"):
        PCEDLogitsProcessor(SimpleNamespace(speculative_config=None, model_config=SimpleNamespace(logprobs_mode="raw_logprobs")))
    with pytest.raises(ValueError, match="batch-sharded"):
        PCEDLogitsProcessor(SimpleNamespace(speculative_config=None, model_config=SimpleNamespace(logprobs_mode="processed_logits"),
                                            parallel_config=SimpleNamespace(enable_batch_sharded_sampling=True)))
    with pytest.raises(ValueError, match="malformed"):
        GroupMember.from_args({"pced": {"group": "x"}})
    assert check_params(params()) is None and GroupMember.from_args(member.to_args()) == member
    assert AMATEUR == -1


def test_vllm_group_members_carry_the_prior():
    member = GroupMember("q", 1, (0.9, 0.5), RuleConfig(prior="standardized"))
    assert GroupMember.from_args(member.to_args()) == member
