"""pced's process on the vLLM backend holds the model's config, tokenizer and chat template, never
its weights (the engine loads its own), and loads them, once and saying so, only for what
transformers runs there. No engine starts here: the ask path is followed up to the engine and, past
it, through everything pced's process does for a question (its prompts, the store's KV named for
the engine, the rule, the stop tokens, the bench's work shape)."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import transformers

from pced.backend import get_backend
from pced.backends.transformers.bench import torch_work_shape
from pced.backends.vllm.engine import group_prompts, running_engine
from pced.backends.vllm.settings import VLLMSettings
from pced.backends.vllm.store_kv import group_params
from pced.cli import main
from pced.decoding.sampling import SamplingConfig
from pced.documents import Document
from pced.errors import UserError
from pced.options import AskOptions
from pced.store import DocumentStore, IndexSettings, index_store
from pced.text.detokenize import TextTracker

CORPUS = [
    Document("zorblax", "The Zorblax Company makes tidal clocks. It was founded by Mira Quell.", "Zorblax"),
    Document("quell", "Mira Quell was born in the town of Oskvale.", "Mira Quell"),
    Document("heron", "The grey heron is the national bird of Elumia.", "Grey heron"),
]
QUESTION = "Where was the founder of Zorblax born?"


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, tiny_llm):
    root = tmp_path_factory.mktemp("vllm-model") / "store"
    index_store(CORPUS, root, IndexSettings(model=str(tiny_llm.path), storage_dtype="float32"), llm=tiny_llm,
                progress=False)
    return root


@pytest.fixture
def causal_lms(monkeypatch):
    """Every causal LM transformers builds from now on (``post_init`` ends each model's construction)."""
    built = []
    post_init = transformers.PreTrainedModel.post_init

    def recording(model):
        post_init(model)
        if isinstance(model, transformers.GenerationMixin):
            built.append(model)

    monkeypatch.setattr(transformers.PreTrainedModel, "post_init", recording)
    return built


def with_weights(models) -> list:
    return [m for m in models if any(not p.is_meta for p in m.parameters())]


def test_the_vllm_ask_path_builds_no_model_with_weights(store_dir, causal_lms, tiny_llm, capsys):
    # the command line, up to the engine: a setting vLLM refuses stops it there, in one line
    assert main(["ask", str(store_dir), QUESTION, "--backend", "vllm", "--tensor-parallel-size", "3"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "pced: error: tensor parallel size 3 does not fit this model: vLLM splits its 4 attention heads evenly "
        "over the ranks; sizes that fit: 1, 2, 4")
    # and what pced's process does for a question around the engine
    settings = VLLMSettings()
    store = DocumentStore.open(store_dir)
    generator = store.generator_for("vllm", settings)
    llm, backend = generator.llm, generator.backend
    assert backend.refusal_for(llm, settings) is None
    candidates = store.retrieve(QUESTION, top_k=2, rerank=False)
    prompts = group_prompts(generator.builder, candidates, QUESTION)
    params = group_params(generator.caches, prompts, [None] + [c.document.render() for c in candidates])
    assert all(p["pced_store"]["digest"] for p in params[1:])  # the engine is sent to the store's caches
    options = AskOptions(backend="vllm", backend_settings=settings)
    assert options.rule(llm) is not None and llm.max_context == 2048
    assert TextTracker.for_model(llm, SamplingConfig()) is not None and llm.eos_token_ids() == tiny_llm.eos_token_ids()
    assert backend.work_shape(generator) == torch_work_shape(tiny_llm.model)  # the bench's floors, from the config
    assert len(causal_lms) == 2 and with_weights(causal_lms) == []  # the CLI's model and this store's: skeletons
    assert not llm.has_weights and llm.device.type == "cpu" and generator.caches.pool is None


def test_what_only_transformers_runs_loads_the_weights_once_and_says_so(store_dir, causal_lms, tiny_llm, capsys,
                                                                       tmp_path):
    store = DocumentStore.open(store_dir)
    llm = store.model_for("vllm", VLLMSettings())
    assert not llm.has_weights
    generator = store.generator  # a baseline method: the default backend, on the same model
    assert generator.llm is llm and llm.has_weights and llm.model.lm_head.weight.equal(tiny_llm.model.lm_head.weight)
    store.generator_for("transformers", None, None)
    assert capsys.readouterr().err.count(f"pced: loading {llm.name}'s weights into this process for the transformers "
                                         "backend") == 1
    fresh = get_backend("vllm").load_model(tiny_llm.path, VLLMSettings())
    caches = get_backend("vllm").open_caches(fresh, generator.builder, tmp_path / "requests", VLLMSettings())
    caches.add(["A document sent with a question."], progress=False)  # its KV encoded by transformers
    assert fresh.has_weights and "weights into this process to encode documents' KV caches" in capsys.readouterr().err
    assert len(with_weights(causal_lms)) == 2


def test_settings_vllm_refuses_stop_before_an_engine_starts(tiny_llm, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # it would replace the KV cache size given
    backend = get_backend("vllm")
    llm = backend.load_model(tiny_llm.path, VLLMSettings())
    for settings, message in [(VLLMSettings(tensor_parallel_size=3), "splits its 4 attention heads"),
                              (VLLMSettings(max_model_len=4096), "longer than this model's 2048-token window"),
                              (VLLMSettings(kv_cache_gb=1e-4), "cannot hold one sequence of 2048 tokens")]:
        with pytest.raises(UserError, match=message):
            backend.prepare(llm, settings)
        assert running_engine(llm.path, settings) is None


def children_while_running(process: subprocess.Popen) -> list[str]:
    """The command lines of every process ``process`` started while it ran (polled from /proc)."""
    seen: dict[int, str] = {}
    while process.poll() is None:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                if parent == process.pid and int(stat.parent.name) not in seen:
                    seen[int(stat.parent.name)] = (stat.parent / "cmdline").read_text().replace("\0", " ")
            except (OSError, ValueError, IndexError):  # a process that ended meanwhile
                continue
        time.sleep(0.05)
    return list(seen.values())


@pytest.mark.slow
def test_pced_ask_refuses_a_tensor_parallel_size_the_embedded_model_cannot_split(tmp_path, embedded_llm):
    """9 attention heads and 3 key-value heads: 2 ranks cannot split them. One line, exit 2, and no
    engine process started (the time it takes: docs/vllm.md)."""
    root = tmp_path / "store"
    index_store(CORPUS, root, IndexSettings(storage_dtype="float32"), llm=embedded_llm, progress=False)
    command = [sys.executable, "-m", "pced.cli", "ask", str(root), QUESTION, "--backend", "vllm",
               "--tensor-parallel-size", "2"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children = children_while_running(process)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 2 and out == ""
    assert err.strip().splitlines() == [
        "pced: error: tensor parallel size 2 does not fit this model: vLLM splits its 9 attention heads evenly over "
        "the ranks; sizes that fit: 1, 3, 9"]
    assert children == []
