"""pced's attention function (pced.kv.attention): exact against plain attention, no masked GQA handed
to SDPA in the layouts CUDA would run, equal logits to transformers' stock SDPA on a tiny model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import pced.kv.attention as attention
from pced.kv.attention import PCED_ATTENTION, pced_attention_forward
from pced.methods.pced import Expert, PCEDGeneration
from pced.methods.concat import PlainGeneration
from pced.decoding.rule import RuleConfig
from pced.decoding.sampling import SamplingConfig

from helpers.experts import encode_setup

pytestmark = pytest.mark.transformers_api  # models and attention transformers builds

FP32_TOLERANCE = 2e-5  # float32 attention against a float64 reference, and two float32 kernels
QUESTION = "Which town was the founder born in?"
DOCS = ["Mira Quell founded the Zorblax company.",
        "Mira Quell was born in the town of Oskvale, which lies on the northern shore of Lake Tarnow. " * 3]


class Module(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def reference(query, key, value, allowed, scaling):
    """Plain attention in float64: keys repeated per group, boolean ``allowed`` [B, 1, q, kv]."""
    groups = query.shape[1] // key.shape[1]
    key = key.double().repeat_interleave(groups, dim=1)
    value = value.double().repeat_interleave(groups, dim=1)
    scores = (query.double() @ key.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ value).transpose(1, 2)


def inputs(batch=3, heads=8, kv_heads=2, q_len=1, kv_len=40, seed=0):
    torch.manual_seed(seed)
    query = torch.randn(batch, heads, q_len, 16)
    return query, torch.randn(batch, kv_heads, kv_len, 16), torch.randn(batch, kv_heads, kv_len, 16)


def padded_allowed(batch, q_len, kv_len, seed=1):
    generator = torch.Generator().manual_seed(seed)
    valid = torch.rand(batch, kv_len, generator=generator) > 0.3
    valid[:, -q_len:] = True
    causal = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
    return valid[:, None, None, :] & causal[None, None]


@pytest.fixture(params=["cpu-layout", "cuda-layout"])
def layout(request, monkeypatch):
    """Run the function's CPU choices, and the ones it makes for CUDA tensors (same math, other layout)."""
    monkeypatch.setattr(attention, "repeats_keys_for_mask", lambda device: request.param == "cuda-layout")
    return request.param


@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("kind", ["additive", "boolean"])
def test_masked_gqa_equals_plain_attention(layout, q_len, kind):
    query, key, value = inputs(q_len=q_len)
    allowed = padded_allowed(3, q_len, 40)
    mask = allowed if kind == "boolean" else torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    out, _ = pced_attention_forward(Module(4), query, key, value, mask, scaling=0.25)
    assert out.shape == (3, q_len, 8, 16)
    torch.testing.assert_close(out.double(), reference(query, key, value, allowed, 0.25), atol=FP32_TOLERANCE, rtol=0)


@pytest.mark.parametrize("q_len", [1, 7, 40])
def test_unmasked_attention_is_causal_to_the_last_key(layout, q_len):
    """No mask (nothing padded): queries are the last q_len slots (documents after a stored prefix)."""
    query, key, value = inputs(q_len=q_len)
    allowed = padded_allowed(3, q_len, 40) | True
    allowed = allowed & (torch.arange(40)[None, :] <= torch.arange(40 - q_len, 40)[:, None])
    out, _ = pced_attention_forward(Module(4), query, key, value, None, scaling=0.25)
    torch.testing.assert_close(out.double(), reference(query, key, value, allowed, 0.25), atol=FP32_TOLERANCE, rtol=0)


class SDPACalls(TorchFunctionMode):
    """Records, for every SDPA call, whether the query and key heads differ, a mask is given, GQA is on."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            query, key = args[0], args[1]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            self.calls.append((query.shape[1] != key.shape[1], type(mask).__name__, bool(kwargs.get("enable_gqa"))))
        return func(*args, **kwargs)


def test_cuda_layouts_never_give_sdpa_a_tensor_mask_with_gqa(tiny_llm, monkeypatch):
    """On CUDA a tensor mask with GQA (enable_gqa or unequal heads) leaves only the math kernel
    (flash refuses masks, memory-efficient refuses GQA): every call of a padded PCED answer, the
    document encoder and a plain answer must avoid it."""
    monkeypatch.setattr(attention, "repeats_keys_for_mask", lambda device: True)
    with SDPACalls() as recorder:
        llm, builder, prefix, caches = encode_setup(tiny_llm, DOCS)
        experts = [Expert(f"d{i}", 0.8, lambda kv=kv: kv) for i, kv in enumerate(caches)]
        PCEDGeneration(llm, prefix, experts, builder.suffix_ids(QUESTION), builder.suffix_ids(QUESTION, False),
                       RuleConfig(), SamplingConfig(max_new_tokens=4)).answer()
        PlainGeneration(llm, builder.prompt_ids(DOCS, QUESTION), SamplingConfig(max_new_tokens=3)).answer()
    assert tiny_llm.model.config._attn_implementation == PCED_ATTENTION
    assert {"Tensor", "CausalBias", "NoneType"} <= {mask for _, mask, _ in recorder.calls}
    for unequal_heads, mask, gqa in recorder.calls:
        assert mask != "Tensor" or not (unequal_heads or gqa), recorder.calls


def stock_sdpa(monkeypatch, llm):
    """Today's path: transformers' own SDPA function (repeat_kv under a mask on transformers 5.19)."""
    monkeypatch.setattr("pced.kv.buffer.use_pced_attention", lambda model: None)
    llm.model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("padded", [True, False])
def test_logits_equal_stock_sdpa(tiny_llm, monkeypatch, padded):
    """Every step's logits of a padded PCED answer (rows of different lengths) and of an unpadded plain
    answer, pced's function against transformers' SDPA, on the tiny random model in float32."""
    llm, builder, prefix, caches = encode_setup(tiny_llm, DOCS)
    sampling = SamplingConfig(max_new_tokens=6)

    def run():
        if padded:
            experts = [Expert(f"d{i}", 0.8, lambda kv=kv: kv) for i, kv in enumerate(caches)]
            generation = PCEDGeneration(llm, prefix, experts, builder.suffix_ids(QUESTION),
                                        builder.suffix_ids(QUESTION, False), RuleConfig(), sampling)
        else:
            generation = PlainGeneration(llm, builder.prompt_ids(DOCS[:1], QUESTION), sampling)
        steps = [(step.token_id, generation.last_logits.clone()) for step in generation]
        return steps

    ours = run()
    assert llm.model.config._attn_implementation == PCED_ATTENTION
    try:
        with monkeypatch.context() as patch:
            stock_sdpa(patch, llm)
            stock = run()
    finally:
        llm.model.set_attn_implementation(PCED_ATTENTION)
    assert [t for t, _ in ours] == [t for t, _ in stock] and len(ours) >= 3
    for (_, a), (_, b) in zip(ours, stock):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_encoder_caches_equal_stock_sdpa(tiny_llm, monkeypatch):
    """Documents of different lengths encoded in one right-padded batch after the stored prefix."""
    from pced.kv.encode import encode_documents

    llm, builder, prefix, ours = encode_setup(tiny_llm, DOCS)
    with monkeypatch.context() as patch:
        stock_sdpa(patch, llm)
        stock = encode_documents(llm, prefix, [builder.context_ids([d]) for d in DOCS])
    llm.model.set_attn_implementation(PCED_ATTENTION)
    for a, b in zip(ours, stock):
        torch.testing.assert_close(a.keys, b.keys, atol=FP32_TOLERANCE, rtol=0)
        torch.testing.assert_close(a.values, b.values, atol=FP32_TOLERANCE, rtol=0)


def test_no_environment_variable_and_registration_on_use(tiny_model_dir):
    """Loading a model sets no process-wide variable; importing APE registers nothing; using it does."""
    code = (
        "import os, pced.backends.ape_attention as ape\n"
        "from transformers import AttentionInterface\n"
        "from pced.llm import load_model\n"
        "before = set(os.environ)\n"
        f"llm = load_model({str(tiny_model_dir)!r}, device='cpu', dtype='float32')\n"
        "print(sorted(set(os.environ) - before - {'HF_HUB_OFFLINE', 'TRANSFORMERS_OFFLINE', 'HF_HUB_DISABLE_PROGRESS_BARS'}))\n"
        "print(ape.APE_ATTENTION in AttentionInterface._global_mapping)\n"
        "with ape.use_ape_attention(llm.model): pass\n"
        "print(ape.APE_ATTENTION in AttentionInterface._global_mapping)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_SDPA_FORCE_GQA"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "False", "True"]


def pced_layout(prefix, lengths, suffix, amateur_pad, generated):
    """PCED's validity: row 0 the amateur (prefix, its suffix left-padded), row k prefix + document k
    (padded to the longest) + suffix, then the generated slots; [B, kv] boolean, and each row's
    (end, resume) as the rows record it."""
    longest = max(lengths)
    valid = torch.zeros(len(lengths) + 1, prefix + longest + suffix + generated, dtype=torch.bool)
    valid[:, :prefix] = True
    for row, length in enumerate([0] + list(lengths)):
        valid[row, prefix : prefix + length] = True
    valid[:, prefix + longest :] = True
    valid[0, prefix + longest : prefix + longest + amateur_pad] = False
    layout = [(prefix, prefix + longest + amateur_pad)] + [(prefix + n, prefix + longest) for n in lengths]
    return valid, layout


@pytest.mark.parametrize("lengths,amateur_pad,prefix", [
    ([24, 24, 24], 2, 6),       # equal documents: the amateur's document slots are the only gap
    ([3, 30, 12, 30], 0, 6),    # mixed lengths: runs of one row, and two rows of the longest
    ([5, 9], 3, 0),             # no prefix: the amateur has no keys before its suffix
])
@pytest.mark.parametrize("kind", ["additive", "boolean"])
def test_attention_by_each_rows_own_length_equals_plain_attention(monkeypatch, lengths, amateur_pad, prefix, kind):
    """The decode step over each row's own keys (runs of rows over [0, end), one call over the shared
    tail, masked where a row resumes later, joined by log-sum-exp) against float64 attention over the
    padded batch."""
    monkeypatch.setattr(attention, "SEGMENTED_MIN_SKIPPED_SHARE", 0.0)
    valid, layout = pced_layout(prefix, lengths, 5, amateur_pad, 3)
    batch, kv_len = valid.shape
    query, key, value = inputs(batch=batch, kv_len=kv_len)
    allowed = valid[:, None, None, :]
    mask = allowed if kind == "boolean" else torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    assert attention.row_spans(layout, batch, kv_len) is not None  # the path under test is taken
    out, _ = pced_attention_forward(Module(4), query, key, value, mask, scaling=0.25, **{attention.ROW_LAYOUT: layout})
    torch.testing.assert_close(out.double(), reference(query, key, value, allowed, 0.25), atol=FP32_TOLERANCE, rtol=0)


def test_attention_by_row_length_is_chosen_only_when_it_skips_enough():
    valid, layout = pced_layout(8, [40] * 6, 5, 0, 1)  # only the amateur's document slots are masked: 14%
    assert attention.row_spans(layout, *valid.shape) is None
    valid, layout = pced_layout(8, [40, 2, 3, 4, 5, 6], 5, 0, 1)  # mostly padding
    spans = attention.row_spans(layout, *valid.shape)
    assert spans is not None and spans[0] == 8 + 40 and len(spans[1]) == 7 and spans[2]


def test_rows_whose_keys_never_resume_keep_one_call():
    """Every row's keys one run from slot 0 (nothing after the cursor): no tail to join, so no empty
    key range reaches the kernel."""
    assert attention.row_spans([(4, 12), (4, 12), (4, 12)], 3, 12) is None


def test_a_pced_answer_by_each_rows_own_length_equals_one_masked_call(tiny_llm, monkeypatch):
    """Documents of very different lengths on the tiny model: same tokens, logits within 1e-4 (two
    float32 attention kernels, summed in a different order)."""
    docs = DOCS + ["Oskvale.", "Lake Tarnow freezes every winter. " * 5]
    llm, builder, prefix, caches = encode_setup(tiny_llm, docs)

    def run(share):
        monkeypatch.setattr(attention, "SEGMENTED_MIN_SKIPPED_SHARE", share)
        experts = [Expert(f"d{i}", 0.8 - 0.1 * i, lambda kv=kv: kv) for i, kv in enumerate(caches)]
        generation = PCEDGeneration(llm, prefix, experts, builder.suffix_ids(QUESTION),
                                    builder.suffix_ids(QUESTION, False), RuleConfig(),
                                    SamplingConfig(max_new_tokens=8, ignore_eos=True))
        return [(step.token_id, step.winner, generation.last_logits.clone()) for step in generation]

    calls = []
    segmented = attention.segmented_decode
    monkeypatch.setattr(attention, "segmented_decode", lambda *args: calls.append(1) or segmented(*args))
    by_row = run(0.0)
    assert len(calls) == 2 * 7  # both layers of every decode step (8 tokens: the prefill gives the first)
    one_call = run(2.0)
    assert len(calls) == 2 * 7 and [t[:2] for t in by_row] == [t[:2] for t in one_call]
    for (_, _, a), (_, _, b) in zip(by_row, one_call):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
