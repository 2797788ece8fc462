"""The exactness checks on the device and dtype a GPU user runs: ``PCED_TEST_DEVICE=cuda python -m
pytest tests/test_device.py`` (default cpu, where CI runs them in bfloat16; the float32 CPU case is
the rest of the suite).

Tolerances: float32 as the CPU suite (1e-4 on logits; tokens exactly equal). bfloat16 keeps 8 bits
of mantissa: a logit of magnitude ~10 is rounded by up to ~0.03 at each of a few dozen sums, so
logits are compared to BF16_LOGITS = 0.25 and tokens only where the reference's top-2 margin exceeds
it (a closer pair may flip between two exact computations in bfloat16).
"""

import os

import pytest
import torch

from pced.decoding.sampling import SamplingConfig
from pced.methods.ape import APEGeneration
from pced.kv.store import KVStore
from pced.methods.concat import PlainGeneration
from pced.methods.pced import Expert, PCEDGeneration
from pced.text.prompts import PromptBuilder
from pced.decoding.rule import RuleConfig

from helpers.experts import encode_setup

DEVICE = os.environ.get("PCED_TEST_DEVICE", "cpu")
BF16_LOGITS = 0.25
TOLERANCE = {"float32": 1e-4, "bfloat16": BF16_LOGITS}
QUESTION = "Which town was the founder born in?"
DOCS = [
    "Mira Quell founded the Zorblax company.",
    "Mira Quell was born in the town of Oskvale, on the northern shore of Lake Tarnow. " * 5,
    "Oskvale is a fishing town with a copper-roofed harbour and " + "a long pier. " * 30,
]


def _available(device: str) -> bool:
    return device == "cpu" or (device.startswith("cuda") and torch.cuda.is_available())


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def device_llm(request, tiny_model_dir):
    from pced.llm import load_model

    if not _available(DEVICE):
        pytest.skip(f"PCED_TEST_DEVICE={DEVICE} is not available here")
    if DEVICE == "cpu" and request.param == "float32":
        pytest.skip("float32 on the CPU is the rest of the suite")
    return load_model(tiny_model_dir, device=DEVICE, dtype=request.param)


def dtype_name(llm) -> str:
    return str(next(llm.model.parameters()).dtype).removeprefix("torch.")


def plain_logits(llm, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return llm.model(torch.tensor([ids], device=llm.device)).logits[0, -1].float()


def test_model_and_caches_live_on_the_device(device_llm):
    llm, builder, prefix, caches = encode_setup(device_llm, DOCS)
    assert torch.device(DEVICE).type == llm.device.type
    assert caches[0].keys.device.type == llm.device.type


def test_batching_is_invisible_on_the_device(device_llm, tmp_path):
    """Each row of the padded PCED batch (from a stored cache) equals a plain forward over its own text."""
    llm = device_llm
    builder = PromptBuilder(llm.tokenizer)
    store = KVStore(tmp_path, llm, builder, "float32" if dtype_name(llm) == "float32" else "bfloat16")
    digests = store.add(DOCS, progress=False)
    experts = [Expert(f"d{i}", r, lambda d=d: store.load(d)) for i, (d, r) in enumerate(zip(digests, [0.9, 0.7, 0.5]))]
    generation = PCEDGeneration(llm, store.prefix(), experts, builder.suffix_ids(QUESTION),
                                builder.suffix_ids(QUESTION, False), RuleConfig(),
                                SamplingConfig(max_new_tokens=5, ignore_eos=True))
    per_step = [(step.token_id, generation.last_logits.float().clone()) for step in generation]
    assert len(per_step) == 5 and per_step[0][1].device.type == llm.device.type
    generated = [token for token, _ in per_step]
    rows = [builder.prompt_ids([], QUESTION)] + [builder.prompt_ids([d], QUESTION) for d in DOCS]
    tolerance = TOLERANCE[dtype_name(llm)]
    for step in (0, 4):
        for row, ids in enumerate(rows):
            diff = (per_step[step][1][row] - plain_logits(llm, ids + generated[:step])).abs().max().item()
            assert diff <= tolerance, (step, row, diff)


def test_one_expert_is_plain_greedy_on_the_device(device_llm):
    llm, builder, prefix, caches = encode_setup(device_llm, DOCS)
    tolerance = TOLERANCE[dtype_name(llm)]
    for k, doc in enumerate(DOCS):
        answer = PCEDGeneration(llm, prefix, [Expert("d", 0.8, lambda kv=caches[k]: kv)], builder.suffix_ids(QUESTION),
                                builder.suffix_ids(QUESTION, False), RuleConfig(beta=0.0, gamma=0.0),
                                SamplingConfig(max_new_tokens=8, ignore_eos=True)).answer()
        ids = builder.prompt_ids([doc], QUESTION)
        for token in answer.token_ids:  # each chosen token is the plain model's greedy choice on the same text
            reference = plain_logits(llm, ids)
            top2 = torch.topk(reference, 2).values
            if tolerance < 1e-3 or float(top2[0] - top2[1]) > tolerance:
                assert token == int(torch.argmax(reference)), (k, len(ids))
            ids = ids + [token]


def test_ape_at_T1_S1_is_concatenation_on_the_device(device_llm):
    llm, builder, prefix, caches = encode_setup(device_llm, DOCS[:2])
    for doc, kv in zip(DOCS[:2], caches):
        reference = PlainGeneration(llm, builder.prompt_ids([doc], QUESTION), SamplingConfig(max_new_tokens=1)).answer()
        ape = APEGeneration(llm, prefix, [kv], builder.suffix_ids(QUESTION), SamplingConfig(max_new_tokens=1), 1.0, 1.0)
        list(ape)
        plain = PlainGeneration(llm, builder.prompt_ids([doc], QUESTION), SamplingConfig(max_new_tokens=1))
        list(plain)
        diff = (ape.last_logits.float() - plain.last_logits.float()).abs().max().item()
        assert diff <= TOLERANCE[dtype_name(llm)], diff
        assert reference.token_ids


def test_int8_and_pooled_caches_on_the_device(device_llm, tmp_path):
    """An int8 store dequantized on the device, through the device pool, gives the same first logits as
    the same store read without a pool (exact: the same arithmetic), within int8's error of fresh ones."""
    from pced.generator import Generator
    from pced.documents import Candidate, Document
    from pced.kv.tiers import CacheTiers

    llm = device_llm
    candidates = [Candidate(Document(f"d{i}", text), 0.8) for i, text in enumerate(DOCS)]
    first = []
    for tiers in (CacheTiers(), CacheTiers(gpu_cache_gb=1.0)):
        generator = Generator(llm, "rag", tmp_path / "int8", "int8", tiers=tiers)
        generation = generator.stream(candidates, QUESTION, RuleConfig(), SamplingConfig(max_new_tokens=1))
        list(generation)
        first.append(generation.last_logits.float())
    assert torch.equal(first[0], first[1])
