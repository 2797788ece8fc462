"""Corpus shapes and containers chosen by content (pced.corpus.formats through read_corpus)."""

import gzip
import json
from pathlib import Path

import pytest

from pced.cli import main
from pced.corpus.reader import CorpusError, read_corpus
from pced.corpus.formats import content_doc_id, read_documents

SHARED_DATA = Path(__file__).parents[1].parent / "shared" / "data"
RECORDS = [{"id": "a", "title": "Alpha", "text": "Alpha is first."}, {"id": "b", "text": "Beta is second."}]


def test_json_lines_and_a_json_array_give_the_same_documents(tmp_path):
    lines = tmp_path / "c.jsonl"
    lines.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    array = tmp_path / "c.json"
    array.write_text(json.dumps(RECORDS, indent=2))  # a document over many lines: not JSON Lines
    assert read_corpus(lines) == read_corpus(array)
    assert [(d.id, d.title) for d in read_corpus(array)] == [("a", "Alpha"), ("b", "")]
    assert read_documents(array)[0] == "pced"


def test_one_passage_shapes_may_be_mixed(tmp_path):
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps({"pid": "p", "passage_text": "Loft."}) + "\n"
                     + json.dumps({"title": "T", "text": "No id."}) + "\n")
    assert [d.id for d in read_corpus(mixed)] == ["a", "p", content_doc_id("T", "No id.")]


def test_the_shape_is_chosen_by_content_not_by_the_file_name(tmp_path):
    misnamed = tmp_path / "corpus.txt"
    misnamed.write_text(json.dumps([{"pid": "p1", "title_text": "T", "passage_text": "Loft text."}]))
    [document] = read_corpus(misnamed)
    assert (document.id, document.title, document.text) == ("p1", "T", "Loft text.")
    gz = tmp_path / "corpus.jsonl.gz"
    gz.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in RECORDS).encode()))
    assert [d.id for d in read_corpus(gz)] == ["a", "b"]


def test_question_files_yield_each_paragraph_once(tmp_path):
    hotpot = tmp_path / "hotpot.json"
    hotpot.write_text(json.dumps([
        {"question": "q1", "context": [["Alpha", ["Alpha is first.", " It leads."]], ["Beta", ["Beta is second."]]]},
        {"question": "q2", "context": [["Beta", ["Beta is second."]], ["Gamma", ["Gamma is third."]]]},
    ]))
    assert [(d.id, d.text) for d in read_corpus(hotpot)] == [
        ("Alpha", "Alpha is first. It leads."), ("Beta", "Beta is second."), ("Gamma", "Gamma is third.")]
    musique = tmp_path / "musique.json"
    musique.write_text(json.dumps([{"paragraphs": [{"idx": 0, "title": "T", "paragraph_text": "One."},
                                                   {"idx": 1, "title": "T", "paragraph_text": "Two."}]}]))
    assert [d.id for d in read_corpus(musique)] == [content_doc_id("T", "One."), content_doc_id("T", "Two.")]
    clash = tmp_path / "clash.json"
    clash.write_text(json.dumps([{"context": [["Alpha", ["One."]]]}, {"context": [["Alpha", ["Two."]]]}]))
    with pytest.raises(CorpusError, match=r"duplicate id 'Alpha'"):
        read_corpus(clash)


@pytest.mark.parametrize("content,message", [
    (json.dumps({"questions": 3, "name": "x"}), "fits no corpus shape; expected one of: {\"id\", \"text\""),
    (json.dumps([{"name": "x", "body": "y"}]), "keys body, name fits no corpus shape"),
    (json.dumps([{"id": "a", "text": "fine"}, {"pid": "b"}]), "keys pid; expected {\"id\", \"text\", \"title\"?} or LOFT"),
    (json.dumps([{"context": [["T", ["x"]]]}, {"id": "a", "text": "b"}]), "expected HotpotQA {\"context\""),
    ('[{"id": "a",\n "text": }]', ":2:10: invalid JSON"),
    ('{"id": "a", "text": "x"}\n{oops\n', ":2: invalid JSON"),
])
def test_a_file_that_fits_no_shape_is_one_line_naming_the_expected_shape(tmp_path, capsys, content, message):
    corpus = tmp_path / "bad.json"
    corpus.write_text(content)
    assert main(["index", str(corpus), "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "s").exists()


def test_the_shared_hotpotqa_corpus_document_reads_with_eval_ids():
    path = SHARED_DATA / "hotpotqa" / "hotpotqa_train_corpus.json"
    if not path.is_file():
        pytest.skip(f"{path} not present")
    documents = read_corpus(path)
    table = json.loads(path.read_text())
    assert read_documents(path)[0] == "hotpotqa-corpus"
    assert len(documents) == len(table) == 994
    assert documents[0].id == documents[0].title == next(iter(table))
    assert documents[0].text == "".join(table[documents[0].id]).strip()
    questions = SHARED_DATA / "hotpotqa" / "hotpotqa_train_100.json"
    if questions.is_file():  # the questions' paragraphs are the corpus: the same documents
        assert sorted(d.id for d in read_corpus(questions)) == sorted(d.id for d in documents)


def test_the_shared_musique_corpus_reads_with_eval_ids():
    path = SHARED_DATA / "musique" / "musique_train_corpus.json"
    if not path.is_file():
        pytest.skip(f"{path} not present")
    from pced.evaluation.datasets import load_dataset

    ids = [d.id for d in read_corpus(path)]
    assert len(ids) == len(set(ids)) == 1890
    assert [d.id for d in load_dataset("musique", setting="corpus", data_dir=SHARED_DATA, limit=1).corpus] == ids
