"""The CPU fast path (pced.llm's oneDNN-packed linear layers, pced.kv.buffer's reused batch buffer)
against the plain path on the tiny random Llama.

Tolerance: the packed products sum each dot product in another order than MKL's plain ones, so
they agree to float32 rounding, not bit for bit: 1e-4 on the tiny model's logits (they reach ~10,
float32's spacing there is ~1e-6, and two layers' worth of reordered sums stay well inside), the
bound the batching tests use for the same reason. Greedy tokens and winners must be identical (the
tiny model's logits are peaky: no choice is decided by rounding)."""

from __future__ import annotations

import gc

import pytest
import torch

from pced.backends.transformers.bench import weight_bytes
from pced.kv.buffer import BufferCache, SpareBuffer
from pced.llm import OneDNNLinear, choose_linear_kernel, load_model, onednn_linear_refusal
from pced.methods.pced import Expert, PCEDGeneration
from pced.decoding.rule import RuleConfig
from pced.decoding.sampling import SamplingConfig

from helpers.experts import encode_setup

QUESTION = "Which town was the founder born in?"
DOCS = ["Mira Quell founded the Zorblax company.", "Mira Quell was born in the town of Oskvale. " * 6,
        "Oskvale is a fishing town on the coast."]
TOLERANCE = 1e-4

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


@pytest.fixture
def llm(tiny_model_dir):
    """A model of its own: the tests switch its kernels."""
    return load_model(tiny_model_dir, device="cpu", dtype="float32", linear_kernel="plain")


def answer(llm, builder, prefix, caches, steps=12):
    experts = [Expert(f"d{i}", 0.8 - 0.2 * i, lambda kv=kv: kv) for i, kv in enumerate(caches)]
    generation = PCEDGeneration(llm, prefix, experts, builder.suffix_ids(QUESTION), builder.suffix_ids(QUESTION, False),
                                RuleConfig(), SamplingConfig(max_new_tokens=steps, ignore_eos=True))
    return [(step.token_id, step.winner, generation.last_logits.clone()) for step in generation]


@needs_onednn
def test_packed_linear_layers_give_the_plain_paths_tokens_and_logits_within_float32_rounding(llm):
    _, builder, prefix, caches = encode_setup(llm, DOCS)
    plain = answer(llm, builder, prefix, caches)
    choose_linear_kernel(llm, "onednn")
    assert llm.linear_kernel == "onednn" and all(type(m) is OneDNNLinear for m in llm.model.modules()
                                                   if isinstance(m, torch.nn.Linear))
    packed_product, calls = torch.ops.mkldnn._linear_pointwise, []

    def counted(*args):
        calls.append(args[1].shape)
        return packed_product(*args)

    torch.ops.mkldnn._linear_pointwise = counted
    try:
        fast = answer(llm, builder, prefix, caches)
    finally:
        torch.ops.mkldnn._linear_pointwise = packed_product
    assert len(calls) == 15 * len(fast)  # 2 layers x 7 linear layers + the output layer, in every forward
    assert [t[:2] for t in fast] == [t[:2] for t in plain]
    for (_, _, a), (_, _, b) in zip(fast, plain):
        torch.testing.assert_close(a, b, atol=TOLERANCE, rtol=0)


@needs_onednn
def test_packing_leaves_the_model_as_its_users_see_it_and_unpacking_restores_the_plain_products(llm):
    ids = torch.tensor([[5, 17, 230, 4, 99, 12]])
    with torch.inference_mode():
        before = llm.model(input_ids=ids).logits
    params, state, size = list(llm.model.parameters()), llm.model.state_dict(), weight_bytes(llm.model)
    choose_linear_kernel(llm, "onednn")
    assert list(llm.model.parameters()) == params and llm.model.state_dict().keys() == state.keys()
    assert weight_bytes(llm.model) == size
    with torch.inference_mode():
        packed = llm.model(input_ids=ids).logits
    torch.testing.assert_close(packed, before, atol=TOLERANCE, rtol=0)
    # autograd (a gradient wanted) takes the plain product: bit for bit the plain model's logits
    assert torch.equal(llm.model(input_ids=ids).logits.detach(), before)
    choose_linear_kernel(llm, "plain")
    assert not any(type(m) is OneDNNLinear for m in llm.model.modules())
    with torch.inference_mode():
        assert torch.equal(llm.model(input_ids=ids).logits, before)


def test_auto_packs_on_the_cpus_it_was_measured_on_and_says_why_not_elsewhere(tiny_model_dir):
    llm = load_model(tiny_model_dir, device="cpu", dtype="float32")
    refusal = onednn_linear_refusal(llm.model)
    capability = torch.backends.cpu.get_cpu_capability()
    if torch.backends.mkldnn.is_available() and capability in ("AVX2", "AVX512"):
        assert refusal is None and llm.linear_kernel == "onednn"
    else:
        assert refusal and llm.linear_kernel == "plain" and llm.linear_reason == refusal
    half = load_model(tiny_model_dir, device="cpu", dtype="bfloat16")
    assert half.linear_kernel == "plain" and "bfloat16" in half.linear_reason
    compiled = load_model(tiny_model_dir, device="cpu", dtype="float32", decode_step="compiled")
    assert compiled.linear_kernel == "plain"  # inductor packs for itself


def test_a_second_question_writes_into_the_first_ones_buffer_with_the_same_logits(llm):
    """The reused memory holds another question's keys, not zeros: every slot a query reads is written
    first, so the answer is bit for bit the one from fresh memory."""
    _, builder, prefix, caches = encode_setup(llm, DOCS)
    spare = SpareBuffer.of(llm.model)
    spare.drop()
    fresh = answer(llm, builder, prefix, caches)
    gc.collect()
    assert spare.nbytes > 0  # the answer's buffer came back once nothing referenced it
    memory = spare._flat.data_ptr()
    answer(llm, builder, prefix, caches[::-1][:2])  # other rows, other lengths: stale keys everywhere
    again = answer(llm, builder, prefix, caches)
    gc.collect()
    assert spare._flat.data_ptr() == memory  # both answers ran in the first one's memory
    assert [(t, w) for t, w, _ in again] == [(t, w) for t, w, _ in fresh]
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(again, fresh))


def test_a_buffer_with_a_view_still_alive_is_not_handed_out_again(llm):
    spare = SpareBuffer.of(llm.model)
    spare.drop()
    cache = BufferCache.allocate(llm.model, 2, 16, zero=False, reuse=True)
    view = cache.key_buffer[:, 0]
    del cache
    gc.collect()
    cache = BufferCache.allocate(llm.model, 2, 16, zero=False, reuse=True)
    memory = cache.key_buffer.data_ptr()
    assert view.data_ptr() != memory  # a view outlived its cache: that memory is not lent again
    del cache
    gc.collect()
    smaller = BufferCache.allocate(llm.model, 1, 8, zero=False, reuse=True)
    assert smaller.key_buffer.data_ptr() == memory
