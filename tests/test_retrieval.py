"""Score normalisation, BM25, MiniLM dense, hybrid retrieval, candidates and persistence."""

from __future__ import annotations

import json
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pced.documents import Document  # noqa: E402
from pced.retrieval import (  # noqa: E402
    EPS,
    BM25Retriever,
    Candidate,
    DenseRetriever,
    HybridRetriever,
    default_retriever,
    fuse,
    load_retriever,
    normalize_dense,
    normalize_reranker,
    normalize_sparse,
    relevances,
    retrieve,
)
from pced.retrieval.storage import atomic_path, model_fingerprint, save_array  # noqa: E402

pytestmark = pytest.mark.transformers_api  # models and attention transformers builds

CORPUS = [
    Document("volcano", "Mount Etna is an active volcano on the east coast of Sicily, erupting lava "
             "and ash several times a year.", "Mount Etna"),
    Document("bread", "Sourdough bread is leavened with a starter of wild yeast and lactic acid "
             "bacteria instead of baker's yeast.", "Sourdough"),
    Document("chess", "Magnus Carlsen became world chess champion in 2013 by defeating Viswanathan "
             "Anand in Chennai.", "Magnus Carlsen"),
    Document("python", "Python is a programming language created by Guido van Rossum and first "
             "released in 1991.", "Python (programming language)"),
    Document("whale", "The blue whale is the largest animal known to have ever lived, reaching "
             "about thirty metres in length.", "Blue whale"),
    Document("tea", "Green tea is made from Camellia sinensis leaves that are steamed or pan-fired "
             "soon after picking to prevent oxidation.", "Green tea"),
    Document("moon", "Apollo 11 landed the first humans on the Moon in July 1969; Neil Armstrong "
             "stepped out first.", "Apollo 11"),
]


# -- normalisation and fusion --------------------------------------------------------------
def test_normalize_dense_hand_values():
    assert normalize_dense(0.5) == pytest.approx(0.75)
    assert normalize_dense(0.0) == pytest.approx(0.5)
    assert normalize_dense(np.array([-1.0, 1.0])).tolist() == [EPS, 1 - EPS]


def test_normalize_sparse_hand_values():
    assert normalize_sparse(1.0) == pytest.approx(0.5)  # 2/pi * atan(1) = 2/pi * pi/4
    assert normalize_sparse(math.sqrt(3)) == pytest.approx(2 / 3)  # atan(sqrt 3) = pi/3
    assert normalize_sparse(-3.0) == EPS  # negative scores are clamped to 0, then to EPS
    assert normalize_sparse(0.0) == EPS
    assert 1 - 1e-7 < normalize_sparse(1e12) <= 1 - EPS


def test_normalize_reranker_is_a_stable_sigmoid():
    assert normalize_reranker(0.0) == pytest.approx(0.5)
    assert normalize_reranker(2.0) == pytest.approx(1 / (1 + math.exp(-2.0)))
    assert normalize_reranker(-2.0) == pytest.approx(1 / (1 + math.exp(2.0)))
    with np.errstate(over="raise"):  # no overflow warning for huge logits
        extremes = normalize_reranker(np.array([-1e4, 1e4]))
    assert extremes.tolist() == [EPS, 1 - EPS]


def test_fuse_is_the_harmonic_mean():
    assert fuse(0.5, 0.5) == pytest.approx(0.5, abs=1e-7)
    assert fuse(0.2, 0.8) == pytest.approx(2 * 0.2 * 0.8 / (1.0 + EPS))
    tiny = fuse(1 - EPS, EPS)
    assert 0 < tiny < 1e-7
    # vectorised, and bounded by the smaller input times 2
    a, b = np.array([0.1, 0.9, 0.6]), np.array([0.9, 0.1, 0.6])
    np.testing.assert_allclose(fuse(a, b), 2 * a * b / (a + b + EPS))


@pytest.mark.parametrize("fn", [normalize_dense, normalize_sparse, normalize_reranker])
def test_relevance_never_reaches_zero_or_one(fn):
    r = fn(np.array([-np.inf, -1e30, -5.0, 0.0, 5.0, 1e30, np.inf]))
    assert r.dtype == np.float64 and r.shape == (7,)
    assert np.all(r >= EPS) and np.all(r <= 1 - EPS)
    assert np.all(np.isfinite(np.log(r))) and np.all(np.log(r) < 0)
    f = fuse(r, r[::-1])
    assert np.all(f >= EPS) and np.all(f <= 1 - EPS)


# -- BM25 -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bm25() -> BM25Retriever:
    return BM25Retriever().index(CORPUS)


def test_bm25_ranks_the_lexically_matching_document_first(bm25):
    assert bm25.search("which volcano is in Sicily?", 3)[0].doc_id == "volcano"
    assert bm25.search("Guido van Rossum programming language", 3)[0].doc_id == "python"
    hits = bm25.search("world chess champion Carlsen", 7)
    assert hits[0].doc_id == "chess"
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert all(EPS <= h.relevance <= 1 - EPS for h in hits)
    assert hits[0].relevance == pytest.approx(float(normalize_sparse(hits[0].score)))
    assert hits[0].parts == {"bm25": hits[0].score}


def test_bm25_unknown_words_score_zero_everywhere(bm25):
    assert np.all(bm25.scores("zzzz qqqq") == 0)
    hits = bm25.search("the of and", 3)  # stopwords only
    assert [h.index for h in hits] == [0, 1, 2]  # ties keep corpus order
    assert all(h.relevance == EPS for h in hits)


def test_top_n_is_capped_by_corpus_size(bm25):
    assert len(bm25.search("volcano", 90)) == len(CORPUS)
    assert len(bm25.search("volcano", 2)) == 2
    assert bm25.search("volcano", 0) == []


def test_bm25_search_many_matches_search(bm25):
    queries = ["blue whale length", "green tea oxidation", "moon landing 1969"]
    many = bm25.search_many(queries, 4)
    assert many == [bm25.search(q, 4) for q in queries]
    assert [row[0].doc_id for row in many] == ["whale", "tea", "moon"]


def test_bm25_save_load_round_trip(bm25, tmp_path):
    (tmp_path / "unrelated.txt").write_text("kept")
    bm25.save(tmp_path)
    loaded = load_retriever(tmp_path)
    assert isinstance(loaded, BM25Retriever) and loaded.doc_ids == bm25.doc_ids
    for q in ["sourdough yeast starter", "Apollo Armstrong", "nothing matches xyzzy"]:
        np.testing.assert_array_equal(loaded.scores(q), bm25.scores(q))
        assert loaded.search(q, 5) == bm25.search(q, 5)
    assert (tmp_path / "unrelated.txt").read_text() == "kept"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no scratch left
    manifest = json.loads((tmp_path / "retriever.json").read_text())
    assert manifest["type"] == "bm25" and manifest["count"] == len(CORPUS)
    assert "bm25s" in manifest["describe"]["versions"]


def test_index_rejects_empty_and_duplicate_ids():
    with pytest.raises(ValueError):
        BM25Retriever().index([])
    with pytest.raises(ValueError):
        BM25Retriever().index([Document("a", "x"), Document("a", "y")])
    with pytest.raises(RuntimeError):
        BM25Retriever().search("x")


# -- dense (packaged MiniLM) ------------------------------------------------------------------
@pytest.fixture(scope="module")
def dense() -> DenseRetriever:
    return DenseRetriever().index(CORPUS)


def test_dense_ranks_paraphrases_without_word_overlap(dense):
    # No content word of these queries occurs in the target document.
    assert dense.search("biggest creature that ever existed", 3)[0].doc_id == "whale"
    assert dense.search("mountain spewing molten rock in Italy", 3)[0].doc_id == "volcano"
    assert dense.search("astronauts walking on the lunar surface", 3)[0].doc_id == "moon"


def test_dense_scores_are_cosines(dense):
    assert dense.embeddings.dtype == np.float32 and dense.embeddings.shape == (len(CORPUS), 384)
    np.testing.assert_allclose(np.linalg.norm(dense.embeddings, axis=1), 1.0, atol=1e-5)
    doc = CORPUS[2]
    hits = dense.search(doc.render(), 7)
    assert hits[0].doc_id == "chess" and hits[0].score == pytest.approx(1.0, abs=1e-5)
    assert all(-1.0 - 1e-6 <= h.score <= 1.0 + 1e-6 for h in hits)
    assert [h.relevance for h in hits] == pytest.approx(list(normalize_dense([h.score for h in hits])))


def test_dense_search_many_matches_search(dense):
    queries = ["tea leaves", "chess", "bread baking"]
    many = dense.search_many(queries, 3)
    for q, row in zip(queries, many, strict=True):
        single = dense.search(q, 3)
        assert [h.index for h in row] == [h.index for h in single]
        np.testing.assert_allclose([h.score for h in row], [h.score for h in single], atol=1e-6)


def test_dense_save_load_memory_maps_and_scores_identically(dense, tmp_path):
    dense.save(tmp_path / "dense")
    loaded = load_retriever(tmp_path / "dense")
    assert isinstance(loaded, DenseRetriever)
    assert isinstance(loaded.embeddings, np.memmap)
    np.testing.assert_array_equal(np.asarray(loaded.embeddings), dense.embeddings)
    manifest = json.loads((tmp_path / "dense" / "retriever.json").read_text())
    assert manifest["params"]["model_path"] == "embedded:all-MiniLM-L6-v2"  # portable
    assert manifest["describe"]["fingerprint"].startswith("sha256:")
    loaded._model = dense._model  # same weights; skip a second model load
    q = "who invented python"
    np.testing.assert_array_equal(loaded.scores(q), dense.scores(q))


def test_dense_rejects_non_local_model_names():
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        DenseRetriever("sentence-transformers/all-MiniLM-L6-v2")


# -- hybrid -----------------------------------------------------------------------------------
def test_hybrid_fuses_both_scores_for_every_candidate(bm25, dense, tmp_path):
    hybrid = HybridRetriever(bm25, dense)
    query = "first humans on the Moon"
    hits = hybrid.search(query, 3)
    assert hits[0].doc_id == "moon"
    s_all, d_all = bm25.scores(query), dense.scores(query)
    for h in hits:
        assert h.parts == {"bm25": pytest.approx(s_all[h.index]), "minilm": pytest.approx(d_all[h.index])}
        expected = fuse(normalize_sparse(s_all[h.index]), normalize_dense(d_all[h.index]))
        assert h.relevance == pytest.approx(float(expected)) and h.score == h.relevance
    # union of both top-2 lists, cut to top_n by fused relevance
    pool = set(np.argsort(-s_all, kind="stable")[:2]) | set(np.argsort(-d_all, kind="stable")[:2])
    assert {h.index for h in hybrid.search(query, 2)} <= pool
    hybrid.save(tmp_path / "hybrid")
    loaded = load_retriever(tmp_path / "hybrid")
    loaded.dense._model = dense._model
    assert isinstance(loaded, HybridRetriever)
    assert [h.index for h in loaded.search(query, 5)] == [h.index for h in hybrid.search(query, 5)]


def test_rank_fusions_do_not_let_a_zero_bm25_veto_a_dense_match(bm25, dense, tmp_path):
    from pced.retrieval.compose import hybrid_fusion
    from pced.retrieval.scores import fuse_mean, fuse_rrf, ranks

    assert ranks(np.array([0.5, 2.0, 0.5, -1.0])).tolist() == [2, 1, 2, 4]  # ties share the better rank
    assert fuse_rrf(np.array([3.0, 1.0]), np.array([0.9, 0.1])).tolist() == [1.0 - 1e-8, pytest.approx(61 / 62)]
    assert float(fuse_mean(1e-8, 0.8)) == pytest.approx(0.4)
    assert [hybrid_fusion(n) for n in ("hybrid", "hybrid-mean", "hybrid-rrf")] == ["harmonic", "mean", "rrf"]
    with pytest.raises(ValueError, match="fusion"):
        HybridRetriever(bm25, dense, fusion="product")
    query = "biggest creature alive"  # no word of the whale document: BM25 0 there
    whale = [d.id for d in CORPUS].index("whale")
    assert bm25.scores(query)[whale] == 0.0
    harmonic, mean, rrf = (HybridRetriever(bm25, dense, fusion=f) for f in ("harmonic", "mean", "rrf"))
    assert harmonic.scores(query)[whale] < 1e-7  # the paper's harmonic mean: vetoed
    assert mean.scores(query)[whale] == pytest.approx(float(normalize_dense(dense.scores(query)[whale])) / 2)
    assert mean.search(query, 1)[0].doc_id == "whale" and rrf.scores(query)[whale] > 0.4
    for hybrid in (mean, rrf):  # search's relevances are the ones scores() gives every document
        for hit in hybrid.search(query, 4):
            assert hit.relevance == pytest.approx(float(hybrid.scores(query)[hit.index]))


def test_hybrid_refuses_components_over_different_corpora(bm25, dense):
    other = BM25Retriever().index(CORPUS[:3])
    with pytest.raises(ValueError, match="different corpora"):
        HybridRetriever(other, dense)


def test_default_retriever_is_bm25_plus_minilm_hybrid():
    r = default_retriever()
    assert isinstance(r, HybridRetriever) and r.name == "bm25+minilm"


# -- candidates -------------------------------------------------------------------------------
class TableReranker:
    """A stand-in cross-encoder returning fixed logits per document text."""

    name = "table"

    def __init__(self, logits: dict[str, float]) -> None:
        self.logits, self.calls = logits, []

    def score(self, query, texts):
        self.calls.append(list(texts))
        return np.array([self.logits.get(t.split("\n")[0], -5.0) for t in texts])

    def describe(self):
        return {"type": "table"}


def test_retrieve_without_reranker_keeps_retrieval_order(bm25):
    cands = retrieve("volcano Sicily lava", bm25, top_n=5, top_k=3)
    hits = bm25.search("volcano Sicily lava", 5)[:3]
    assert [c.doc_id for c in cands] == [h.doc_id for h in hits]
    for c, h in zip(cands, hits, strict=True):
        assert (c.rerank_score, c.r_rer) == (None, None)
        assert c.relevance == c.r_ret == h.relevance and c.retrieval_score == h.score
    assert relevances(cands).tolist() == [c.relevance for c in cands]
    assert set(cands[0].scores()) == {"retrieval", "r_ret", "bm25"}


def test_retrieve_with_reranker_orders_by_logit_and_fuses(bm25):
    reranker = TableReranker({"Green tea": 3.0, "Blue whale": 0.0, "Mount Etna": -1.0})
    cands = retrieve("volcano whale tea", bm25, top_n=7, reranker=reranker, top_k=3)
    assert [c.doc_id for c in cands] == ["tea", "whale", "volcano"]
    assert len(reranker.calls[0]) == 7  # every retrieved candidate is reranked
    whale = cands[1]
    assert whale.rerank_score == 0.0 and whale.r_rer == pytest.approx(0.5)
    assert whale.relevance == pytest.approx(float(fuse(whale.r_ret, 0.5)))
    assert all(EPS <= c.relevance <= 1 - EPS for c in cands)
    assert {"rerank", "r_rer"} <= set(whale.scores())
    assert isinstance(whale, Candidate)


def test_retrieve_with_reranker_needs_texts_after_load(bm25, tmp_path):
    bm25.save(tmp_path)
    loaded = load_retriever(tmp_path)
    reranker = TableReranker({"Apollo 11": 2.0})
    with pytest.raises(ValueError, match="documents"):
        retrieve("moon", loaded, reranker=reranker)
    cands = retrieve("moon", loaded, reranker=reranker, documents=CORPUS, top_k=None)
    assert cands[0].doc_id == "moon" and len(cands) == len(CORPUS)


# -- storage ----------------------------------------------------------------------------------
def test_atomic_write_leaves_old_file_on_failure(tmp_path):
    target = tmp_path / "a.npy"
    save_array(target, np.arange(3))
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"partial")
            raise RuntimeError("crash mid-write")
    np.testing.assert_array_equal(np.load(target), np.arange(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy"]
    (tmp_path / "plain").write_bytes(b"")  # same permissions as any file the user creates
    assert target.stat().st_mode == (tmp_path / "plain").stat().st_mode


def test_model_fingerprint_changes_with_the_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "w.bin").write_bytes(b"\0" * 10)
    before = model_fingerprint(tmp_path)
    assert model_fingerprint(tmp_path) == before
    (tmp_path / "w.bin").write_bytes(b"\1" * 10)
    assert model_fingerprint(tmp_path) != before


def test_bm25s_debug_lines_stay_out_of_pced_output(bm25, tmp_path, capsys):
    import logging

    logging.getLogger("bm25s").setLevel(logging.DEBUG)  # what importing bm25s does
    root = logging.getLogger()
    handler = logging.StreamHandler()  # what pced index / eval install, at WARNING
    root.addHandler(handler)
    try:
        BM25Retriever().index(CORPUS).save(tmp_path / "bm25")
        load_retriever(tmp_path / "bm25").search("moon", 2)
    finally:
        root.removeHandler(handler)
    assert "Building index" not in capsys.readouterr().err
