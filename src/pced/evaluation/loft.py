"""LOFT directories: ``corpus.jsonl`` + ``{split}_queries.jsonl``, the benchmark the paper uses.

Format (google-deepmind/loft): corpus lines ``{"pid", "title_text", "passage_text"}``; query
lines ``{"qid", "query_text", "metadata": {"qrels": [[pid, 1], ...]}, "answers"}``.

How answers are read, following LOFT's own evaluation:
- ``answers`` is a flat list, or a list of per-turn lists (``[["(D)"]]`` in ``icl_date``); a
  single turn is unwrapped, several turns (conversational tasks) are rejected.
- In single-answer RAG sets (nq, hotpotqa, ...) the list holds aliases: metric ``subspan_em``.
- In QUEST / QAMParI every listed answer is required (LOFT's ``multi_value_rag``): metric
  ``multi_answer_em``. These are recognised by the word ``quest`` or ``qampari`` in one of
  the last three directory names (LOFT lays data out as ``data/rag/quest/128k/``).
- The word ``icl`` there makes it an ICL task: its corpus passages are the
  exemplars (each example's ``documents``), metric ``icl_em``. LOFT's native BBH layout
  (``corpus.json`` and ``{split}_queries.json``, lists of ``{"input", "target"}``) is read too.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

from pced.documents import Document
from pced.evaluation.kinds import NAME, NUMBER, STRING, Kind, check, check_each, list_of, one_of, pair, record
from pced.evaluation.records import (
    Dataset,
    DatasetError,
    Example,
    format_exemplar,
    read_json,
    read_jsonl,
)

__all__ = ["load_loft_dir", "loft_task_kind"]

_SPLIT_PREFERENCE = ("test", "dev")
PASSAGE = record({"pid": NAME, "passage_text": STRING}, {"title_text": STRING},
                 expected="a LOFT passage (an object)")
_ANSWERS = list_of(STRING, min_len=1)
QUERY = record(
    {"qid": NAME, "query_text": STRING,
     "answers": one_of(STRING, _ANSWERS, list_of(_ANSWERS, min_len=1),
                       expected="a non-empty list of strings (or one such list per turn)")},
    {"metadata": record({}, {"qrels": list_of(pair((NAME, NUMBER), "a [pid, relevance] pair", required=1),
                                              "a list of [pid, relevance] pairs")})},
    expected="a LOFT query (an object)")
EXEMPLAR = record({"input": STRING, "target": STRING}, expected="an {input, target} object")


def loft_task_kind(path: Path) -> str:
    """"icl", "multi" (all answers required) or "rag", from the words of the last three
    directory names of ``path`` (LOFT's layout is ``data/{task}/{dataset}/{length}``)."""
    words = {w for part in path.resolve().parts[-3:] for w in re.split(r"[^a-z0-9]+", part.lower())}
    if "retrieval" in words:
        raise DatasetError(f"{path}: a LOFT retrieval task (answers are passage ids); "
                           "use the rag or icl version")
    if "icl" in words:
        return "icl"
    if words & {"quest", "qampari"}:
        return "multi"
    return "rag"


def _queries_file(path: Path, split: str | None, suffix: str) -> Path:
    if split is not None:
        chosen = path / f"{split}_queries{suffix}"
        if not chosen.is_file():
            raise DatasetError(f"LOFT dir {path}: no {chosen.name}")
        return chosen
    for preferred in (*(f"{s}_queries{suffix}" for s in _SPLIT_PREFERENCE), f"queries{suffix}"):
        if (path / preferred).is_file():
            return path / preferred
    found = sorted(p for p in path.glob(f"*_queries{suffix}") if not p.name.startswith("few_shot"))
    if len(found) == 1:
        return found[0]
    if not found:
        raise DatasetError(f"LOFT dir {path}: corpus found but no *_queries{suffix} file")
    names = ", ".join(p.name for p in found)
    raise DatasetError(f"LOFT dir {path}: several query files ({names}); choose one with split=")


def _dataset_name(path: Path) -> str:
    # LOFT's layout ends in a context-length folder (".../rag/quest/128k"): keep the task too.
    name = path.resolve().name
    if re.fullmatch(r"\d+[km]", name.lower()):
        name = f"{path.resolve().parent.name}-{name}"
    return f"loft:{name}"


def _flatten_answers(where: str, answers: str | list) -> list[str]:
    """A checked ``answers`` value as one list of strings: one string, or one turn unwrapped."""
    if isinstance(answers, str):
        return [answers]
    if isinstance(answers[0], list):
        if len(answers) != 1:
            raise DatasetError(f"{where}: {len(answers)} answer turns; multi-turn "
                               "LOFT tasks are not supported")
        return answers[0]
    return answers


def _checked_lines(path: Path, kind: Kind) -> list[tuple[str, dict]]:
    return [(f"{path}:{number}", check(f"{path}:{number}", row, kind)) for number, row in read_jsonl(path)]


def load_loft_dir(path: Path, *, limit: int | None = None, split: str | None = None) -> Dataset:
    """Load a LOFT task directory (see the module docstring for how answers are read)."""
    if not (path / "corpus.jsonl").is_file():
        return _load_loft_icl_json(path, limit=limit, split=split)
    queries_path = _queries_file(path, split, ".jsonl")
    corpus = [Document(id=row["pid"].strip(), text=row["passage_text"].strip(),
                       title=(row.get("title_text") or "").strip())
              for _, row in _checked_lines(path / "corpus.jsonl", PASSAGE)]
    if not corpus:
        raise DatasetError(f"{path / 'corpus.jsonl'} is empty")
    rows = _checked_lines(queries_path, QUERY)
    known = {doc.id for doc in corpus}
    kind = loft_task_kind(path)
    examples, missing = [], 0
    for where, row in rows if limit is None else rows[:limit]:
        qid, question = row["qid"], row["query_text"].strip()
        answers = _flatten_answers(where, row["answers"])
        qrels = (row.get("metadata") or {}).get("qrels") or []
        gold = list(dict.fromkeys(pid.strip() for pid, *rel in qrels if not rel or rel[0]))
        missing += sum(1 for pid in gold if pid not in known)
        examples.append(Example(
            id=qid, question=question, answers=answers,
            documents=list(corpus) if kind == "icl" else [], gold_doc_ids=gold,
            metadata={k: v for k, v in (row.get("metadata") or {}).items() if k != "qrels"},
        ))
    if missing:
        warnings.warn(f"LOFT dir {path}: {missing} gold pid(s) from qrels are not in corpus.jsonl",
                      stacklevel=3)
    name = _dataset_name(path)
    if kind == "icl":
        return Dataset(name=name, task="icl", metric="icl_em", examples=examples, corpus=None,
                       setting="exemplars")
    metric = "multi_answer_em" if kind == "multi" else "subspan_em"
    return Dataset(name=name, task="rag", metric=metric, examples=examples, corpus=corpus,
                   setting="corpus")


def _load_loft_icl_json(path: Path, *, limit: int | None, split: str | None) -> Dataset:
    """LOFT's BBH layout: ``corpus.json`` (the support set) and ``{split}_queries.json``; the
    gold answer is the target, the exemplars are formatted as in the BBH loader."""
    support = _checked_items(path / "corpus.json")
    queries = _checked_items(_queries_file(path, split, ".json"))
    exemplars = [Document(id=f"support_{i}", text=format_exemplar(s["input"], s["target"]))
                 for i, s in enumerate(support)]
    examples = [Example(id=f"query_{i}", question=q["input"], answers=[q["target"]],
                        documents=list(exemplars), gold_doc_ids=[], metadata={})
                for i, q in enumerate(queries if limit is None else queries[:limit])]
    return Dataset(name=_dataset_name(path), task="icl", metric="icl_em", examples=examples,
                   corpus=None, setting="exemplars")


def _checked_items(path: Path) -> list[dict]:
    return check_each(str(path), read_json(path), EXEMPLAR, expected="a JSON list of {input, target} objects",
                      label="item")
