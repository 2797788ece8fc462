"""PCED's group decision for serving engines, on synthetic batches (plain torch, no vLLM needed):
every row of a group emits the same token, other requests are untouched, lagging members follow
the tape, and driving the tiny model's rows through it reproduces the transformers backend."""

import random
from types import SimpleNamespace

import pytest
import torch

from pced.sampling import SamplingConfig
from pced.backends.vllm.groups import GroupMember, GroupState, Row, apply_groups
from pced.backends.vllm.processor import GROUPS, PCEDLogitsProcessor, PCEDLogitsProcessorV2, check_params
from pced.kv.encode import encode_documents, encode_prefix
from pced.methods.pced import Expert, PCEDGeneration
from pced.prompts import PromptBuilder
from pced.rule import AMATEUR, ContrastiveRule, RuleConfig

RULE = RuleConfig(beta="dynamic", gamma=2.5)
RELEVANCE = (0.9, 0.6, 0.3)


def members(group="q1", rule=RULE, relevance=RELEVANCE):
    return [GroupMember(group, m, relevance, rule) for m in range(len(relevance) + 1)]


def forced_token(row: torch.Tensor) -> int:
    finite = torch.isfinite(row).nonzero().flatten().tolist()
    assert len(finite) == 1 and row[finite[0]] == 0
    return finite[0]


def test_complete_group_emits_one_token_everywhere_and_leaves_other_requests_alone():
    torch.manual_seed(0)
    group = members()
    logits = torch.randn(6, 50)
    # batch rows in engine order: a foreign request, then the group's members shuffled
    layout = [None, group[2], group[0], group[3], None, group[1]]
    reference = ContrastiveRule(RULE, torch.tensor(RELEVANCE)).choose(
        torch.stack([logits[layout.index(m)] for m in group]))
    untouched = logits[[0, 4]].clone()
    states: dict[str, GroupState] = {}
    apply_groups(logits, [Row(i, m, 0) for i, m in enumerate(layout) if m is not None], states)
    assert {forced_token(logits[i]) for i, m in enumerate(layout) if m is not None} == {reference.token}
    assert torch.equal(logits[[0, 4]], untouched)
    state = states["q1"]
    assert state.tape == [reference.token] and state.winners == [reference.winner]
    assert (state.complete, state.degraded) == (1, 0) and len(state.betas()) == 3


def test_lagging_member_follows_the_tape_and_incomplete_steps_are_counted():
    torch.manual_seed(1)
    group = members()
    states: dict[str, GroupState] = {}
    # step 0: the third expert is not scheduled yet
    step0 = torch.randn(3, 40)
    apply_groups(step0, [Row(0, group[0], 0), Row(1, group[1], 0), Row(2, group[2], 0)], states)
    first = forced_token(step0[0])
    assert states["q1"].degraded == 1 and states["q1"].rule.beta is None  # betas wait for a complete step
    # step 1: it arrives (nothing generated yet) while the others need their second token
    step1 = torch.randn(4, 40)
    apply_groups(step1, [Row(0, group[0], 1), Row(1, group[1], 1), Row(2, group[2], 1), Row(3, group[3], 0)], states)
    assert forced_token(step1[3]) == first  # it catches up on exactly the token the others saw
    second = forced_token(step1[0])
    assert {forced_token(step1[i]) for i in range(3)} == {second} and states["q1"].degraded == 2
    # step 2: everyone at the frontier: a complete step, the same rule as the transformers backend
    step2 = torch.randn(4, 40)
    rule = ContrastiveRule(RULE, torch.tensor(RELEVANCE))
    expected = rule.choose(step2.clone())
    apply_groups(step2, [Row(i, group[i], 2) for i in range(4)], states)
    assert {forced_token(step2[i]) for i in range(4)} == {expected.token}
    assert states["q1"].tape == [first, second, expected.token] and states["q1"].complete == 1
    with pytest.raises(RuntimeError, match="ahead of its group's tape"):
        apply_groups(torch.randn(1, 40), [Row(0, group[0], 9)], states)


def test_two_groups_in_one_batch_decide_independently():
    torch.manual_seed(2)
    a, b = members("a"), members("b", relevance=(0.2, 0.8, 0.5))
    logits = torch.randn(8, 30)
    rows = [Row(i, m, 0) for i, m in enumerate(a + b)]
    expect_a = ContrastiveRule(RULE, torch.tensor(RELEVANCE)).choose(logits[:4].clone()).token
    expect_b = ContrastiveRule(RULE, torch.tensor((0.2, 0.8, 0.5))).choose(logits[4:].clone()).token
    random.Random(0).shuffle(rows)
    apply_groups(logits, rows, {})
    assert [forced_token(logits[i]) for i in range(8)] == [expect_a] * 4 + [expect_b] * 4


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
    group, states, generated = members("tiny"), {}, []
    order = random.Random(3)
    with torch.inference_mode():
        for step in range(8):
            rows = list(range(4))
            order.shuffle(rows)
            logits = torch.stack([tiny_llm.model(torch.tensor([prompts[m] + generated])).logits[0, -1] for m in rows])
            apply_groups(logits, [Row(i, group[m], step) for i, m in enumerate(rows)], states)
            generated.append(forced_token(logits[0]))
    assert generated == reference.token_ids
    assert states["tiny"].winners == [s.winner for s in reference.trace]
    assert states["tiny"].betas() == pytest.approx(reference.betas, abs=1e-5)


def params(member: GroupMember | None = None, **fields):
    return SimpleNamespace(extra_args=member.to_args() if member else None, temperature=0.0, repetition_penalty=1.0,
                           presence_penalty=0.0, frequency_penalty=0.0, **fields)


def test_v1_processor_tracks_added_moved_and_removed_rows():
    GROUPS.clear()
    group = members("v1")
    processor = PCEDLogitsProcessor()
    outputs = {m.member: [] for m in group}
    update = SimpleNamespace(removed=[], moved=[], added=[(i, params(m), [1, 2], outputs[m.member]) for i, m in
                                                           enumerate(group)] + [(4, params(), [1], [])])
    processor.update_state(update)
    swap = SimpleNamespace(name="SWAP")
    processor.update_state(SimpleNamespace(removed=[], added=[], moved=[(0, 4, swap)]))  # amateur <-> foreign row
    logits = torch.randn(5, 20)
    foreign = logits[0].clone()
    processor.apply(logits)
    token = forced_token(logits[4])
    assert all(forced_token(logits[i]) == token for i in (1, 2, 3)) and torch.equal(logits[0], foreign)
    for member in group:
        outputs[member.member].append(token)
    processor.update_state(SimpleNamespace(removed=[4, 1, 2, 3], added=[], moved=[]))
    assert processor.rows == {} and GROUPS["v1"].tape == [token]
    GROUPS.clear()


def test_v2_processor_maps_rows_to_slots_with_the_step_context():
    GROUPS.clear()
    group = members("v2")
    processor = PCEDLogitsProcessorV2(req_states=SimpleNamespace(prompt_len=SimpleNamespace(np=[10, 12, 11, 9, 5])))
    assert [processor.add_request(slot, params(m)) for slot, m in zip((3, 0, 2, 1), group)] == [True] * 4
    assert processor.add_request(4, params()) is False
    logits = torch.randn(5, 20)
    foreign = logits[1].clone()
    # rows -> slots; every PCED request is at its first generated token (pos = prompt_len - 1)
    ctx = SimpleNamespace(expanded_idx_mapping=torch.tensor([0, 4, 3, 2, 1]), pos=torch.tensor([9, 4, 8, 10, 11]))
    processor.apply(logits, ctx)
    assert len({forced_token(logits[i]) for i in (0, 2, 3, 4)}) == 1 and torch.equal(logits[1], foreign)
    assert GROUPS["v2"].complete == 1
    GROUPS.clear()


def test_unsupported_requests_are_refused():
    member = members()[1]
    with pytest.raises(ValueError, match="greedily"):
        check_params(SimpleNamespace(**{**vars(params(member)), "temperature": 0.7}))
    with pytest.raises(ValueError, match="penalties"):
        check_params(SimpleNamespace(**{**vars(params(member)), "repetition_penalty": 1.2}))
    with pytest.raises(ValueError, match="speculative"):
        PCEDLogitsProcessor(SimpleNamespace(speculative_config=object()))
    with pytest.raises(ValueError, match="malformed"):
        GroupMember.from_args({"pced": {"group": "x"}})
    assert check_params(params()) is None and GroupMember.from_args(member.to_args()) == member
    assert AMATEUR == -1


def test_vllm_group_members_carry_the_prior():
    from pced.backends.vllm.groups import GroupMember

    member = GroupMember("q", 1, (0.9, 0.5), RuleConfig(prior="standardized"))
    assert GroupMember.from_args(member.to_args()) == member
