"""The bench's floors: each backend's bytes and FLOPs against a hand count, the floor's binding term,
this machine's limits measured once and cached, and the ratios in the bench's JSON."""

import json
import os

import numpy as np
import pytest
import torch

from pced.backend import WorkShape
from pced.backends.llamacpp.bench import gguf_work_shape, kv_element_bytes
from pced.backends.transformers.bench import torch_work_shape
from pced.bench.floors import (Floor, RowSpan, decode_attended, decode_floor, decode_work, gemm_shapes, prefill_work,
                               ttft_floor)
from pced.bench.machine import (MachineLimits, cache_path, describe, gemm_name, gpu_name, machine_key, machine_limits)
from pced.bench.random_model import random_model

from helpers.cli import run_pced

# the tiny random model: hidden 64, intermediate 128, 2 layers, 4 query heads and 2 KV heads of 16, vocabulary 49,152
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 128, 2, 4, 2, 16, 49152
LAYER_MATMULS = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 64 * 128 + 64 * 128 + 128 * 64  # q k v o gate up down = 36,864
OUTPUT = 64 * 49152  # 3,145,728


def test_the_tiny_random_models_work_against_a_hand_count():
    shape = torch_work_shape(random_model("tiny", device="cpu", dtype="float32").model)
    assert (shape.layers, shape.heads, shape.key_dim, shape.value_dim) == (LAYERS, HEADS, HEAD_DIM, HEAD_DIM)
    assert shape.matmul_params == 2 * 36_864 + 3_145_728 == 3_219_456 and shape.output_params == OUTPUT
    # fp32; the untied input embedding is only looked up; two norms a layer and the final one are read
    assert shape.weight_bytes == 4 * (2 * (36_864 + 2 * 64) + 64 + 3_145_728) == 12_879_104
    assert shape.kv_bytes_per_cell == 2 * LAYERS * KV_HEADS * HEAD_DIM * 4 == 512
    assert shape.matrices == ((64, 32), (64, 64), (64, 128), (128, 64)) and shape.output == (64, VOCAB)
    assert shape.gemm_dtype == "float32"

    spans = [RowSpan(10, 3), RowSpan(20, 5)]  # rows from 10 and 20 cells, prefilling 3 and 5 tokens
    attended = decode_attended(spans, new_tokens=4)  # 13 + 4/2, 25 + 4/2
    assert attended == [15, 27]
    data, flops = decode_work(shape, attended)
    # weights once + 42 cells of keys and values; 2 FLOPs a weight a row + 2 * 2 layers * 4 heads * (16 + 16) a cell
    assert data == 12_879_104 + 512 * 42 == 12_900_608
    assert flops == 2 * 3_219_456 * 2 + 512 * 42 == 12_899_328
    data, flops = prefill_work(shape, spans)
    # 8 tokens through the layers, the output layer at each row's last token only; token i of a row from s
    # attends s + i + 1 cells: 3 * 10 + 6 and 5 * 20 + 15 = 151 (query, cell) pairs
    assert data == 12_879_104 + 512 * (13 + 25) == 12_898_560
    assert flops == 2 * 73_728 * 8 + 2 * OUTPUT * 2 + 512 * 151 == 13_839_872
    assert gemm_shapes(shape, spans) == sorted({(2, 64, VOCAB)} | {(rows, i, o) for rows in (2, 8) for i, o in shape.matrices})


def _write_gguf(path, tied: bool) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((16, 32), dtype=np.float32))  # 16 tokens of 32
    if not tied:
        writer.add_tensor("output.weight", rng.standard_normal((16, 32)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((32, 32), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_k.weight", rng.standard_normal((16, 32)).astype(np.float16))  # 32 -> 16
    writer.add_tensor("blk.0.attn_v.weight", rng.standard_normal((16, 32)).astype(np.float16))
    writer.add_tensor("blk.0.attn_output.weight", rng.standard_normal((32, 32), dtype=np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_s_work_from_its_header_against_a_hand_count(tmp_path):
    _write_gguf(tmp_path / "untied.gguf", tied=False)
    shape = gguf_work_shape(tmp_path / "untied.gguf", "f16")
    # q: Q8_0, 1,024 weights in 32 blocks of 34 bytes; k, v: f16 512 each; o: f32 1,024; norm: 32 f32;
    # output: f16 16 x 32; the untied input embedding (f32 16 x 32) is not read by a step
    assert shape.weight_bytes == 32 * 34 + 2 * 512 * 2 + 1024 * 4 + 32 * 4 + 512 * 2 == 8384
    assert shape.matmul_params == 1024 + 512 + 512 + 1024 + 512 and shape.output_params == 512
    assert (shape.layers, shape.heads, shape.key_dim, shape.value_dim) == (1, 2, 16, 16)
    assert shape.kv_bytes_per_cell == 1 * 1 * (16 + 16) * 2  # f16 keys and values of the one KV head
    assert gguf_work_shape(tmp_path / "untied.gguf", "q8_0").kv_bytes_per_cell == 32 * 34 / 32
    assert kv_element_bytes("q8_0") == 34 / 32 and kv_element_bytes("f16") == 2
    assert shape.matrices == ((32, 16), (32, 32)) and shape.output == (32, 16)
    assert "Q8_0" in shape.described_as and "F16" in shape.described_as
    _write_gguf(tmp_path / "tied.gguf", tied=True)
    tied = gguf_work_shape(tmp_path / "tied.gguf", "f16")
    assert tied.weight_bytes == 32 * 34 + 2 * 512 * 2 + 1024 * 4 + 32 * 4 + 512 * 4 == 9408  # the embedding is the output layer
    assert tied.output_params == 512 and tied.output == (32, 16)


def test_the_embedded_ggufs_work_is_smollm2_135m_in_q4_1():
    from pced.llm import _embedded_gguf

    shape = gguf_work_shape(_embedded_gguf(), "f16")
    per_layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536  # 3,538,944 weights, Q4_1: 20 bytes a block of 32
    assert shape.matmul_params == 30 * per_layer + 576 * 49152
    # 30 layers of Q4_1 matrices and two f32 norms, the Q8_0 embedding (tied: it is the output layer), the final norm
    assert shape.weight_bytes == 30 * (per_layer * 20 // 32 + 2 * 576 * 4) + 576 * 49152 * 34 // 32 + 576 * 4
    assert shape.kv_bytes_per_cell == 30 * 3 * 128 * 2 == 23_040  # the transformers fp16 store holds as many


def _shape(**fields) -> WorkShape:
    base = dict(weight_bytes=1000, matmul_params=100, output_params=10, layers=1, heads=1, key_dim=1, value_dim=1,
                kv_bytes_per_cell=10.0, matrices=((10, 9),), output=(10, 1))
    return WorkShape(**{**base, **fields})


def test_the_floor_is_its_binding_term_and_the_first_token_adds_the_read():
    shape = _shape()
    # decode, one row of 8 cells: 1,080 bytes; 2 * 100 + 2 * 1 * 1 * 2 * 8 = 232 FLOPs
    memory_bound = decode_floor(shape, [8], bandwidth=1000.0, peak=1e6)
    assert (memory_bound.bytes, memory_bound.flops) == (1080, 232)
    assert memory_bound.bound == "memory" and memory_bound.floor_s == memory_bound.memory_s == 1.08
    compute_bound = decode_floor(shape, [8], bandwidth=1e9, peak=100.0)
    assert compute_bound.bound == "compute" and compute_bound.floor_s == compute_bound.compute_s == 2.32
    ttft = ttft_floor(shape, [RowSpan(4, 2)], cache_bytes=500, bandwidth=1e9, peak=100.0, page_cache=1000.0)
    # 2 * 90 * 2 + 2 * 10 * 1 + 4 * (2 * 4 + 3) = 424 FLOPs
    assert ttft.flops == 424 and ttft.read_s == 0.5 and ttft.floor_s == pytest.approx(0.5 + 4.24)
    assert ttft_floor(shape, [RowSpan(4, 2)], 0, 1e9, 100.0, 1000.0).floor_s == pytest.approx(4.24)  # resident
    assert isinstance(ttft, Floor) and ttft.to_json()["bound"] == "compute"


def test_the_machine_limits_are_measured_once_cached_per_key_and_remeasured_on_request(tmp_path, monkeypatch):
    monkeypatch.setenv("PCED_CACHE_DIR", str(tmp_path))
    small = dict(copy_megabytes=8, file_megabytes=8, progress=False)
    first = machine_limits("cpu", [(3, 16, 8)], **small)
    path = cache_path(machine_key("cpu"))
    assert path.is_file() and path.parent == tmp_path / "machine" and first.path == str(path)
    assert first.memory_bandwidth > 0 and first.page_cache_read > 0 and first.page_cache_mmap > 0
    assert first.page_cache == max(first.page_cache_read, first.page_cache_mmap) and first.tensor_core is None
    assert list(first.gemm) == [gemm_name(torch.float32, 3, 16, 8)] == ["float32 3x16x8"]
    written = path.stat().st_mtime_ns
    again = machine_limits("cpu", [(3, 16, 8)], **small)
    assert again == first and path.stat().st_mtime_ns == written  # read back, nothing measured or written
    more = machine_limits("cpu", [(3, 16, 8), (5, 16, 8)], **small)  # a new shape: timed and added, the rest kept
    assert more.measured_at == first.measured_at and more.memory_bandwidth == first.memory_bandwidth
    assert set(more.gemm) == {"float32 3x16x8", "float32 5x16x8"} and more.gemm["float32 3x16x8"] == first.gemm["float32 3x16x8"]
    assert json.loads(path.read_text())["gemm"] == more.gemm
    fresh = machine_limits("cpu", [(3, 16, 8)], remeasure=True, **small)
    assert fresh.measured_at != first.measured_at and list(fresh.gemm) == ["float32 3x16x8"]
    stale = {**json.loads(path.read_text()), "format": 1}  # measured another way: measured again
    path.write_text(json.dumps(stale))
    assert machine_limits("cpu", [(3, 16, 8)], **small).measured_at != stale["measured_at"]
    threads = torch.get_num_threads()
    assert machine_key("cpu", threads=1)["threads"] == 1
    assert cache_path(machine_key("cpu", threads=1)) != cache_path(machine_key("cpu", threads=2))
    torch.set_num_threads(1 if threads != 1 else 2)
    try:
        other = machine_limits("cpu", [(3, 16, 8)], **small)
    finally:
        torch.set_num_threads(threads)
    assert other.path != first.path and len(list((tmp_path / "machine").glob("*.json"))) == 2
    assert not list((tmp_path / "machine").glob("page-cache-probe-*"))  # the probe file is removed


def test_the_gpu_path_is_chosen_by_the_device_and_cannot_crash_on_a_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PCED_CACHE_DIR", str(tmp_path))
    if not torch.cuda.is_available():
        assert gpu_name(torch.device("cuda")) is None and "gpu" not in machine_key("cuda")
        with pytest.raises(ValueError, match="no CUDA device"):
            machine_limits("cuda", [(3, 16, 8)])
    assert gpu_name(torch.device("cpu")) is None
    key = machine_key("cpu")
    limits = MachineLimits(key=key, device="cuda", memory_bandwidth=3e12, page_cache_read=1e9, page_cache_mmap=2e9,
                           gemm={"bfloat16 9x4096x4096": 2e14}, tensor_core=8e14, measured_at="2026-01-01T00:00:00")
    assert limits.gemm_peak(["bfloat16 9x4096x4096"]) == (8e14, "bfloat16 8192^3 (tensor cores)")  # the peak on CUDA
    assert limits.gemm_peak([]) == (8e14, "bfloat16 8192^3 (tensor cores)")
    cpu = MachineLimits(key=key, device="cpu", memory_bandwidth=1e10, page_cache_read=1e9, page_cache_mmap=2e9,
                        gemm={"float32 5x8x8": 1e9, "float32 50x8x8": 4e9})
    assert cpu.gemm_peak(["float32 5x8x8", "float32 50x8x8"]) == (4e9, "float32 50x8x8")
    line = describe(cpu, ["float32 5x8x8", "float32 50x8x8"])
    assert "GEMM peak 4.0 GFLOP/s (float32 50x8x8), 1.0-4.0 over this run's 2 shapes" in line
    assert key["cpu"] in line and f"{key['threads']} threads" in line
    assert all(flag in line for flag in key["flags"] if flag.startswith("avx512"))


@pytest.mark.slow
def test_the_bench_json_table_and_plot_carry_measured_over_floor(tmp_path, capsys):
    out = tmp_path / "bench"
    env = {**os.environ, "PCED_CACHE_DIR": str(tmp_path / "cache")}  # this machine's limits: measured, not the user's
    result = run_pced("bench", "--random-model", "tiny", "--ks", "1,2", "--doc-tokens", "32", "--repeats", "1",
                      "--new-tokens", "3", "--long-new-tokens", "4", "--storage-dtypes", "float16", "--no-cold",
                      "--out", str(out), env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((out / "bench.json").read_text())
    assert report["model"] == "random tiny" and report["copy_bandwidth_gbs"] > 0 and "memory" not in report
    floors = report["floors"]
    assert floors["gemm_peak_flop_s"] == max(floors["gemm_rates_flop_s"].values()) > 0
    assert floors["machine"]["path"].startswith(str(tmp_path / "cache"))
    for row in report["lengths"][0]["rows"]:
        for method in ("pced", "all", "ape"):
            m = row[method]
            assert m["decode_vs_floor"] == pytest.approx(m["decode_per_token_s"] / m["decode_floor_s"])
            assert m["ttft_vs_floor"] == pytest.approx(m["ttft_s"] / m["ttft_floor_s"])
            assert m["decode_vs_floor"] > 1 and m["ttft_vs_floor"] > 1  # a 2-layer model is all overhead
            assert 0 < m["decode_floor_s"] < m["decode_per_token_s"]
            assert m["floors"]["decode"]["floor_s"] == m["decode_floor_s"]
        assert row["pced"]["decode_floor_s"] > row["all"]["decode_floor_s"]  # k+1 rows read the prefix and suffix again
        assert row["pced"]["ttft_resident_vs_floor"] > 1
        assert row["pced"]["floors"]["ttft"]["read_bytes"] > 0 == row["all"]["floors"]["ttft"]["read_bytes"]
    assert report["storage"][0]["pced_ttft_vs_floor"] > 1 and report["end_to_end"]["pced"]["decode_floor_s"] > 0
    table = (out / "bench.md").read_text()
    assert "Machine: " in table and "x] |" in table and "GEMM peak" in table
    assert (out / "bench.png").stat().st_size > 0
    # refused before anything is measured: an unknown shape, and a random model on an engine that loads its own
    from pced.cli import main

    assert main(["bench", "--random-model", "llama-9000", "--out", str(tmp_path / "bad")]) == 2
    assert "neither a known shape" in capsys.readouterr().err
    assert main(["bench", "--random-model", "tiny", "--backend", "vllm", "--out", str(tmp_path / "bad")]) == 2
    assert "use --model with --backend vllm" in capsys.readouterr().err


def test_the_gpu_targets_hold_decode_against_the_bandwidth_term_they_are_written_for():
    from pced.bench.targets import targets

    pced = {"decode_per_token_s": 0.03, "decode_floor_s": 0.02, "decode_bandwidth_floor_s": 0.01}
    rows = targets({"lengths": [{"rows": [{"k": 8, "pced": pced}]}]})
    assert next(r for r in rows if r["target"].startswith("PCED decode"))["value"] == pytest.approx(3.0)


@pytest.mark.slow
def test_the_backends_bench_prints_each_backends_floor_and_llamacpps_own_rate_beside(tmp_path):
    out = tmp_path / "bench"
    env = {**os.environ, "PCED_CACHE_DIR": str(tmp_path / "cache")}
    result = run_pced("--threads", "1", "bench", "--backend", "llamacpp", "--beside", "transformers", "--ks", "1,2",
                      "--doc-tokens", "32", "--repeats", "1", "--new-tokens", "3", "--out", str(out), env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((out / "bench_backends.json").read_text())
    shapes = report["work_shapes"]
    assert set(shapes) == {"transformers", "llamacpp:f16"}
    assert shapes["llamacpp:f16"]["weight_bytes"] < shapes["transformers"]["weight_bytes"] / 5  # Q4_1 against fp32
    assert shapes["llamacpp:f16"]["matmul_params"] == shapes["transformers"]["matmul_params"]  # the same model
    rates = report["kernel_flop_s"]
    assert list(rates) == ["llamacpp:f16"] and set(rates["llamacpp:f16"]) == {"1", "2", "3"}
    assert min(rates["llamacpp:f16"].values()) > 0
    for row in report["latency"]:
        for name in shapes:
            m = row[name]
            assert m["decode_vs_floor"] == pytest.approx(m["decode_per_token_s"] / m["decode_floor_s"])
            assert m["ttft_vs_floor"] == pytest.approx(m["ttft_s"] / m["ttft_floor_s"])
            assert m["decode_vs_floor"] > 1 and m["ttft_vs_floor"] > 1 and m["floors"]["ttft"]["read_bytes"] > 0
    table = (out / "bench_backends.md").read_text()
    assert "llamacpp:f16's own kernels" in table and "Machine: " in table and table.count("x] |") >= 4
    assert (out / "bench_backends.png").stat().st_size > 0
