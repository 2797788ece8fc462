"""The llama.cpp backend (pced.backends.llamacpp) on the embedded GGUF, as it ships.

Skipped where llama-cpp-python is not installed, except the refusals, which must hold there.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from helpers.llama_reference import llama_cpp_greedy

from pced.cli import main
from pced.documents import Candidate, Document
from pced.kv.format import CacheError
from pced.llm import ModelLoadError
from pced.backends.llamacpp.settings import LlamaSettings
from pced.options import AskOptions
from pced.text.prompts import RAG_TEMPLATE, PromptBuilder
from pced.decoding.rule import RuleConfig
from pced.decoding.sampling import SamplingConfig

DOC = ("The Tallis Observatory stands on Mount Verrin at 2,140 metres. It was founded in 1911 by the astronomer "
       "Edith Maro, whose catalogue of variable stars is still used. The secret code of the observatory is 4417-KESTREL.")
OTHER = ("Lake Ondra is a glacial lake in the north of the valley. Its water is cold all year and the village "
         "of Pell, founded by fishermen, lies on its eastern shore.")
QUESTION = "What is the secret code of the observatory?"


def _llama():
    return pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def llama_model():
    _llama()
    from pced.backends.llamacpp.model import LlamaModel

    return LlamaModel(None, LlamaSettings(threads=1))


def _store(llm, root):
    from pced.backends.llamacpp.states import StateStore

    return StateStore(root, llm, PromptBuilder(llm.tokenizer, RAG_TEMPLATE))


def _fresh_logits(llm, builder, document: str, question: str) -> torch.Tensor:
    """Encode prefix + document + question again from tokens, in the layout the rows use."""
    p, d = builder.prefix_ids, builder.encode(builder.context_text([document]))
    s = builder.suffix_ids(question)
    ctx = llm.context(len(p) + len(d) + len(s), 2)
    ctx.decode(p, range(len(p)), [0] * len(p), [False] * len(p))
    ctx.seq_cp(0, 1, 0, len(p))
    ctx.decode(d, range(len(p), len(p) + len(d)), [1] * len(d), [False] * len(d))
    start = len(p) + len(d)
    return ctx.decode(s, range(start, start + len(s)), [1] * len(s), [False] * (len(s) - 1) + [True])[0]


def _restored_logits(llm, store, document: str, question: str) -> torch.Tensor:
    from pced.backends.llamacpp.states import restore_prefix

    builder = store.builder
    state = store.load(store.add([document])[0])
    prefix = store.prefix()
    s = builder.suffix_ids(question)
    ctx = llm.context(prefix.n_tokens + state.n_tokens + len(s), 2)
    restore_prefix(ctx, prefix)
    ctx.set_state(1, state.data)
    ctx.seq_cp(0, 1, 0, prefix.n_tokens)
    start = prefix.n_tokens + state.n_tokens
    return ctx.decode(s, range(start, start + len(s)), [1] * len(s), [False] * (len(s) - 1) + [True])[0]


@pytest.mark.slow
@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
def test_restored_state_gives_the_logits_of_encoding_the_document_again(tmp_path, cache_type):
    _llama()
    from pced.backends.llamacpp.model import LlamaModel

    llm = LlamaModel(None, LlamaSettings(cache_type=cache_type, threads=1))
    store = _store(llm, tmp_path / "states")
    with llm.lock:
        restored = _restored_logits(llm, store, DOC, QUESTION)
        fresh = _fresh_logits(llm, store.builder, DOC, QUESTION)
    assert torch.isfinite(fresh).all()
    assert torch.equal(restored, fresh)  # exact: the stored bytes are the cells encoding computes
    # and a store opened again reads the same bytes (checksummed, memory-mapped)
    again = _store(llm, tmp_path / "states")
    digest = again.digests([DOC])[0]
    assert again.has(digest) and again.load(digest).n_tokens == len(store.builder.encode(store.builder.context_text([DOC])))


@pytest.mark.slow
def test_one_expert_without_contrast_is_llama_cpp_greedy(tmp_path, llama_model, monkeypatch):
    _llama()
    from pced.generator import Generator

    generator = Generator(llama_model, "rag", tmp_path / "states")
    rule = RuleConfig(beta=0.0, gamma=0.0, aggregation="max", score_space="logits")
    sampling = SamplingConfig(max_new_tokens=40)
    answer = generator.answer([Candidate(Document("obs", DOC), 0.9)], QUESTION, rule, sampling)
    assert [s.doc_id for s in answer.trace] == ["obs"] * len(answer.trace)
    prompt = generator.builder.prompt_ids([Document("obs", DOC).render()], QUESTION)
    expected = llama_cpp_greedy(llama_model, prompt, sampling.max_new_tokens, monkeypatch)
    assert len(expected) > 20 and answer.token_ids == expected


def _joined_and_from_start(model, root):
    """The next logits of an expert that joined after the answer's first tokens, and of the same
    expert present from the start (rows: amateur, OTHER, DOC)."""
    from pced.backends.llamacpp.rows import LlamaExpertRows

    store = _store(model, root)
    a, b = (store.load(d) for d in store.add([OTHER, DOC]))
    builder = store.builder
    suffix, amateur = builder.suffix_ids(QUESTION), builder.suffix_ids(QUESTION, with_context=False)
    answer = builder.encode(" The code is")

    both = LlamaExpertRows(model, store.prefix(), [lambda: a, lambda: b], suffix, amateur, 16)
    both.prefill()
    for token in answer:
        expected = both.advance(token)
    both.close()

    joined = LlamaExpertRows(model, store.prefix(), [lambda: a], suffix, amateur, 16)
    joined.reserve(256)
    joined.prefill()
    for token in answer[:-1]:
        joined.advance(token)
    joined.join(b, answer)
    got = joined.advance(answer[-1])
    joined.close()
    assert got.shape == expected.shape == (3, model.n_vocab)
    assert joined.stats["joined"] == 1
    return got, expected


@pytest.mark.slow
def test_a_joined_expert_sees_what_it_would_have_seen_from_the_start(tmp_path, llama_model):
    """Joining mid-answer catches the new row up on the suffix and the answer: its next logits are
    those of the same expert present from the start (exact: compute steps under 64 tokens give a
    row the same numbers whatever else is in the step or where its cells sit)."""
    _llama()
    got, expected = _joined_and_from_start(llama_model, tmp_path / "states")
    assert torch.equal(got, expected)


@pytest.mark.slow
def test_gpu_layers_follow_the_build_and_a_cpu_build_ignores_them(tmp_path, llama_model):
    """By default every layer goes to the GPU when llama-cpp-python was built with one, none on a CPU
    build (this one); layers asked of a CPU build stay on the CPU: the same logits."""
    lib = _llama()
    assert llama_model.gpu_layers == (-1 if lib.llama_supports_gpu_offload() else 0)
    if lib.llama_supports_gpu_offload():
        pytest.skip("a GPU build: the CPU-only half does not apply")
    from pced.backends.llamacpp.model import LlamaModel

    asked = LlamaModel(None, LlamaSettings(threads=1, gpu_layers=8))
    assert asked.gpu_layers == 8
    with llama_model.lock, asked.lock:
        expected = _fresh_logits(llama_model, _store(llama_model, tmp_path / "a").builder, DOC, QUESTION)
        got = _fresh_logits(asked, _store(asked, tmp_path / "b").builder, DOC, QUESTION)
    assert torch.equal(got, expected)


@pytest.mark.slow
def test_damaged_or_foreign_states_are_refused(tmp_path, llama_model):
    _llama()
    from pced.backends.llamacpp.model import LlamaModel

    store = _store(llama_model, tmp_path / "states")
    digest = store.add([DOC])[0]
    path = store.path_for(digest)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CacheError, match="checksum"):
        store.load(digest)
    q8 = LlamaModel(None, LlamaSettings(cache_type="q8_0", threads=1))
    with pytest.raises(CacheError, match="cache_type"):
        _store(q8, tmp_path / "states")


def test_the_backend_refuses_without_llama_cpp_python(monkeypatch):
    from pced.backends.llamacpp.model import LlamaModel

    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(ModelLoadError, match=r"pip install 'pced\[llamacpp\]'"):
        LlamaModel(None)


def test_the_backend_refuses_a_model_that_is_not_gguf(tmp_path, capsys):
    _llama()
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": "a", "text": DOC}) + "\n")
    assert main(["generate", "--docs", str(docs), "--question", QUESTION, "--backend", "llamacpp", "--model", str(fake)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a GGUF file" in err[0]


def test_llamacpp_runs_pced_only():
    with pytest.raises(ValueError, match="pced only"):
        AskOptions(backend="llamacpp", method="all")
    with pytest.raises(ValueError, match="cache type"):
        LlamaSettings(cache_type="q4_0")


@pytest.mark.slow
def test_index_and_ask_on_llamacpp(tmp_path, capsys):
    """pced index --backend llamacpp stores sequence states beside the retrieval indexes (no
    transformers caches), and pced ask --backend llamacpp --json keeps the JSON contract."""
    _llama()
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in (("obs", DOC), ("lake", OTHER))))
    store = tmp_path / "store"
    assert main(["index", str(corpus), "--out", str(store), "--backend", "llamacpp"]) == 0
    assert (store / "llamacpp-f16" / "states.json").is_file()
    assert len(list((store / "llamacpp-f16" / "seq").glob("*/*.safetensors"))) == 2
    assert not list((store / "kv").glob("*/*.safetensors"))
    capsys.readouterr()
    assert main(["ask", str(store), QUESTION, "--backend", "llamacpp", "--json", "--top-k", "2",
                 "--max-new-tokens", "16", "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"answer", "method", "experts", "trace", "beta", "timings"}
    assert {e["doc_id"] for e in out["experts"]} == {"obs", "lake"}
    assert out["answer"] == "".join(step["token"] for step in out["trace"]) != ""


def _anon_mib() -> int:
    """This process's anonymous resident memory (llama.cpp's allocations are anonymous), MiB."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("RssAnon"))


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_model_collected_or_closed_gives_llama_cpps_memory_back():
    """A model's weights and its contexts' cells live in llama.cpp's allocations, which Python's
    collector never sees: they are freed when the model is collected or closed, so a process that
    loads models in turn (a test run, a server reopening its store) does not grow by one each time."""
    import gc

    _llama()
    from pced.backends.llamacpp.model import LlamaModel

    gc.collect()
    before = _anon_mib()
    model = LlamaModel()
    model.context(8192, 8)
    held = _anon_mib() - before
    del model
    gc.collect()
    assert held > 500  # the repacked weights and a context of 8,192 cells
    assert _anon_mib() - before < held / 4
    closed = LlamaModel()
    closed.context(4096, 4)
    closed.close()
    assert closed.handle is None and closed._contexts == {}
