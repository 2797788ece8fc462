"""How pced starts a vLLM engine: settings by platform, every one settable from the command line,
the CPU build's ranks on cores of their own, and the processor class picked by asking vLLM's own
engine configuration which model runner it will use."""

import argparse
import importlib.util
import json

import pytest

from pced.cli.common import InputError, add_backend_options, backend_settings_from
from pced.backends.vllm.settings import VLLMSettings


def parse(*argv: str) -> VLLMSettings:
    parser = argparse.ArgumentParser()
    add_backend_options(parser)
    return backend_settings_from(parser.parse_args(["--backend", "vllm", *argv]))


def test_platform_defaults_fill_only_what_is_left_unset():
    cuda, cpu = VLLMSettings().for_platform(cuda=True), VLLMSettings().for_platform(cuda=False)
    assert (cuda.dtype, cuda.enforce_eager, cuda.max_model_len) == ("auto", False, 16384) and cuda.gpu_memory_utilization > 0.5
    assert (cpu.dtype, cpu.enforce_eager, cpu.max_model_len, cpu.gpu_memory_utilization) == ("float32", True, None, 0.3)
    mine = VLLMSettings(dtype="float16", enforce_eager=True, gpu_memory_utilization=0.5).for_platform(cuda=True)
    assert (mine.dtype, mine.enforce_eager, mine.gpu_memory_utilization) == ("float16", True, 0.5)


def test_every_engine_setting_comes_from_the_command_line():
    assert parse() == VLLMSettings()
    got = parse("--vllm-dtype", "bfloat16", "--no-enforce-eager", "--max-model-len", "4096", "--max-num-batched-tokens",
                "8192", "--gpu-memory-utilization", "0.7", "--max-num-seqs", "64")
    assert got == VLLMSettings(dtype="bfloat16", enforce_eager=False, max_model_len=4096, max_num_batched_tokens=8192,
                               gpu_memory_utilization=0.7, max_num_seqs=64)
    assert parse("--enforce-eager").enforce_eager is True


def test_tensor_parallelism_and_chunked_prefill_come_from_the_command_line():
    assert parse("--tensor-parallel-size", "2").tensor_parallel_size == 2
    assert VLLMSettings().enable_chunked_prefill is None  # per runner: engine_plan
    with pytest.raises(InputError, match="at least 1"):
        parse("--tensor-parallel-size", "0")


def test_cpu_shares_give_each_rank_its_own_cores():
    from pced.backends.vllm.cpu import cpu_shares

    assert cpu_shares([0, 1], 2) == "0|1"
    assert cpu_shares([0, 1, 2, 3, 4], 2) == "0,1|2,3"
    assert cpu_shares([0, 1], 3) == "0|1|0"  # fewer CPUs than ranks: they take turns


def test_the_store_connector_and_the_kv_cache_size_come_from_the_command_line():
    assert parse().store_kv is None and parse("--store-kv").store_kv is True and parse("--no-store-kv").store_kv is False
    assert parse("--kv-cache-gb", "0.5").engine_args()["kv_cache_memory_bytes"] == 2**29
    assert "store_kv" not in parse().engine_args() and "kv_cache_memory_bytes" not in parse().engine_args()
    with pytest.raises(InputError, match="kv_cache_gb"):
        parse("--kv-cache-gb", "0")


def test_a_users_connector_replaces_the_stores_and_with_store_kv_the_store_is_chained_after_it(tmp_path):
    from pced.backends.vllm.store_kv import tiered_config

    own = tmp_path / "kv.json"
    lmcache = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    own.write_text(json.dumps(lmcache))
    assert parse("--kv-transfer-config", str(own)).engine_args()["kv_transfer_config"] == lmcache
    assert parse("--kv-transfer-config", str(own), "--no-store-kv").engine_args()["kv_transfer_config"] == lmcache
    assert parse("--kv-transfer-config", str(own), "--store-kv").engine_args()["kv_transfer_config"] == \
        tiered_config(lmcache)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_the_runner_is_asked_of_vllm_and_cuda_caps_the_window_and_the_prefill_budget(tiny_model_dir, monkeypatch, tmp_path):
    """On this CPU vLLM picks the V1 runner (no Triton: config/vllm.py:724-728); the plan says so, from
    the configuration vLLM builds. As CUDA would resolve it: the model's dtype, CUDA graphs, and the
    window capped at the model's own (2048 here, under the 16k cap), which bounds the prefill budget."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    from vllm.config import KVTransferConfig

    from pced.backends.vllm.engine import engine_plan
    from pced.backends.vllm.store_kv import connector_config

    args, v2 = engine_plan(str(tiny_model_dir), VLLMSettings())
    probe = {**args, "kv_transfer_config": KVTransferConfig(**args["kv_transfer_config"])}
    assert v2 is False and v2 == EngineArgs(**probe).create_engine_config().use_v2_model_runner
    assert args["kv_transfer_config"] == connector_config()  # pced's store connector, by default
    assert "kv_transfer_config" not in engine_plan(str(tiny_model_dir), VLLMSettings(store_kv=False))[0]
    own = tmp_path / "kv.json"  # a user's own connector replaces pced's (an engine takes one)
    own.write_text(json.dumps({"kv_connector": "ExampleConnector", "kv_role": "kv_both"}))
    assert engine_plan(str(tiny_model_dir), VLLMSettings(kv_transfer_config=str(own)))[0]["kv_transfer_config"] == \
        {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}
    assert (args["dtype"], args["enforce_eager"], args["gpu_memory_utilization"]) == ("float32", True, 0.3)
    assert args["logprobs_mode"] == "processed_logits"  # the trace's channel (channel.py)
    assert args["enable_chunked_prefill"] is False  # the V1 runner: whole prefills
    assert "max_model_len" not in args and "max_num_batched_tokens" not in args
    monkeypatch.setattr(type(current_platform), "is_cuda_alike", lambda self: True)
    args, _ = engine_plan(str(tiny_model_dir), VLLMSettings())
    assert (args["dtype"], args["enforce_eager"]) == ("auto", False)
    assert args["max_model_len"] == 2048 and args["max_num_batched_tokens"] == 2048
    args, _ = engine_plan(str(tiny_model_dir), VLLMSettings(max_model_len=1024, max_num_batched_tokens=1536))
    assert args["max_model_len"] == 1024 and args["max_num_batched_tokens"] == 1536


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_settings_vllm_refuses_are_one_user_error(embedded_llm):
    """A KV cache too small for one sequence of the model's window: vLLM's own check, said in one line
    (its engine process logs vLLM's reason; pced's one line points at it)."""
    from pced.backends.vllm.engine import VLLMEngine
    from pced.errors import UserError

    with pytest.raises(UserError, match="vLLM's engine failed to start; its reason is the error vLLM logged above"):
        VLLMEngine(embedded_llm.path, VLLMSettings(kv_cache_gb=0.01))
