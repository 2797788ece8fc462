"""APE (KV-cache merging): the merged attention against hand math, and exactness at T = S = 1."""

import math

import pytest
import torch
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from pced.kv.attention import PCED_ATTENTION
from pced.backends.ape_attention import APE_ATTENTION, ape_attention_forward, ape_merged_attention, check_ape_support
from pced.methods.ape import APEGeneration, ape_from_store
from pced.methods.concat import PlainGeneration
from pced.kv.buffer import BufferCache, forward_slots
from pced.decoding.sampling import SamplingConfig
from pced.kv.store import KVStore
from pced.kv.encode import encode_documents, encode_prefix
from pced.llm import LoadedModel
from pced.text.prompts import PromptBuilder

from helpers.experts import encode_setup

pytestmark = pytest.mark.transformers_api  # models and attention transformers builds

QUESTION = "Which town was the founder born in?"
DOCS = [
    "Mira Quell founded the Zorblax company.",
    "Mira Quell was born in the town of Oskvale, which lies on the northern shore of Lake Tarnow. " * 3,
    "Oskvale is a fishing town. It has a copper-roofed harbour and " + "a long pier. " * 12,
]


@pytest.fixture(scope="module")
def setup(tiny_llm):
    return encode_setup(tiny_llm, DOCS)


# -- the attention function on random tensors -------------------------------------------------------
def hand_ape(query, key, value, visible, block, scaling, T, S):
    """Sum over slots, one query and head at a time, straight from the definition."""
    batch, heads, q_len, dim = query.shape
    groups = heads // key.shape[1]
    start, end = block
    out = torch.zeros_like(query)
    for b in range(batch):
        for h in range(heads):
            k, v = key[b, h // groups], value[b, h // groups]
            for i in range(q_len):
                num_a, den_a = torch.zeros(dim, dtype=query.dtype), 0.0
                num_b, z_b = torch.zeros(dim, dtype=query.dtype), 0.0
                for j in range(key.shape[2]):
                    if not visible[b, 0, i, j]:
                        continue
                    x = float(query[b, h, i] @ k[j]) * scaling
                    if start <= j < end:
                        z_b += math.exp(x / T)
                        num_b += math.exp(x / T) * v[j]
                    else:
                        den_a += math.exp(x)
                        num_a += math.exp(x) * v[j]
                mass_b = z_b ** (S * T)  # e^{S*T*lse_b}
                out[b, h, i] = (num_a + mass_b * num_b / z_b) / (den_a + mass_b)
    return out


def random_case(seed=0, batch=2, heads=4, kv_heads=2, q_len=3, kv_len=11, dim=8):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, q_len, dim, generator=gen, dtype=torch.float64)
    key = torch.randn(batch, kv_heads, kv_len, dim, generator=gen, dtype=torch.float64)
    value = torch.randn(batch, kv_heads, kv_len, dim, generator=gen, dtype=torch.float64)
    # the last q_len slots are the queries themselves: causal among them; hide slot 1 and slot 5 of row 1
    visible = torch.ones(batch, 1, q_len, kv_len, dtype=torch.bool)
    for i in range(q_len):
        visible[:, :, i, kv_len - q_len + i + 1 :] = False
    visible[1, :, :, 1] = False
    visible[1, :, :, 5] = False
    return query, key, value, visible


@pytest.mark.parametrize("T,S", [(1.0, 1.0), (0.9, 0.9), (0.5, 1.3)])
def test_merged_attention_matches_hand_computation(T, S):
    query, key, value, visible = random_case()
    block, scaling = (2, 7), 8**-0.5
    expected = hand_ape(query, key, value, visible, block, scaling, T, S)
    for mask in (visible, torch.zeros(visible.shape, dtype=torch.float64).masked_fill(~visible, torch.finfo(torch.float64).min)):
        got = ape_merged_attention(query, key, value, mask, block, scaling, T, S)
        assert got.dtype == torch.float64
        assert (got - expected).abs().max().item() < 1e-12


def test_T1_S1_is_one_softmax_over_every_slot():
    query, key, value, visible = random_case(seed=1)
    got = ape_merged_attention(query, key, value, visible, (1, 6), 0.3, 1.0, 1.0)
    reference = torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, 2), repeat_kv(value, 2), attn_mask=visible, scale=0.3
    )
    assert (got - reference).abs().max().item() < 1e-12
    assert (ape_merged_attention(query, key, value, visible, (1, 6), 0.3, 0.9, 0.9) - reference).abs().max().item() > 1e-3


def test_without_block_the_function_is_sdpa_exactly():
    query, key, value, visible = random_case(seed=2)
    query, key, value = query.float(), key.float(), value.float()
    mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    ours, _ = ape_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=0.25)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=0.25)
    assert torch.equal(ours, theirs)
    merged, _ = ape_attention_forward(module, query, key, value, mask, scaling=0.25, ape_block=(0, 4))
    assert merged.shape == theirs.shape == (2, 3, 4, 8)  # [B, q, H, D] like every attention function


# -- whole generations -----------------------------------------------------------------------------
def test_single_document_at_T1_S1_is_concatenation(setup):
    llm, builder, prefix, caches = setup
    for doc, kv in zip(DOCS, caches):
        reference = PlainGeneration(llm, builder.prompt_ids([doc], QUESTION), SamplingConfig(max_new_tokens=16)).answer()
        ape = APEGeneration(llm, prefix, [kv], builder.suffix_ids(QUESTION), SamplingConfig(max_new_tokens=16), 1.0, 1.0)
        answer = ape.answer()
        assert answer.token_ids == reference.token_ids and answer.token_ids
        assert answer.method == "ape" and all(step.doc_id is None for step in answer.trace)
        assert set(answer.timings) == {"cache_load_s", "ttft_s", "total_s"}
        assert answer.betas == [] and not answer.amateur_only
    # switched back after every APE forward, to pced's SDPA function (which the first forward selected)
    assert llm.model.config._attn_implementation == PCED_ATTENTION


@pytest.mark.slow
def test_single_document_at_T1_S1_is_concatenation_on_the_embedded_model(embedded_llm):
    builder = PromptBuilder(embedded_llm.tokenizer)
    prefix = encode_prefix(embedded_llm, builder.prefix_ids)
    doc = "Mira Quell was born in the town of Oskvale, which lies on the northern shore of Lake Tarnow."
    [kv] = encode_documents(embedded_llm, prefix, [builder.context_ids([doc])])
    sampling = SamplingConfig(max_new_tokens=10)
    reference = PlainGeneration(embedded_llm, builder.prompt_ids([doc], QUESTION), sampling).answer()
    answer = APEGeneration(embedded_llm, prefix, [kv], builder.suffix_ids(QUESTION), sampling, 1.0, 1.0).answer()
    assert answer.token_ids == reference.token_ids and len(answer.token_ids) >= 4


def plain_attention_over_blocks(llm, prefix, caches, suffix, tokens):
    """Reference: the same one-row cache (prefix | blocks back to back), stock SDPA, all slots visible."""
    prefix_len, lengths = prefix.n_tokens, [kv.n_tokens for kv in caches]
    slots = prefix_len + sum(lengths)
    capacity = slots + len(suffix) + len(tokens)
    cache = BufferCache.allocate(llm.model, 1, capacity)
    cache.key_buffer[:, 0, :, :prefix_len], cache.value_buffer[:, 0, :, :prefix_len] = prefix.keys, prefix.values
    cache.key_buffer[:, 0, :, prefix_len:slots] = torch.cat([kv.keys for kv in caches], dim=2)
    cache.value_buffer[:, 0, :, prefix_len:slots] = torch.cat([kv.values for kv in caches], dim=2)
    cache.set_length(slots)
    valid = torch.ones(1, capacity, dtype=torch.bool)
    start = prefix_len + max(lengths)  # positions continue after the longest document
    positions = torch.arange(start, start + len(suffix))[None]
    logits = [forward_slots(llm.model, cache, valid, torch.tensor([suffix]), positions)[0]]
    for step, token in enumerate(tokens):
        position = torch.tensor([[start + len(suffix) + step]])
        logits.append(forward_slots(llm.model, cache, valid, torch.tensor([[token]]), position)[0])
    return logits


def test_several_documents_at_T1_S1_equal_plain_attention_over_the_blocks(setup):
    llm, builder, prefix, caches = setup
    suffix = builder.suffix_ids(QUESTION)
    generation = APEGeneration(llm, prefix, caches, suffix, SamplingConfig(max_new_tokens=6), 1.0, 1.0)
    per_step = [(step.token_id, generation.last_logits[0].clone()) for step in generation]
    assert len(per_step) >= 4
    reference = plain_attention_over_blocks(llm, prefix, caches, suffix, [t for t, _ in per_step])
    for step in (0, 3):
        assert (per_step[step][1] - reference[step]).abs().max().item() <= 1e-4, step
    assert generation.stats["documents"] == 3
    assert generation.stats["context_tokens"] == prefix.n_tokens + sum(kv.n_tokens for kv in caches) + len(suffix)

    tempered = APEGeneration(llm, prefix, caches, suffix, SamplingConfig(max_new_tokens=1))  # T = S = 0.9
    list(tempered)
    assert (tempered.last_logits[0] - reference[0]).abs().max().item() > 1e-2


def test_from_store_encodes_loads_and_matches(setup, tmp_path):
    llm, builder, _, _ = setup
    store = KVStore(tmp_path, llm, builder, storage_dtype="float32")
    reference = PlainGeneration(llm, builder.prompt_ids([DOCS[0]], QUESTION), SamplingConfig(max_new_tokens=8)).answer()
    answer = ape_from_store(llm, store, [DOCS[0]], QUESTION, SamplingConfig(max_new_tokens=8), 1.0, 1.0).answer()
    assert answer.token_ids == reference.token_ids
    assert len(list((tmp_path / "kv").rglob("*.safetensors"))) == 1
    # no documents: plain attention over prefix + question, as the no-context prompt
    empty = ape_from_store(llm, store, [], QUESTION, SamplingConfig(max_new_tokens=8)).answer()
    assert empty.token_ids == PlainGeneration(llm, builder.prompt_ids([], QUESTION), SamplingConfig(max_new_tokens=8)).answer().token_ids


# -- refusals --------------------------------------------------------------------------------------
def test_refuses_other_architectures(tiny_llm):
    from transformers import GPT2Config, GPT2LMHeadModel, Gemma2Config, Qwen2Config

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32)).eval()
    llm = LoadedModel(gpt2, tiny_llm.tokenizer, "gpt2-tiny", "", "x", "y")
    prefix = encode_prefix(tiny_llm, [1, 2, 3])
    with pytest.raises(ValueError, match="'gpt2'"):
        APEGeneration(llm, prefix, [], [5, 6])
    with pytest.raises(ValueError, match="'gemma2'"):
        check_ape_support(Gemma2Config())
    with pytest.raises(ValueError, match="sliding_attention"):
        check_ape_support(Qwen2Config(use_sliding_window=True, max_window_layers=1, num_hidden_layers=2))
    check_ape_support(Qwen2Config(num_hidden_layers=2))
    check_ape_support(tiny_llm.model.config)
    assert APE_ATTENTION not in (tiny_llm.model.config._attn_implementation,)
