"""Shared fixtures: a tiny random Llama built by the tests (exactness) and the embedded model (integration)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# with pytest-xdist (the README's test command: -n 2) the workers share the machine's cores
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // WORKERS)))

REPO_ROOT = Path(__file__).resolve().parents[1]


# Fixtures whose value transformers builds (a model, a tokenizer): a test that asks for one, directly or
# through another fixture, depends on transformers' API.
TRANSFORMERS_FIXTURES = {"embedded_tokenizer_dir", "tiny_model_dir", "tiny_llm", "embedded_llm"}


# The vLLM test modules: one worker runs them one after another, first (they start engines: at its peak
# the comparison's four engines and their processes hold about 11 GB beside the test processes).
ENGINES = "vllm-engines"


def pytest_collection_modifyitems(config, items):
    """A test that asks for the embedded model is in the slow lane whether or not it says so; a test that
    asks for a model or tokenizer transformers builds is marked ``transformers_api`` (the lanes on both
    ends of the transformers range run those: ``.ci/run``). The tests that start vLLM engines go first."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if "embedded_llm" in fixtures and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
        if fixtures & TRANSFORMERS_FIXTURES and item.get_closest_marker("transformers_api") is None:
            item.add_marker(pytest.mark.transformers_api)
    items.sort(key=lambda item: not _engines(item.nodeid))  # stable: the longest unit is scheduled first


def _engines(nodeid: str) -> bool:
    return Path(nodeid.split("::", 1)[0]).name.startswith("test_vllm_")


if importlib.util.find_spec("xdist") is not None:
    def pytest_xdist_make_scheduler(config, log):
        """pytest-xdist's workers take whole modules (a module's fixtures are built once), and every
        vLLM test module goes to one worker, as one unit."""
        from xdist.scheduler import LoadScopeScheduling

        class ModuleScheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return ENGINES if _engines(nodeid) else nodeid.split("::", 1)[0]

        return ModuleScheduling(config, log)


@pytest.fixture(scope="session")
def embedded_tokenizer_dir() -> Path:
    """The embedded model's folder, or PCED_TEST_TOKENIZER: a folder of its tokenizer files alone
    (a GPU machine without the embedded model's package: scripts/gpu_kit.sh)."""
    if os.environ.get("PCED_TEST_TOKENIZER"):
        return Path(os.environ["PCED_TEST_TOKENIZER"])
    from pced.llm import embedded_model_dir

    return embedded_model_dir()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir) -> Path:
    """A 2-layer random Llama (GQA, the embedded model's tokenizer and chat template), saved locally."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(embedded_tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.2,  # peaky logits: greedy choices are not decided by rounding
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir):
    from pced.llm import load_model

    return load_model(tiny_model_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def embedded_llm():
    from pced.llm import load_model

    return load_model(device="cpu", dtype="float32")
