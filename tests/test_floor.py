"""Random-weight models of named shapes, and the weights and keys and values a torch model's decode step reads."""

import json

import pytest
import torch

from pced.backends.transformers.bench import kv_bytes_per_token, weight_bytes
from pced.bench.machine import memory_bandwidth
from pced.bench.random_model import SHAPES, random_model, shape_of

from helpers.cli import run_pced


def test_the_floor_counts_weights_once_and_each_rows_keys_and_values():
    llm = random_model("tiny", device="cpu", dtype="float32")
    config = llm.model.config
    assert llm.model.config.vocab_size == len(llm.tokenizer)  # the vocabulary follows the tokenizer
    hidden, inter, layers, vocab = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    head_dim, kv_heads = hidden // config.num_attention_heads, config.num_key_value_heads
    per_layer = hidden * hidden * 2 + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter + 2 * hidden
    untied = layers * per_layer + hidden + vocab * hidden  # the input embedding is not read whole by a step
    assert weight_bytes(llm.model) == 4 * untied
    assert kv_bytes_per_token(llm.model) == 2 * layers * kv_heads * head_dim * 4
    tied = random_model("smollm2-135m", device="cpu", dtype="bfloat16")
    assert tied.model.lm_head.weight.data_ptr() == tied.model.model.embed_tokens.weight.data_ptr()
    assert weight_bytes(tied.model) == 2 * sum(p.numel() for p in tied.model.parameters())  # tied: read once
    assert sum(p.numel() for p in tied.model.parameters()) == pytest.approx(134.5e6, rel=1e-3)  # SmolLM2-135M's count
    assert memory_bandwidth(torch.device("cpu"), megabytes=16, repeats=3) > 1e8


def test_a_random_model_decodes_finite_logits_with_real_rotary_frequencies():
    llm = random_model("tiny", device="cpu", dtype="float32", seed=3)
    again = random_model("tiny", device="cpu", dtype="float32", seed=3)
    rotary = llm.model.model.rotary_emb.inv_freq
    assert rotary.dtype == torch.float32 and rotary[0] == 1.0 and bool((rotary[1:] < rotary[:-1]).all())
    with torch.inference_mode():
        logits = llm.model(torch.tensor([[1, 2, 3]])).logits
        assert bool(torch.isfinite(logits).all())
        assert torch.equal(logits, again.model(torch.tensor([[1, 2, 3]])).logits)  # seeded


def test_shapes_by_name_or_json_and_a_clear_error_otherwise(tmp_path):
    assert shape_of("llama-3.1-8b")[1]["num_key_value_heads"] == 8 and "tiny" in SHAPES
    config = tmp_path / "mini.json"
    config.write_text(json.dumps({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                  "num_attention_heads": 2, "num_key_value_heads": 1}))
    assert shape_of(str(config)) == ("mini", json.loads(config.read_text()))
    with pytest.raises(ValueError, match="neither a known shape"):
        shape_of("llama-9000")


def test_the_peer_script_rebuilds_the_benchs_random_model_weight_for_weight(tmp_path):
    """experiments/peer_langchain_pced.py times the authors' implementation in its own environment on
    the model the bench timed ours on: from peer_inputs.json it must rebuild the very same weights."""
    import importlib.util
    from pathlib import Path

    from pced.bench.run import peer_inputs
    from pced.bench.config import BenchConfig

    script = Path(__file__).resolve().parents[1] / "experiments" / "peer_langchain_pced.py"
    spec = importlib.util.spec_from_file_location("peer_langchain_pced", script)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    ours = random_model("tiny", device="cpu", dtype="float32", seed=BenchConfig().seed)
    model_spec = peer_inputs(ours, BenchConfig(), [])["model"]
    assert model_spec["dir"] is None and model_spec["random_config"]["hidden_size"] == 64
    theirs = peer.build_model(json.loads(json.dumps(model_spec)), "sdpa", "cpu")
    mine = dict(ours.model.named_parameters())
    assert sorted(mine) == sorted(dict(theirs.named_parameters()))
    assert all(torch.equal(mine[name], param) for name, param in theirs.named_parameters())
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.inference_mode():
        assert torch.equal(ours.model(ids).logits, theirs(ids).logits)


@pytest.mark.slow
def test_bench_measures_each_methods_memory_in_a_fresh_interpreter(tmp_path):
    """The memory runs (on by default, off in every other bench test): each probe is a child
    interpreter that imports the probe, loads the embedded model and answers once."""
    out = tmp_path / "bench"
    result = run_pced("bench", "--ks", "1", "--doc-tokens", "32", "--methods", "pced", "--repeats", "1", "--new-tokens", "2",
                      "--long-new-tokens", "0", "--storage-dtypes", "", "--no-cold", "--no-resident", "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    memory, = json.loads((out / "bench.json").read_text())["memory"]
    assert "error" not in memory, memory
    assert memory["method"] == "pced" and memory["k"] == 1
    assert 0 < memory["before_answer_rss_mb"] <= memory["answer_peak_rss_mb"] and memory["peak_rss_mb"] > 0
