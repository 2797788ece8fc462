"""Every dataset reader refuses a field of the wrong kind (answers that are null, an id that is a
number, a list where text belongs) with one line naming the file, the line or record and the field,
what was expected and what was found; ``pced eval`` does so before any model loads."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from pced.cli import main
from pced.evaluation import DatasetError, load_dataset, make_secret_code

FIXTURES = Path(__file__).parent / "fixtures"
DROP = object()  # the field is left out


def changed(row: dict, change: dict) -> dict:
    return {k: v for k, v in {**row, **change}.items() if v is not DROP}


def jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def refused(expected: str, *args, **kwargs) -> str:
    with pytest.raises(DatasetError) as info:
        load_dataset(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and message == expected, message
    return message


# ----------------------------------------------------------------------------- LongBench

SAMPLE = {"input": "How many harbors?", "context": "Paper A. Twelve harbors.", "answers": ["twelve"],
          "_id": "lb-1", "dataset": "qasper", "all_classes": None, "length": 4}
LONGBENCH_BAD = [
    ({"answers": None}, "field 'answers' must be a non-empty list of strings, got null"),
    ({"answers": [1, None]}, "field 'answers' must be a non-empty list of strings, got [1, null]"),
    ({"answers": []}, "field 'answers' must be a non-empty list of strings, got []"),
    ({"input": 12345}, "field 'input' must be a string, got 12345"),
    ({"context": ["Paper A.", "Paper B."]}, 'field \'context\' must be a string, got ["Paper A.", "Paper B."]'),
    ({"context": DROP}, "field 'context' is missing (expected a string)"),
    ({"_id": 7}, "field '_id' must be a string, got 7"),
    ({"all_classes": "Entity"}, 'field \'all_classes\' must be a list of strings, got "Entity"'),
    ({"length": "4"}, 'field \'length\' must be an integer, got "4"'),
]


@pytest.mark.parametrize("change, expected", LONGBENCH_BAD, ids=[e.split(",")[0] for _, e in LONGBENCH_BAD])
def test_longbench_field_of_the_wrong_kind_names_file_line_and_field(tmp_path, change, expected):
    path = jsonl(tmp_path / "qasper.jsonl", [SAMPLE, "", changed(SAMPLE, change)])
    refused(f"{path}:3: {expected}", path)


@pytest.mark.parametrize("line", ["5", '"a sample"', "[1, 2]", "null"])
def test_longbench_line_that_is_no_object_is_one_line(tmp_path, line):
    path = jsonl(tmp_path / "qasper.jsonl", [SAMPLE, line])
    refused(f"{path}:2: expected a LongBench sample (an object), got {line}", path)


# ----------------------------------------------------------------------------- LOFT

LOFT_BAD = [
    ("test_queries.jsonl", {"query_text": None}, "field 'query_text' must be a string, got null"),
    ("test_queries.jsonl", {"qid": 12}, "field 'qid' must be a non-empty string, got 12"),
    ("test_queries.jsonl", {"answers": ["Kelby", None]},
     "field 'answers' must be a non-empty list of strings (or one such list per turn), got [\"Kelby\", null]"),
    ("test_queries.jsonl", {"metadata": {"qrels": "doc1"}},
     'field \'metadata.qrels\' must be a list of [pid, relevance] pairs, got "doc1"'),
    ("test_queries.jsonl", {"metadata": {"qrels": [["doc1", 1], [2, 1]]}},
     "field 'metadata.qrels[1][0]' must be a non-empty string, got 2"),
    ("test_queries.jsonl", {"metadata": {"qrels": ["doc1"]}},
     'field \'metadata.qrels[0]\' must be a [pid, relevance] pair, got "doc1"'),
    ("test_queries.jsonl", {"metadata": [["doc1", 1]]}, 'field \'metadata\' must be an object, got [["doc1", 1]]'),
    ("corpus.jsonl", {"passage_text": ["Ada", "Merrow"]},
     'field \'passage_text\' must be a string, got ["Ada", "Merrow"]'),
    ("corpus.jsonl", {"pid": 2}, "field 'pid' must be a non-empty string, got 2"),
    ("corpus.jsonl", {"title_text": 5}, "field 'title_text' must be a string, got 5"),
    ("corpus.jsonl", {"passage_text": DROP}, "field 'passage_text' is missing (expected a string)"),
]


def loft_copy(tmp_path: Path, name: str, line: int, row) -> Path:
    folder = tmp_path / "loft_tiny"
    shutil.copytree(FIXTURES / "loft_tiny", folder)
    rows = (folder / name).read_text().splitlines()
    rows[line - 1] = row(json.loads(rows[line - 1])) if callable(row) else row
    jsonl(folder / name, rows)
    return folder


@pytest.mark.parametrize("name, change, expected", LOFT_BAD, ids=[e.split(",")[0] for *_, e in LOFT_BAD])
def test_loft_field_of_the_wrong_kind_names_file_line_and_field(tmp_path, name, change, expected):
    folder = loft_copy(tmp_path, name, 2, lambda row: json.dumps(changed(row, change)))
    refused(f"{folder / name}:2: {expected}", folder)


@pytest.mark.parametrize("name, kind", [("test_queries.jsonl", "a LOFT query"), ("corpus.jsonl", "a LOFT passage")])
def test_loft_array_line_is_one_line(tmp_path, name, kind):
    folder = loft_copy(tmp_path, name, 2, '["q2", "where?"]')
    refused(f'{folder / name}:2: expected {kind} (an object), got ["q2", "where?"]', folder)


def test_loft_icl_json_target_of_the_wrong_kind(tmp_path):
    icl = tmp_path / "icl" / "date" / "32k"
    icl.mkdir(parents=True)
    (icl / "corpus.json").write_text(json.dumps([{"input": "q0", "target": "(A)"}, {"input": "q1", "target": 2}]))
    (icl / "dev_queries.json").write_text(json.dumps([{"input": "q?", "target": "(B)"}]))
    refused(f"{icl / 'corpus.json'}: item 1: field 'target' must be a string, got 2", icl)


# ----------------------------------------------------------------------------- named datasets

HOTPOT = {"_id": "q0", "question": "Where was Mira Quell born?", "answer": "Oskvale", "type": "bridge",
          "supporting_facts": [["Quell", 0]], "context": [["Quell", ["Mira Quell was born in Oskvale."]]]}
MUSIQUE = {"id": "2hop__1", "question": "Where was Mira Quell born?", "answer": "Oskvale", "answer_aliases": [],
           "paragraphs": [{"idx": 0, "title": "Quell", "paragraph_text": "Mira Quell was born in Oskvale.",
                           "is_supporting": True}]}
NQ = {"question": "where was mira quell born", "answers": ["Oskvale"],
      "ctxs": [{"title": "Quell", "text": "Mira Quell was born in Oskvale."}]}


def write_named(root: Path, name: str, change: dict, corpus=None) -> None:
    if name == "hotpotqa":
        (root / name).mkdir(parents=True)
        (root / name / "hotpotqa_train_100.json").write_text(json.dumps([HOTPOT, changed(HOTPOT, change)]))
        (root / name / "hotpotqa_train_corpus.json").write_text(json.dumps(corpus or {"Quell": ["Mira."]}))
    elif name == "musique":
        (root / name).mkdir(parents=True)
        (root / name / "musique_train_100.json").write_text(json.dumps([MUSIQUE, changed(MUSIQUE, change)]))
        (root / name / "musique_train_corpus.json").write_text(json.dumps(corpus or [{"title": "Q", "text": "M."}]))
    elif name == "nq":
        (root / name).mkdir(parents=True)
        with gzip.open(root / name / "nq-open-oracle.jsonl.gz", "wt") as f:
            f.write(json.dumps(NQ) + "\n" + json.dumps(changed(NQ, change)) + "\n")
    else:
        (root / "bbh").mkdir(parents=True)
        rows = [{"input": f"question {i}", "target": f"({'ABC'[i]})"} for i in range(3)]
        data = changed({"canary": "x", "examples": rows}, change)
        (root / "bbh" / "date_understanding.json").write_text(json.dumps(data))


NAMED_BAD = [
    ("hotpotqa", {"supporting_facts": [["Quell", 0], 5]},
     "question 1: field 'supporting_facts[1]' must be a [title, sentence index] pair, got 5"),
    ("hotpotqa", {"supporting_facts": [[5, 0]]}, "question 1: field 'supporting_facts[0][0]' must be a string, got 5"),
    ("hotpotqa", {"supporting_facts": [["Quell"]]},
     'question 1: field \'supporting_facts[0]\' must be a [title, sentence index] pair, got ["Quell"]'),
    ("hotpotqa", {"supporting_facts": DROP},
     "question 1: field 'supporting_facts' is missing (expected a list of [title, sentence index] pairs)"),
    ("hotpotqa", {"context": [["Quell", ["Mira", 3]]]}, "question 1: field 'context[0][1][1]' must be a string, got 3"),
    ("hotpotqa", {"_id": 7}, "question 1: field '_id' must be a non-empty string, got 7"),
    ("musique", {"paragraphs": [{"title": 5, "paragraph_text": "Mira."}]},
     "question 1: field 'paragraphs[0].title' must be a string, got 5"),
    ("musique", {"answer_aliases": ["Oskvale town", None]},
     "question 1: field 'answer_aliases[1]' must be a string, got null"),
    ("musique", {"paragraphs": [{"title": "Q", "paragraph_text": "M.", "is_supporting": "yes"}]},
     "question 1: field 'paragraphs[0].is_supporting' must be true or false, got \"yes\""),
    ("nq", {"answers": "Oskvale"}, 'field \'answers\' must be a non-empty list of strings, got "Oskvale"'),
    ("nq", {"ctxs": []}, "field 'ctxs' must be a non-empty list of {title, text} passages, got []"),
    ("nq", {"question": 5}, "field 'question' must be a non-empty string, got 5"),
    ("bbh-date", {"examples": [{"input": "q", "target": "(A)"}, {"input": "q", "target": 3}]},
     "field 'examples[1].target' must be a string, got 3"),
]
NAMED_FILES = {"hotpotqa": "hotpotqa/hotpotqa_train_100.json", "musique": "musique/musique_train_100.json",
               "nq": "nq/nq-open-oracle.jsonl.gz", "bbh-date": "bbh/date_understanding.json"}


@pytest.mark.parametrize("name, change, expected", NAMED_BAD, ids=[f"{n}-{e.split(',')[0]}" for n, _, e in NAMED_BAD])
def test_named_dataset_field_of_the_wrong_kind_names_file_record_and_field(tmp_path, name, change, expected):
    write_named(tmp_path, name, change)
    where = f"{tmp_path / NAMED_FILES[name]}{':2' if name == 'nq' else ''}"
    refused(f"{where}: {expected}", name, data_dir=tmp_path, n_exemplars=1)


@pytest.mark.parametrize("name, corpus, expected", [
    ("hotpotqa", {"Quell": "Mira Quell was born in Oskvale."},
     'field \'Quell\' must be a list of strings, got "Mira Quell was born in Oskvale."'),
    ("musique", [{"title": "Quell", "text": 5}], "passage 0: field 'text' must be a string, got 5"),
])
def test_corpus_files_of_the_wrong_kind_are_named(tmp_path, name, corpus, expected):
    write_named(tmp_path, name, {}, corpus=corpus)
    refused(f"{tmp_path / name / f'{name}_train_corpus.json'}: {expected}", name, data_dir=tmp_path, setting="corpus")


@pytest.mark.parametrize("settings, expected", [
    ({"n_docs": "4"}, "setting 'n_docs' must be an integer >= 1, got \"4\""),
    ({"doc_tokens": 2.5}, "setting 'doc_tokens' must be an integer >= 1, got 2.5"),
    ({"n_examples": 0}, "setting 'n_examples' must be an integer >= 1, got 0"),
])
def test_secret_code_settings_of_the_wrong_kind_are_one_line(settings, expected):
    with pytest.raises(DatasetError) as info:
        make_secret_code(None, **{"n_docs": 4, "doc_tokens": 32, **settings})
    assert str(info.value) == f"secret-code: {expected}"


# ----------------------------------------------------------------------------- pced eval

@pytest.mark.parametrize("dataset, expected", [
    ("longbench", "qasper.jsonl:2: field 'answers' must be a non-empty list of strings, got null"),
    ("loft", "test_queries.jsonl:2: field 'metadata.qrels' must be a list of [pid, relevance] pairs, got \"doc1\""),
    ("hotpotqa", "question 1: field 'supporting_facts[0][0]' must be a string, got 5"),
])
def test_eval_refuses_wrong_kinds_before_any_model_loads(tmp_path, tiny_model_dir, capsys, monkeypatch, dataset,
                                                         expected):
    import pced.llm

    loads = []
    monkeypatch.setattr(pced.llm, "load_model", lambda *a, **k: loads.append(a) or pytest.fail("a model was loaded"))
    if dataset == "longbench":
        argv = ["--dataset", str(jsonl(tmp_path / "qasper.jsonl", [SAMPLE, changed(SAMPLE, {"answers": None})]))]
    elif dataset == "loft":
        argv = ["--dataset", str(loft_copy(tmp_path, "test_queries.jsonl", 2, lambda row: json.dumps(
            changed(row, {"metadata": {"qrels": "doc1"}}))))]
    else:
        write_named(tmp_path / "data", "hotpotqa", {"supporting_facts": [[5, 0]]})
        argv = ["--dataset", "hotpotqa", "--data-dir", str(tmp_path / "data")]
    code = main(["eval", *argv, "--model", str(tiny_model_dir), "--out", str(tmp_path / "out"),
                 "--work-dir", str(tmp_path / "work"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("pced: error: ") and err.count("\n") == 1 and expected in err, err
    assert loads == [] and not (tmp_path / "out").exists() and not (tmp_path / "work").exists()
