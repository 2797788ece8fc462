"""Load the paper's evaluation sets into one record shape (:class:`Example`, :class:`Dataset`).

Named datasets read the offline copies under the shared data dir (``shared/data``):
``hotpotqa`` / ``musique`` (per-question distractor paragraphs, or corpus-wide), ``nq`` (a
corpus of all gold passages), the three BBH ICL tasks, and the synthetic ``secret-code`` set.
A path is a LOFT directory (``corpus.jsonl`` + ``*_queries.jsonl``) or a LongBench ``.jsonl``.

Document ids are stable across settings and runs, because KV caches and retrieval indexes are
keyed by them: HotpotQA ids are titles (unique in its corpus); MuSiQue and NQ titles repeat,
so their ids are ``"{title}#{sha1(title, text)[:8]}"``, a content id that needs no corpus file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pced.corpus.formats import content_doc_id  # one id rule for pced eval and pced index
from pced.documents import Document
from pced.evaluation.loft import load_loft_dir
from pced.evaluation.longbench import load_longbench
from pced.evaluation.metrics import METRICS, score
from pced.evaluation.kinds import (
    BOOLEAN,
    INTEGER,
    NAME,
    OBJECT,
    STRING,
    TEXT,
    Kind,
    check,
    check_each,
    list_of,
    pair,
    record,
    table_of,
)
from pced.evaluation.records import (
    Dataset,
    DatasetError,
    Example,
    example_rng,
    format_exemplar,
    read_json,
    read_jsonl,
)
from pced.evaluation.secret_code import make_secret_code

__all__ = [
    "BBH_TASKS",
    "DATASET_NAMES",
    "Dataset",
    "DatasetError",
    "Example",
    "content_doc_id",
    "format_exemplar",
    "load_dataset",
    "make_secret_code",
    "resolve_data_dir",
    "score_example",
]

BBH_TASKS: dict[str, str] = {
    "bbh-date": "date_understanding.json",
    "bbh-web-of-lies": "web_of_lies.json",
    "bbh-tracking7": "tracking_shuffled_objects_seven_objects.json",
}
DATASET_NAMES: tuple[str, ...] = ("hotpotqa", "musique", "nq", *BBH_TASKS, "secret-code")
DATA_DIR_ENV = "PCED_DATA_DIR"
_SETTINGS = (None, "distractor", "corpus")


# --------------------------------------------------------------------------- entry point


def load_dataset(
    name_or_dir: str | os.PathLike[str],
    *,
    setting: str | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    limit: int | None = None,
    seed: int = 42,
    n_exemplars: int = 16,
    n_distractors: int = 2,
    split: str | None = None,
    metric: str | None = None,
    tokenizer: Any = None,
    n_docs: int = 64,
    doc_tokens: int = 2048,
) -> Dataset:
    """Load a named dataset or a LOFT / LongBench path.

    ``setting``: "distractor" (each example carries its own candidates) or "corpus" (retrieve
    from ``Dataset.corpus``); None picks the dataset's natural one (hotpotqa, musique:
    distractor; nq, LOFT: corpus). ICL and LongBench have only their own candidates.
    ``limit`` keeps the first N examples in file order; pools of distractors, exemplars and
    corpora are always built from the whole file, so an example looks the same at any limit.
    ``metric`` overrides the dataset's primary metric (any key of ``METRICS``).
    ``tokenizer``, ``n_docs``, ``doc_tokens`` are for ``secret-code`` only (``n_docs``
    documents of exactly ``doc_tokens`` tokens; ``limit`` = number of instances, default 1).
    """
    if setting not in _SETTINGS:
        raise DatasetError(f"unknown setting {setting!r}; use 'distractor' or 'corpus'")
    if limit is not None and limit < 0:
        raise DatasetError(f"limit must be >= 0, got {limit}")
    name = os.fspath(name_or_dir)
    if name in DATASET_NAMES:
        if name == "secret-code":
            dataset = _load_secret_code(setting=setting, limit=limit, seed=seed,
                                        tokenizer=tokenizer, n_docs=n_docs, doc_tokens=doc_tokens)
        else:
            dataset = _load_named(name, setting=setting, data_dir=data_dir, limit=limit,
                                  seed=seed, n_exemplars=n_exemplars)
    else:
        path = Path(name).expanduser()
        if not path.exists():
            raise DatasetError(
                f"unknown dataset {name!r}: not one of {', '.join(DATASET_NAMES)} "
                "and no such file or directory")
        dataset = _load_path(path, setting=setting, limit=limit, seed=seed,
                             n_distractors=n_distractors, split=split)
    if metric is not None:
        if metric not in METRICS:
            raise DatasetError(f"unknown metric {metric!r}; known: {', '.join(METRICS)}")
        dataset.metric = metric
    return dataset


def _load_secret_code(*, setting: str | None, limit: int | None, seed: int, tokenizer: Any,
                      n_docs: int, doc_tokens: int) -> Dataset:
    if tokenizer is None:
        raise DatasetError("secret-code needs the model's tokenizer (documents are exactly "
                           "N tokens long): pass tokenizer=... or call make_secret_code")
    _require_setting("secret-code", setting, "distractor")
    try:
        return make_secret_code(tokenizer, n_docs=n_docs, doc_tokens=doc_tokens, seed=seed,
                                n_examples=max(1, limit or 1))
    except ValueError as exc:
        raise DatasetError(f"secret-code: {exc}") from None


def _load_named(name: str, *, setting: str | None, data_dir: Any, limit: int | None,
                seed: int, n_exemplars: int) -> Dataset:
    root = resolve_data_dir(data_dir)
    if name == "hotpotqa":
        return load_hotpotqa(root, setting=setting or "distractor", limit=limit)
    if name == "musique":
        return load_musique(root, setting=setting or "distractor", limit=limit)
    if name == "nq":
        return load_nq(root, setting=setting or "corpus", limit=limit)
    _require_setting(name, setting, "distractor")
    return load_bbh(root, name, limit=limit, seed=seed, n_exemplars=n_exemplars)


def _load_path(path: Path, *, setting: str | None, limit: int | None, seed: int,
               n_distractors: int, split: str | None) -> Dataset:
    if path.is_dir() and ((path / "corpus.jsonl").is_file() or (path / "corpus.json").is_file()):
        _require_setting(str(path), setting, "corpus")
        return load_loft_dir(path, limit=limit, split=split)
    if path.is_file() or path.is_dir():
        _require_setting(str(path), setting, "distractor")
        return load_longbench(path, limit=limit, seed=seed, n_distractors=n_distractors)
    raise DatasetError(f"{path}: not a file or directory")


def _require_setting(name: str, setting: str | None, supported: str) -> None:
    if setting is not None and setting != supported:
        raise DatasetError(f"{name} supports only the {supported!r} setting, not {setting!r}")


def score_example(metric_name: str, prediction: str, example: Example) -> float:
    """Score a prediction for an example, passing the per-example metric arguments the
    metadata holds (LongBench ``all_classes`` and its first-line rule)."""
    kwargs: dict[str, Any] = {"first_line": bool(example.metadata.get("first_line", False))}
    if example.metadata.get("all_classes") is not None:
        kwargs["all_classes"] = example.metadata["all_classes"]
    return score(metric_name, prediction, example.answers, **kwargs)


# --------------------------------------------------------------------------- data dir


def _repo_root() -> Path | None:
    for parent in Path(__file__).resolve().parents:
        if (parent / "pyproject.toml").is_file():
            return parent
    return None


def resolve_data_dir(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the shared data lives: the argument, else ``$PCED_DATA_DIR``, else
    ``<repo root>/../shared/data`` (repo root = first parent holding pyproject.toml), else
    ``./../shared/data`` from the working directory. An explicit choice that does not exist is
    an error; for the fallbacks the first existing one wins."""
    if data_dir is not None or os.environ.get(DATA_DIR_ENV):
        chosen = Path(data_dir if data_dir is not None else os.environ[DATA_DIR_ENV]).expanduser()
        if not chosen.is_dir():
            source = "data_dir" if data_dir is not None else f"${DATA_DIR_ENV}"
            raise DatasetError(f"data dir {chosen} ({source}) is not a directory")
        return chosen
    candidates = []
    root = _repo_root()
    if root is not None:
        candidates.append(root.parent / "shared" / "data")
    candidates.append(Path.cwd().parent / "shared" / "data")
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    raise DatasetError(f"no data dir found (looked in {', '.join(map(str, candidates))}); "
                       f"pass --data-dir or set {DATA_DIR_ENV}")


def _data_file(root: Path, name: str, *relative: str) -> Path:
    path = root.joinpath(*relative)
    if not path.is_file():
        raise DatasetError(f"{name}: expected file {path} is missing (data dir {root})")
    return path


def _take(rows: list[Any], limit: int | None) -> list[Any]:
    return rows if limit is None else rows[:limit]


# --------------------------------------------------------------------------- HotpotQA


_SENTENCES = list_of(STRING)
HOTPOTQA_QUESTION = record(
    {"_id": NAME, "question": TEXT, "answer": STRING,
     "context": list_of(pair((STRING, _SENTENCES), "a [title, [sentence, ...]] pair"),
                        "a list of [title, [sentence, ...]] pairs"),
     "supporting_facts": list_of(pair((STRING, INTEGER), "a [title, sentence index] pair"),
                                 "a list of [title, sentence index] pairs")},
    {"type": STRING, "level": STRING}, expected="a HotpotQA question (an object)")
HOTPOTQA_CORPUS = table_of(_SENTENCES, "an object of title: [sentence, ...]")


def _questions(path: Path | str, rows: Any, kind: Kind) -> list[dict]:
    return check_each(str(path), rows, kind, expected="a JSON array of questions", label="question")


def load_hotpotqa(root: Path, *, setting: str = "distractor", limit: int | None = None) -> Dataset:
    """HotpotQA (distractor split format). A paragraph's text is its sentences joined as
    given (they carry their own leading spaces); its id is its title."""
    path = _data_file(root, "hotpotqa", "hotpotqa", "hotpotqa_train_100.json")
    examples = _hotpotqa_examples(read_json(path), setting, limit, path)
    corpus = None
    if setting == "corpus":
        corpus_path = _data_file(root, "hotpotqa", "hotpotqa", "hotpotqa_train_corpus.json")
        table = check(str(corpus_path), read_json(corpus_path), HOTPOTQA_CORPUS)
        corpus = [Document(id=t, text="".join(s).strip(), title=t) for t, s in table.items()]
    return Dataset(name="hotpotqa", task="rag", metric="subspan_em", examples=examples,
                   corpus=corpus, setting=setting)


def _hotpotqa_examples(rows: Any, setting: str, limit: int | None, path: Path | str = "HotpotQA") -> list[Example]:
    examples = []
    for row in _take(_questions(path, rows, HOTPOTQA_QUESTION), limit):
        gold = list(dict.fromkeys(title for title, _ in row["supporting_facts"]))
        documents = [] if setting == "corpus" else [
            Document(id=title, text="".join(sentences).strip(), title=title)
            for title, sentences in row["context"]
        ]
        examples.append(Example(
            id=row["_id"], question=row["question"], answers=[row["answer"]],
            documents=documents, gold_doc_ids=gold,
            metadata={"type": row.get("type"), "level": row.get("level"),
                      "supporting_facts": row["supporting_facts"]},
        ))
    return examples


# --------------------------------------------------------------------------- MuSiQue


MUSIQUE_QUESTION = record(
    {"id": NAME, "question": TEXT, "answer": STRING,
     "paragraphs": list_of(record({"title": STRING, "paragraph_text": STRING}, {"is_supporting": BOOLEAN}))},
    {"answer_aliases": list_of(STRING), "answerable": BOOLEAN, "question_decomposition": list_of(OBJECT)},
    expected="a MuSiQue question (an object)")
PASSAGE = record({"title": STRING, "text": STRING}, expected="a {title, text} passage")


def load_musique(root: Path, *, setting: str = "distractor", limit: int | None = None) -> Dataset:
    """MuSiQue-Ans. Titles repeat in its corpus (85 titles name 2-6 different paragraphs), so
    ids are :func:`content_doc_id` values, identical in both settings."""
    path = _data_file(root, "musique", "musique", "musique_train_100.json")
    examples = _musique_examples(read_json(path), setting, limit, path)
    corpus = None
    if setting == "corpus":
        corpus_path = _data_file(root, "musique", "musique", "musique_train_corpus.json")
        passages = check_each(str(corpus_path), read_json(corpus_path), PASSAGE,
                              expected="a JSON array of passages", label="passage")
        corpus = [Document(id=content_doc_id(p["title"], p["text"]), text=p["text"], title=p["title"])
                  for p in passages]
    return Dataset(name="musique", task="rag", metric="subspan_em", examples=examples,
                   corpus=corpus, setting=setting)


def _musique_examples(rows: Any, setting: str, limit: int | None, path: Path | str = "MuSiQue") -> list[Example]:
    examples = []
    for row in _take(_questions(path, rows, MUSIQUE_QUESTION), limit):
        paragraphs = [Document(id=content_doc_id(p["title"], p["paragraph_text"]),
                               text=p["paragraph_text"], title=p["title"])
                      for p in row["paragraphs"]]
        gold = [doc.id for doc, p in zip(paragraphs, row["paragraphs"], strict=True)
                if p.get("is_supporting")]
        hops = row["id"][0] if row["id"][:1].isdigit() else None
        examples.append(Example(
            id=row["id"], question=row["question"],
            answers=list(dict.fromkeys([row["answer"], *(row.get("answer_aliases") or [])])),
            documents=[] if setting == "corpus" else paragraphs, gold_doc_ids=gold,
            metadata={"hops": int(hops) if hops else None,
                      "answerable": row.get("answerable", True),
                      "question_decomposition": row.get("question_decomposition", [])},
        ))
    return examples


# --------------------------------------------------------------------------- NQ


NQ_QUESTION = record({"question": TEXT, "answers": list_of(STRING, min_len=1),
                      "ctxs": list_of(PASSAGE, "a non-empty list of {title, text} passages", min_len=1)},
                     expected="a Natural Questions question (an object)")

def load_nq(root: Path, *, setting: str = "corpus", limit: int | None = None) -> Dataset:
    """Natural Questions (open) with only gold passages: the corpus is every question's gold
    passage, so for each question the others' passages are the distractors (LOFT-like).
    Identical (title, text) passages are stored once (2,655 questions -> 2,600 passages).
    The "distractor" setting gives each question just its own gold passage (an oracle)."""
    path = _data_file(root, "nq", "nq", "nq-open-oracle.jsonl.gz")
    return _nq_dataset([check(f"{path}:{number}", row, NQ_QUESTION) for number, row in read_jsonl(path)],
                       setting, limit)


def _nq_dataset(rows: list[dict], setting: str, limit: int | None) -> Dataset:
    passages: dict[str, Document] = {}
    gold_ids: list[str] = []
    for row in rows:
        ctx = row["ctxs"][0]
        doc = Document(id=content_doc_id(ctx["title"], ctx["text"]), text=ctx["text"],
                       title=ctx["title"])
        passages.setdefault(doc.id, doc)
        gold_ids.append(doc.id)
    examples = [
        Example(id=f"nq-{i}", question=row["question"], answers=row["answers"],
                documents=[passages[gold_ids[i]]] if setting == "distractor" else [],
                gold_doc_ids=[gold_ids[i]], metadata={})
        for i, row in enumerate(_take(rows, limit))
    ]
    return Dataset(name="nq", task="rag", metric="subspan_em", examples=examples,
                   corpus=list(passages.values()) if setting == "corpus" else None,
                   setting=setting)


# --------------------------------------------------------------------------- BBH (ICL)


_BBH_EXAMPLE = record({"input": STRING, "target": STRING}, expected="an {input, target} object")
BBH_FILE = record({"examples": list_of(_BBH_EXAMPLE, "a non-empty list of {input, target} objects", min_len=1)},
                  expected="a BIG-Bench-Hard task (an object)")


def load_bbh(root: Path, name: str, *, limit: int | None = None, seed: int = 42,
             n_exemplars: int = 16) -> Dataset:
    """A BIG-Bench-Hard task as ICL: each exemplar is one document (one PCED expert), drawn
    without replacement from the task's OTHER examples with a per-example seeded generator."""
    file_name = BBH_TASKS[name]
    path = _data_file(root, name, "bbh", file_name)
    rows = check(str(path), read_json(path), BBH_FILE)["examples"]
    if not 0 <= n_exemplars < len(rows):
        raise DatasetError(
            f"{name}: n_exemplars must be in [0, {len(rows) - 1}], got {n_exemplars}")
    task = Path(file_name).stem
    exemplars = [Document(id=f"{task}-{i}", text=format_exemplar(r["input"], r["target"]))
                 for i, r in enumerate(rows)]
    examples = []
    for i, row in enumerate(_take(rows, limit)):
        others = [j for j in range(len(rows)) if j != i]
        picked = example_rng(seed, i).sample(others, n_exemplars)
        examples.append(Example(
            id=f"{task}-{i}", question=row["input"], answers=[row["target"]],
            documents=[exemplars[j] for j in picked], gold_doc_ids=[],
            metadata={"task": task},
        ))
    return Dataset(name=name, task="icl", metric="icl_em", examples=examples, corpus=None,
                   setting="exemplars")
