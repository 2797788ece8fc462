"""int8 KV storage and the device tier: bytes, round trips, damage, LRU accounting, and that a pooled
store answers exactly like the memory-mapped one."""

import pytest
import torch

from pced.decoding.sampling import SamplingConfig
from pced.generator import Generator
from pced.kv.segment import DocKV, PinnedStaging, quantize_int8
from pced.kv.tiers import GIB, CacheTiers, DevicePool, device_pool
from pced.kv.format import CacheError, verify_cache_dir
from pced.kv.store import KVStore
from pced.documents import Candidate, Document
from pced.text.prompts import PromptBuilder
from pced.decoding.rule import RuleConfig

DOCS = ["Mira Quell founded Zorblax. " * 6, "Oskvale lies on Lake Tarnow and has a long pier. " * 9, "Short one."]
QUESTION = "Where was the founder born?"


def test_int8_quantization_is_symmetric_per_channel_keys_per_token_values():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 10, 8)
    x[:, :, 4] = 0.0  # an all-zero token: exact zeros back, no division by zero
    keys, key_scale = quantize_int8(x, token_dim=2, per_token=False)
    values, value_scale = quantize_int8(x, token_dim=2, per_token=True)
    assert keys.dtype == values.dtype == torch.int8
    assert key_scale.shape == (2, 3, 1, 8) and value_scale.shape == (2, 3, 10, 1)
    assert int(keys.abs().amax(dim=2).min()) == 127  # each channel's largest value maps to +-127
    assert torch.equal(values[:, :, 4], torch.zeros_like(values[:, :, 4]))
    for q, scale in ((keys, key_scale), (values, value_scale)):
        error = (q.float() * scale - x).abs()
        assert bool((error <= scale / 2 + 1e-7).all())  # rounding: at most half a step everywhere


def test_int8_store_halves_the_bytes_and_round_trips(tiny_llm, tmp_path):
    builder = PromptBuilder(tiny_llm.tokenizer)
    sizes = {}
    for dtype in ("float16", "int8"):
        store = KVStore(tmp_path / dtype, tiny_llm, builder, dtype)
        digest = store.add(DOCS[:2], progress=False)[1]
        kv = store.load(digest)
        sizes[dtype] = kv.nbytes / kv.n_tokens
        if dtype == "int8":
            assert kv.quantized and kv.keys.dtype == torch.int8 and kv.key_scale.dtype == torch.float32
            _, heads, _, head_dim = kv.keys.shape
            reference = KVStore(tmp_path / "float16", tiny_llm, builder, "float16").load(digest)
            keys, values = kv.on("cpu")
            for ours, theirs in ((keys, reference.keys), (values, reference.values)):
                relative = ((ours - theirs.float()).norm() / theirs.float().norm()).item()
                assert relative < 0.02, relative  # measured 0.5% (keys) / 1% (values) on the embedded model
    # per layer, head and token: 2*head_dim + 4 bytes (value scale) + the key scales spread over the tokens
    assert sizes["int8"] / sizes["float16"] < 0.6
    assert report_ok(tmp_path / "int8")


def report_ok(root):
    report = verify_cache_dir(root)
    return report["checked"] == 3 and not report["damaged"]


def test_int8_cache_with_a_changed_scale_is_damaged(tiny_llm, tmp_path):
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    builder = PromptBuilder(tiny_llm.tokenizer)
    store = KVStore(tmp_path, tiny_llm, builder, "int8")
    digest = store.add(DOCS[:1], progress=False)[0]
    path = store.path_for(digest)
    with safe_open(str(path), "pt") as handle:
        meta = handle.metadata()
    tensors = load_file(str(path))
    tensors["value_scale"][0, 0, 0, 0] = float("nan")
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(CacheError, match="checksum"):
        store.load(digest)
    assert len(verify_cache_dir(tmp_path)["damaged"]) == 1
    del tensors["key_scale"]
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(CacheError, match="int8 cache"):
        store.load(digest)


def test_pool_keeps_dense_caches_under_its_budget_least_recently_used_first(tiny_llm, tmp_path):
    builder = PromptBuilder(tiny_llm.tokenizer)
    store = KVStore(tmp_path, tiny_llm, builder, "int8")
    digests = store.add(DOCS, progress=False)
    read = {d: (lambda d=d: store._read(store.path_for(d), d, None)) for d in digests}
    dense = {d: read[d]().dense("cpu", torch.float32) for d in digests}
    sizes = {d: kv.nbytes for d, kv in dense.items()}
    assert sizes[digests[2]] < sizes[digests[1]]
    budget = sizes[digests[0]] + sizes[digests[1]]  # room for 0 and 2, or 0 and 1, not for all three
    pool = DevicePool(torch.device("cpu"), torch.float32, budget)
    for d in (digests[0], digests[2]):
        got = pool.get(d, read[d])
        assert got.keys.dtype == torch.float32 and torch.equal(got.keys, dense[d].keys) and torch.equal(got.values, dense[d].values)
    assert pool.get(digests[0], read[digests[0]]) is not None and pool.counters["hits"] == 1
    pool.get(digests[1], read[digests[1]])  # evicts the least recently used: document 2 (0 was just used)
    assert digests[2] not in pool and digests[1] in pool and digests[0] in pool and pool.bytes == budget
    assert pool.counters["misses"] == 3 and pool.counters["evictions"] == 1
    assert pool.stats()["bytes"] == sum(sizes[d] for d in digests if d in pool)
    too_big = DevicePool(torch.device("cpu"), torch.float32, sizes[digests[1]] - 1)
    too_big.get(digests[1], read[digests[1]])
    assert len(too_big) == 0 and too_big.bytes == 0  # larger than the whole budget: used, not kept


def test_tiers_are_checked_and_only_built_where_they_do_something():
    with pytest.raises(ValueError, match="gpu_cache_gb"):
        CacheTiers(gpu_cache_gb=-1)
    assert device_pool(CacheTiers(), "cpu", torch.float32) is None  # a CPU model: mapped caches go straight in
    pool = device_pool(CacheTiers(gpu_cache_gb=0.5), "cpu", torch.float32)
    assert pool.budget == GIB // 2 and pool.staging is None


@pytest.mark.parametrize("storage", ["float16", "int8"])
def test_pooled_store_answers_exactly_like_the_mapped_one(tiny_llm, tmp_path, storage):
    candidates = [Candidate(Document(f"d{i}", text), relevance=0.9 - 0.2 * i) for i, text in enumerate(DOCS)]
    answers = []
    for tiers in (CacheTiers(), CacheTiers(gpu_cache_gb=1.0)):
        generator = Generator(tiny_llm, "rag", tmp_path / storage, storage, tiers=tiers)
        for _ in range(2):  # the second question finds every cache in the pool
            stream = generator.stream(candidates, QUESTION, RuleConfig(), SamplingConfig(max_new_tokens=8, ignore_eos=True))
            tokens = [step.token_id for step in stream]
            answers.append((tokens, stream.last_logits.clone()))
    assert generator.caches.pool.counters["hits"] == len(DOCS) and generator.caches.pool.counters["misses"] == len(DOCS)
    reference_tokens, reference_logits = answers[0]
    for tokens, logits in answers[1:]:
        assert tokens == reference_tokens and torch.equal(logits, reference_logits)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging needs a CUDA device")
def test_pinned_staging_copies_exactly_and_reuses_its_buffers():
    staging = PinnedStaging()
    tensors = [torch.randn(3, 2, n, 8) for n in (5, 50, 7)]
    moved = [staging.copy(t, torch.device("cuda")) for t in tensors]
    torch.cuda.synchronize()
    for t, m in zip(tensors, moved):
        assert m.device.type == "cuda" and torch.equal(m.cpu(), t)
    assert staging.bytes_copied == sum(t.numel() * 4 for t in tensors)
    kv = DocKV(*[quantize_int8(torch.randn(2, 2, 6, 8), 2, per) [0] for per in (False, True)],
               key_scale=torch.rand(2, 2, 1, 8), value_scale=torch.rand(2, 2, 6, 1))
    on_gpu, on_cpu = kv.on("cuda", staging=staging), kv.on("cpu")
    for a, b in zip(on_gpu, on_cpu):
        assert torch.equal(a.cpu(), b)


def test_a_resident_cache_does_not_wait_behind_another_threads_read(tiny_llm, tmp_path):
    import threading

    builder = PromptBuilder(tiny_llm.tokenizer)
    store = KVStore(tmp_path, tiny_llm, builder, "float16")
    first, second = store.add(DOCS[:2], progress=False)
    pool = DevicePool(torch.device("cpu"), torch.float32, GIB)
    pool.get(first, lambda: store._read(store.path_for(first), first, None))
    reading, release = threading.Event(), threading.Event()

    def slow_read():  # a disk read that lasts until the main thread has been served
        reading.set()
        assert release.wait(30)
        return store._read(store.path_for(second), second, None)

    loader = threading.Thread(target=pool.get, args=(second, slow_read))
    loader.start()
    assert reading.wait(30)
    hit = [None]
    reader = threading.Thread(target=lambda: hit.__setitem__(0, pool.get(first, lambda: None)))
    reader.start()
    reader.join(10)
    served = not reader.is_alive()  # before the slow read finished
    release.set()
    loader.join(30)
    reader.join(30)
    assert served and hit[0] is not None and second in pool
    assert pool.counters["hits"] == 1 and pool.counters["misses"] == 2
    again = pool.get(second, lambda: None)  # resident now: read() is not called
    assert again is not None and pool.counters["hits"] == 2


def test_misses_of_different_caches_read_at_the_same_time(tiny_llm, tmp_path):
    """Two threads missing two different caches: the second read starts while the first is still
    reading (one lock for every load made the second wait for the first to finish)."""
    import threading

    builder = PromptBuilder(tiny_llm.tokenizer)
    store = KVStore(tmp_path, tiny_llm, builder, "float16")
    first, second = store.add(DOCS[:2], progress=False)
    pool = DevicePool(torch.device("cpu"), torch.float32, GIB)
    first_reading, second_reading = threading.Event(), threading.Event()

    def read_first():  # lasts until the other cache's read has begun
        first_reading.set()
        assert second_reading.wait(10), "the second cache's read waited behind the first"
        return store._read(store.path_for(first), first, None)

    def read_second():
        second_reading.set()
        return store._read(store.path_for(second), second, None)

    failures = []

    def load_first():
        try:
            pool.get(first, read_first)
        except AssertionError as exc:
            failures.append(exc)

    loader = threading.Thread(target=load_first)
    loader.start()
    assert first_reading.wait(10)
    pool.get(second, read_second)
    loader.join(30)
    assert not failures and first in pool and second in pool and pool.counters["misses"] == 2


def test_the_default_pool_is_none_on_a_cpu_and_a_share_of_free_memory_on_cuda():
    tiers = CacheTiers()
    assert tiers.gpu_cache_gb is None and tiers.budget_bytes(torch.device("cpu")) == 0
    assert device_pool(tiers, "cpu", torch.float32) is None
    assert CacheTiers(gpu_cache_gb=0.5).budget_bytes(torch.device("cpu")) == GIB // 2
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        budget = device_pool(tiers, "cuda", torch.bfloat16).budget
        assert 0 < budget <= free * tiers.cuda_free_share


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging needs a CUDA device")
def test_one_staging_shared_by_threads_copies_every_tensor_exactly():
    """The store's prefix and its pool's loads share one staging from different threads: each copy
    takes a buffer and its turn under the staging's lock, so no copy reads another's bytes."""
    from concurrent.futures import ThreadPoolExecutor

    staging = PinnedStaging()
    tensors = [torch.full((4, 2, 64 + i, 8), float(i)) for i in range(32)]
    with ThreadPoolExecutor(8) as pool:
        moved = list(pool.map(lambda t: staging.copy(t, torch.device("cuda")), tensors))
    torch.cuda.synchronize()
    assert all(torch.equal(m.cpu(), t) for m, t in zip(moved, tensors))
