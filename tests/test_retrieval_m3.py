"""BGE-M3 (dense / sparse / ColBERT) and rerankers on tiny random models built offline.

The models have the real architectures and on-disk layout (see helpers/retrieval.py), so
they load through the same public path as a real local ``bge-m3`` / ``bge-reranker-v2-m3``.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import shutil  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from helpers.retrieval import build_tiny_bge_m3, build_tiny_reranker  # noqa: E402

from pced.documents import Document  # noqa: E402
from pced.retrieval import (  # noqa: E402
    EPS,
    BGEM3Encoder,
    BGEM3Retriever,
    CrossEncoderReranker,
    SequenceClassifierReranker,
    load_reranker,
    load_retriever,
    m3_index,  # noqa: E402
    normalize_dense,
    normalize_reranker,
    normalize_sparse,
    retrieve,
)
from pced.retrieval.bge_m3 import colbert_score, lexical_score  # noqa: E402

pytestmark = pytest.mark.transformers_api  # models and attention transformers builds

DOCS = [
    Document("d0", "dogs run fast"),
    Document("d1", "the cat runs home"),
    Document("d2", "a cat sleeps on a mat"),
    Document("d3", "cat mat park bench"),
    Document("d4", "paris is the capital of france"),
    Document("d5", "rivers flow into the sea , slowly and quietly over many years"),
]
QUERIES = ["cat mat park", "where is the capital of france ?", "dogs sleeps"]
ALL_MODES = ("dense", "sparse", "colbert")


@pytest.fixture(scope="module")
def m3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bge-m3")
    return build_tiny_bge_m3(path, [d.text for d in DOCS] + QUERIES)


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bge-reranker")
    return build_tiny_reranker(path, [d.text for d in DOCS] + QUERIES + ["unseen"])


@pytest.fixture(scope="module")
def m3(m3_dir):
    return BGEM3Retriever(m3_dir, mode="dense", modes=ALL_MODES).index(DOCS)


# -- encoder ----------------------------------------------------------------------------------
def test_encoder_output_shapes_and_norms(m3):
    enc = m3.encoder
    out = enc.encode([d.text for d in DOCS], ALL_MODES)
    assert out.dense.shape == (len(DOCS), 32) and out.dense.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(out.dense, axis=1), 1.0, atol=1e-5)
    special = {0, 1, 2, 3}  # <s> <pad> </s> <unk>
    for doc, weights, vecs in zip(DOCS, out.lexical, out.colbert, strict=True):
        n_tokens = len(enc.tokenizer(doc.text)["input_ids"])  # with <s> ... </s>
        assert vecs.shape == (n_tokens - 1, 32)  # every real token but CLS (</s> included)
        np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
        assert weights and not special & set(weights) and min(weights.values()) > 0
        assert len(weights) == len(set(doc.text.lower().split()))  # one entry per distinct word
    # padding in a batch does not change a text's outputs
    alone = enc.encode([DOCS[0].text], ALL_MODES)
    np.testing.assert_allclose(alone.dense[0], out.dense[0], atol=1e-5)
    np.testing.assert_allclose(alone.colbert[0], out.colbert[0], atol=1e-5)


def test_heads_load_from_safetensors_identically(m3_dir, tmp_path):
    st_dir = tmp_path / "m3-st"
    build_tiny_bge_m3(st_dir, [d.text for d in DOCS] + QUERIES, head_format="safetensors")
    assert not list(st_dir.glob("*.pt"))
    a = BGEM3Encoder(m3_dir).encode(QUERIES, ALL_MODES)
    b = BGEM3Encoder(st_dir).encode(QUERIES, ALL_MODES)
    np.testing.assert_array_equal(a.dense, b.dense)
    assert a.lexical == b.lexical
    for x, y in zip(a.colbert, b.colbert, strict=True):
        np.testing.assert_array_equal(x, y)


def test_missing_head_fails_loudly_only_for_its_mode(m3_dir, tmp_path):
    bare = tmp_path / "no-heads"
    shutil.copytree(m3_dir, bare, ignore=shutil.ignore_patterns("*_linear.pt"))
    enc = BGEM3Encoder(bare)
    assert enc.encode(["cat"], ("dense",)).dense.shape == (1, 32)
    with pytest.raises(FileNotFoundError, match="sparse_linear"):
        enc.encode(["cat"], ("sparse",))
    with pytest.raises(FileNotFoundError, match="colbert_linear"):
        enc.encode(["cat"], ("colbert",))


def test_non_local_model_path_is_refused():
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        BGEM3Retriever("BAAI/bge-m3")


# -- the three retrieval modes -----------------------------------------------------------------
@pytest.mark.parametrize("mode", ["dense", "colbert"])
def test_identical_text_scores_highest(m3, mode):
    retriever = m3.with_mode(mode)
    for doc in DOCS:
        hits = retriever.search(doc.text, len(DOCS))
        assert hits[0].doc_id == doc.id
        tol = 1e-3 if mode == "colbert" else 1e-5  # colbert vectors are stored as float16
        assert hits[0].score == pytest.approx(1.0, abs=tol)
        assert all(-1 - tol <= h.score <= 1 + tol for h in hits)
        assert [h.relevance for h in hits] == pytest.approx(list(normalize_dense([h.score for h in hits])))


def test_sparse_score_grows_with_lexical_overlap(m3):
    sparse = m3.with_mode("sparse")
    assert sparse.kind == "sparse" and sparse.name == "bge-m3-sparse"
    scores = sparse.scores("cat mat park")
    # d0 shares no word, d1 one (cat), d2 two (cat, mat), d3 three (cat, mat, park)
    assert scores[0] == 0.0 and 0 < scores[1] < scores[2] < scores[3]
    assert scores[3] == pytest.approx(3.0, rel=0.05)  # every tiny-model weight is ~1
    hits = sparse.search("cat mat park", 4)
    assert [h.doc_id for h in hits] == ["d3", "d2", "d1", "d0"]  # zero-score tie: corpus order
    assert [h.relevance for h in hits] == pytest.approx(list(normalize_sparse([h.score for h in hits])))


def test_vectorised_scores_equal_the_reference_formulas(m3, monkeypatch):
    monkeypatch.setattr(m3_index, "_COLBERT_CHUNK_TOKENS", 5)  # force several chunks
    docs = m3.encoder.encode([d.text for d in DOCS], ALL_MODES)
    for query in QUERIES:
        q = m3.encoder.encode_queries([query], ALL_MODES)
        by_mode = m3.mode_scores([query])
        np.testing.assert_allclose(by_mode["dense"][0], docs.dense @ q.dense[0], atol=1e-6)
        np.testing.assert_allclose(by_mode["sparse"][0],
                                   [lexical_score(q.lexical[0], d) for d in docs.lexical], rtol=1e-5)
        # colbert vectors are stored as float16, hence the tolerance
        np.testing.assert_allclose(by_mode["colbert"][0],
                                   [colbert_score(q.colbert[0], d) for d in docs.colbert], atol=2e-3)


def test_hits_carry_every_indexed_mode(m3):
    hits = m3.search("cat mat park", 3)
    by_mode = m3.mode_scores(["cat mat park"])
    for h in hits:
        assert set(h.parts) == {"bge-m3-dense", "bge-m3-sparse", "bge-m3-colbert"}
        for mode in ALL_MODES:
            assert h.parts[f"bge-m3-{mode}"] == pytest.approx(float(by_mode[mode][0, h.index]))
    assert len(m3.search("cat", 100)) == len(DOCS)


def test_save_load_round_trip_scores_identically(m3, m3_dir, tmp_path):
    m3.save(tmp_path / "index")
    for mode in ALL_MODES:
        loaded = load_retriever(tmp_path / "index", mode=mode)
        assert isinstance(loaded, BGEM3Retriever) and loaded.kind == mode
        assert all(isinstance(a, np.memmap) for a in loaded.arrays.values())
        original = m3.with_mode(mode)
        for query in QUERIES:
            np.testing.assert_array_equal(loaded.scores(query), original.scores(query))
            assert loaded.search(query, 4) == original.search(query, 4)
    describe = load_retriever(tmp_path / "index").describe()
    assert describe["model"] == str(m3_dir) and describe["fingerprint"].startswith("sha256:")
    assert describe["heads"] == {"colbert_linear": True, "sparse_linear": True}


def test_single_mode_index_stores_only_that_mode(m3_dir, tmp_path):
    sparse = BGEM3Retriever(m3_dir, mode="sparse").index(DOCS)
    sparse.save(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("m3_*.npy")) == [
        "m3_sparse_ids.npy", "m3_sparse_indptr.npy", "m3_sparse_weights.npy"]
    with pytest.raises(ValueError, match="not indexed"):
        sparse.with_mode("dense")


# -- rerankers -----------------------------------------------------------------------------------
def _manual_logits(model_dir, query, texts):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return np.array([model(**tok(query, t, return_tensors="pt")).logits.item() for t in texts])


def test_sequence_classifier_reranker_returns_raw_pair_logits(reranker_dir):
    reranker = SequenceClassifierReranker(reranker_dir, batch_size=2)
    texts = [d.text for d in DOCS]
    logits = reranker.score(QUERIES[0], texts)
    assert logits.shape == (len(DOCS),) and logits.dtype == np.float32
    # batched + padded scoring equals one unpadded forward per pair, in input order
    np.testing.assert_allclose(logits, _manual_logits(reranker_dir, QUERIES[0], texts), atol=1e-5)
    r = normalize_reranker(logits)
    assert np.all((r >= EPS) & (r <= 1 - EPS))
    assert reranker.score(QUERIES[0], []).shape == (0,)


def test_reranker_truncates_long_queries_and_passages(reranker_dir):
    reranker = SequenceClassifierReranker(reranker_dir, max_length=24)
    assert reranker.query_max_length == 18  # 3/4 of max_length, as FlagReranker
    long_query = " ".join(["cat"] * 40)
    long_text = " ".join(["mat"] * 200)
    logits = reranker.score(long_query, [long_text, "dogs"])
    assert np.all(np.isfinite(logits))
    truncated = reranker._truncate_query(long_query)
    assert truncated == " ".join(["cat"] * 18)
    inputs = reranker.tokenizer(truncated, long_text, truncation="only_second", max_length=24)
    assert len(inputs["input_ids"]) == 24  # 18 query + 2 passage + 4 special tokens
    # a max_length too small for 3/4 to leave the passage a token is clamped, not an error
    tight = SequenceClassifierReranker(reranker_dir, max_length=8)
    assert tight.query_max_length == 3 and np.all(np.isfinite(tight.score(long_query, [long_text])))


def test_cross_encoder_backend_agrees_with_sequence_classifier(reranker_dir):
    texts = [d.text for d in DOCS]
    flag = load_reranker(reranker_dir)
    assert isinstance(flag, SequenceClassifierReranker)  # plain HF directory -> FlagReranker-style
    cross = load_reranker(reranker_dir, backend="cross-encoder")
    assert isinstance(cross, CrossEncoderReranker)
    np.testing.assert_allclose(cross.score(QUERIES[1], texts), flag.score(QUERIES[1], texts), atol=1e-5)


def test_retrieve_fuses_m3_relevance_with_reranker(m3, reranker_dir):
    reranker = SequenceClassifierReranker(reranker_dir)
    cands = retrieve(QUERIES[1], m3, top_n=5, reranker=reranker, top_k=3)
    assert len(cands) == 3
    logits = [c.rerank_score for c in cands]
    assert logits == sorted(logits, reverse=True)
    for c in cands:
        assert c.r_rer == pytest.approx(float(normalize_reranker(c.rerank_score)))
        assert c.relevance == pytest.approx(2 * c.r_ret * c.r_rer / (c.r_ret + c.r_rer + EPS))
        assert set(c.scores()) >= {"bge-m3-dense", "bge-m3-sparse", "bge-m3-colbert", "rerank"}


# -- agreement with FlagEmbedding, when it is installed -------------------------------------------
def test_matches_flagembedding_bgem3(m3_dir):
    fe = pytest.importorskip("FlagEmbedding")
    ref = fe.BGEM3FlagModel(str(m3_dir), use_fp16=False, devices="cpu")
    texts = [d.text for d in DOCS]
    want = ref.encode_corpus(texts, return_dense=True, return_sparse=True, return_colbert_vecs=True)
    got = BGEM3Encoder(m3_dir).encode(texts, ALL_MODES)
    np.testing.assert_allclose(got.dense, want["dense_vecs"], atol=1e-6)
    assert got.lexical == [{int(k): float(v) for k, v in lw.items()} for lw in want["lexical_weights"]]
    for a, b in zip(got.colbert, want["colbert_vecs"], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    q = ref.encode_queries([QUERIES[0]], return_sparse=True, return_colbert_vecs=True)
    retriever = BGEM3Retriever(m3_dir, modes=ALL_MODES, colbert_dtype="float32").index(DOCS)
    by_mode = retriever.mode_scores([QUERIES[0]])
    ref_sparse = ref.compute_lexical_matching_score(q["lexical_weights"], want["lexical_weights"])[0]
    np.testing.assert_allclose(by_mode["sparse"][0], ref_sparse, rtol=1e-5)
    ref_colbert = [float(ref.colbert_score(q["colbert_vecs"][0], d)) for d in want["colbert_vecs"]]
    np.testing.assert_allclose(by_mode["colbert"][0], ref_colbert, atol=1e-5)


def test_matches_flagembedding_reranker(reranker_dir):
    fe = pytest.importorskip("FlagEmbedding")
    ref = fe.FlagReranker(str(reranker_dir), use_fp16=False, devices="cpu")
    texts = [d.text for d in DOCS]
    want = ref.compute_score([[QUERIES[0], t] for t in texts])
    got = SequenceClassifierReranker(reranker_dir).score(QUERIES[0], texts)
    np.testing.assert_allclose(got, want, atol=1e-5)
    want_norm = ref.compute_score([[QUERIES[0], t] for t in texts], normalize=True)
    np.testing.assert_allclose(normalize_reranker(got), want_norm, atol=1e-6)
