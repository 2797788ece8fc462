"""LongBench with distractors, as the paper builds it.

A LongBench file is JSON lines ``{"input", "context", "answers", "_id"?, "all_classes"?,
"dataset"?, "length"?}``. Each sample becomes three documents: its own (gold) context plus
K=2 distractor contexts drawn uniformly, with a per-sample seeded generator, from the OTHER
samples of the same file, shuffled with that generator. The metric follows LongBench's
``dataset2metric``; for trec/triviaqa/samsum/lsht only the first line of a prediction is
scored (LongBench's scorer does this), recorded as ``metadata["first_line"]``.

Several samples can share one context (questions about the same paper or story). Context
ids are content hashes (``ctx-<sha1[:10]>``), so one text has one id (one KV cache), and a
sample's distractors are drawn from the contexts that differ from its own.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pced.documents import Document
from pced.evaluation.kinds import INTEGER, STRING, STRINGS, check, list_of, one_of, record
from pced.evaluation.records import Dataset, DatasetError, Example, example_rng, read_jsonl

__all__ = ["LONGBENCH_METRICS", "load_longbench", "longbench_metric"]

LONGBENCH_METRICS: dict[str, str] = {
    "narrativeqa": "qa_f1", "qasper": "qa_f1", "multifieldqa_en": "qa_f1", "hotpotqa": "qa_f1",
    "2wikimqa": "qa_f1", "musique": "qa_f1", "triviaqa": "qa_f1", "nq": "qa_f1",
    "gov_report": "rouge", "qmsum": "rouge", "multi_news": "rouge", "samsum": "rouge",
    "trec": "classification", "lsht": "classification",
    "lcc": "code_sim", "repobench-p": "code_sim",
    "passage_count": "count", "passage_retrieval_en": "retrieval",
}
_FIRST_LINE_ONLY = frozenset({"trec", "triviaqa", "samsum", "lsht"})
_NEEDS_JIEBA = frozenset({"multifieldqa_zh", "dureader", "vcsum", "passage_retrieval_zh"})
SAMPLE = record(
    {"input": STRING, "context": STRING,
     "answers": one_of(STRING, list_of(STRING, min_len=1), expected="a non-empty list of strings")},
    optional={"_id": STRING, "dataset": STRING, "all_classes": STRINGS, "length": INTEGER},
    expected="a LongBench sample (an object)")


def longbench_metric(dataset: str) -> str:
    """The METRICS key LongBench scores ``dataset`` with (qa_f1 for unknown names)."""
    if dataset in _NEEDS_JIEBA:
        raise DatasetError(f"LongBench subset {dataset!r} needs Chinese (jieba) scoring, "
                           "which is not supported")
    return LONGBENCH_METRICS.get(dataset, "qa_f1")


def _longbench_file(path: Path) -> Path:
    if path.is_file():
        return path
    found = sorted(path.glob("*.jsonl"))
    if len(found) == 1:
        return found[0]
    if not found:
        raise DatasetError(f"{path}: neither a LOFT dir (corpus.jsonl + *_queries.jsonl) nor a "
                           "LongBench dir (one .jsonl file)")
    raise DatasetError(f"{path}: {len(found)} .jsonl files; give the LongBench file itself")


def _context_id(context: str) -> str:
    return "ctx-" + hashlib.sha1(context.encode()).hexdigest()[:10]


def load_longbench(path: Path, *, limit: int | None = None, seed: int = 42,
                   n_distractors: int = 2) -> Dataset:
    """Load a LongBench ``.jsonl`` (or a directory holding exactly one) with distractors."""
    file = _longbench_file(path)
    rows = [check(f"{file}:{number}", row, SAMPLE) for number, row in read_jsonl(file)]
    if not rows:
        raise DatasetError(f"{file}: no samples")
    stem = file.name.split(".")[0]
    dataset = str(rows[0].get("dataset") or (stem[:-2] if stem.endswith("_e") else stem))
    metric = longbench_metric(dataset)

    contexts: dict[str, Document] = {}
    for row in rows:
        doc_id = _context_id(row["context"])
        contexts.setdefault(doc_id, Document(id=doc_id, text=row["context"]))
    context_ids = list(contexts)

    examples = []
    for i, row in enumerate(rows if limit is None else rows[:limit]):
        gold_id = _context_id(row["context"])
        rng = example_rng(seed, i)
        pool = [cid for cid in context_ids if cid != gold_id]
        chosen = [gold_id, *rng.sample(pool, min(n_distractors, len(pool)))]
        rng.shuffle(chosen)
        answers = row["answers"] if isinstance(row["answers"], list) else [row["answers"]]
        examples.append(Example(
            id=row.get("_id") or f"{dataset}-{i}", question=row["input"],
            answers=answers, documents=[contexts[c] for c in chosen],
            gold_doc_ids=[gold_id],
            metadata={"dataset": dataset, "length": row.get("length"),
                      "all_classes": row.get("all_classes"),
                      "first_line": dataset in _FIRST_LINE_ONLY,
                      "gold_position": chosen.index(gold_id)},
        ))
    return Dataset(name=f"longbench:{dataset}", task="rag", metric=metric, examples=examples,
                   corpus=None, setting="distractor")
