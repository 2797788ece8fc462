"""The static decode step (pced.kv.buffer.decode_one_token): same tokens as the eager step, writes at a
device position, and, compiled, no recompilation from one step to the next."""

from __future__ import annotations

import pytest
import torch

from pced.kv.buffer import BufferCache
from pced.methods.concat import PlainGeneration
from pced.methods.pced import Expert, PCEDGeneration
from pced.decoding.rule import RuleConfig
from pced.decoding.sampling import SamplingConfig

from helpers.experts import encode_setup

QUESTION = "Which town was the founder born in?"
DOCS = ["Mira Quell founded the Zorblax company.", "Mira Quell was born in the town of Oskvale. " * 4]


def test_a_layer_with_a_slot_writes_there_and_returns_the_whole_buffer():
    cache = BufferCache(torch.zeros(2, 3, 2, 10, 4), torch.zeros(2, 3, 2, 10, 4), length=6)
    cache.write_at(torch.tensor([6]))
    new = torch.ones(3, 2, 1, 4)
    keys, values = cache.layers[1].update(new, 2 * new)
    assert keys.shape == (3, 2, 10, 4) and keys.data_ptr() == cache.key_buffer[1].data_ptr()
    assert torch.equal(cache.key_buffer[1, :, :, 6], new[:, :, 0]) and torch.equal(cache.value_buffer[1, :, :, 6], 2 * new[:, :, 0])
    assert cache.key_buffer[1, :, :, 7:].abs().sum() == 0 and cache.key_buffer[0].abs().sum() == 0


def run(llm, builder, prefix, caches, kind, steps=10):
    llm.decode_step, llm.compiled_step = kind, None
    try:
        experts = [Expert(f"d{i}", 0.8 - 0.2 * i, lambda kv=kv: kv) for i, kv in enumerate(caches)]
        generation = PCEDGeneration(llm, prefix, experts, builder.suffix_ids(QUESTION), builder.suffix_ids(QUESTION, False),
                                    RuleConfig(), SamplingConfig(max_new_tokens=steps, ignore_eos=True))
        trace = [(step.token_id, step.winner, generation.last_logits.clone()) for step in generation]
        plain = PlainGeneration(llm, builder.prompt_ids(DOCS[:1], QUESTION),
                                SamplingConfig(max_new_tokens=steps, ignore_eos=True)).answer().token_ids
    finally:
        llm.decode_step, llm.compiled_step = "eager", None
    return trace, plain


def test_static_step_gives_the_eager_steps_tokens(tiny_llm):
    """Padded PCED rows and an unpadded plain row: same tokens and winners, logits within 1e-4
    (float32; the static step sums over more, masked, slots)."""
    setup = encode_setup(tiny_llm, DOCS)
    eager, eager_plain = run(*setup, "eager")
    static, static_plain = run(*setup, "static")
    assert [t[:2] for t in static] == [t[:2] for t in eager] and static_plain == eager_plain
    for (_, _, a), (_, _, b) in zip(static, eager):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_compiled_step_does_not_recompile_after_warm_up(tiny_llm):
    from torch._dynamo.utils import counters

    setup = encode_setup(tiny_llm, DOCS)
    eager, _ = run(*setup, "eager", steps=24)
    llm, builder, prefix, caches = setup
    llm.decode_step = "compiled"
    try:
        experts = [Expert(f"d{i}", 0.8 - 0.2 * i, lambda kv=kv: kv) for i, kv in enumerate(caches)]
        generation = PCEDGeneration(llm, prefix, experts, builder.suffix_ids(QUESTION), builder.suffix_ids(QUESTION, False),
                                    RuleConfig(), SamplingConfig(max_new_tokens=24, ignore_eos=True))
        tokens, graphs = [], []
        for step in generation:
            tokens.append(step.token_id)
            graphs.append(counters["stats"]["unique_graphs"])
    finally:
        llm.decode_step, llm.compiled_step = "eager", None
    assert tokens == [t for t, _, _ in eager]
    assert graphs[2] > 0 and graphs[-1] == graphs[2]  # compiled at the first steps, never again


def test_forwards_pass_the_cache_under_the_installed_transformers_current_name(tiny_llm):
    """No deprecated keyword: a FutureWarning (transformers >= 5.24 warns for ``past_key_values``) fails
    the prefill and the static step alike, on whichever transformers version is installed."""
    import warnings

    from pced.kv.buffer import cache_keyword, decode_one_token, forward_slots

    cache = BufferCache.allocate(tiny_llm.model, 1, 8)
    valid = torch.zeros(1, 8, dtype=torch.bool)
    valid[:, :4] = True
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        forward_slots(tiny_llm.model, cache, valid, torch.tensor([[5, 6, 7, 8]]), torch.arange(4)[None])
        cache.write_at(torch.tensor([4]))
        decode_one_token(tiny_llm.model, cache, valid, torch.tensor([[9]]), torch.tensor([[4]]), torch.tensor([4]))
    assert cache_keyword(tiny_llm.model) in ("cache", "past_key_values")
