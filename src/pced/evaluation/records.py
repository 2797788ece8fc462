"""The records every dataset loader returns, and the small file helpers the loaders share.

One shape for RAG and ICL alike, so that the runner, the baselines and PCED see the same
fields: an example's own candidate documents (distractor paragraphs or ICL exemplars) and,
for corpus-wide retrieval, a corpus shared by all examples.
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pced.documents import Document
from pced.errors import UserError

__all__ = ["Dataset", "DatasetError", "Example", "read_json", "read_jsonl"]


class DatasetError(UserError):
    """Bad dataset name or files; the message is one line, fit for the CLI to print as is."""


@dataclass
class Example:
    """One test question with its gold answers and (when the dataset has them) candidates."""

    id: str
    question: str
    answers: list[str]  # gold answers, aliases included (all required for multi_answer_*)
    documents: list[Document]  # own candidates; empty when retrieving from Dataset.corpus
    gold_doc_ids: list[str]  # ids of gold documents when known (for retrieval recall)
    metadata: dict[str, Any] = field(default_factory=dict)  # type, level, hops, all_classes...


@dataclass
class Dataset:
    """A loaded benchmark: examples, the metric that scores them, and an optional corpus."""

    name: str
    task: str  # "rag" | "icl"
    metric: str  # key into pced.evaluation.metrics.METRICS
    examples: list[Example]
    corpus: list[Document] | None = None  # for corpus-wide retrieval
    setting: str = ""  # "distractor" | "corpus" | "exemplars": how candidates were built

    def __len__(self) -> int:
        return len(self.examples)


def read_json(path: Path) -> Any:
    """Read a JSON file, turning I/O and syntax problems into a one-line DatasetError."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise DatasetError(f"file not found: {path}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise DatasetError(f"cannot read {path}: {exc}") from None


def read_jsonl(path: Path) -> list[tuple[int, Any]]:
    """Read a JSON-lines file (``.gz`` transparently) as (line number, value) pairs, so that a
    reader's errors can name the line; blank lines are skipped."""
    opener = gzip.open if path.suffix == ".gz" else open
    rows: list[tuple[int, Any]] = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append((number, json.loads(line)))
                    except json.JSONDecodeError as exc:
                        raise DatasetError(f"{path}:{number}: not JSON ({exc.msg})") from None
    except FileNotFoundError:
        raise DatasetError(f"file not found: {path}") from None
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc}") from None
    return rows


def format_exemplar(input_text: str, target: str) -> str:
    """An ICL exemplar in the exact answer format the paper's ICL system prompt demands, so
    that every exemplar expert shows the model how its answer must look."""
    return f"{input_text}\nOutput: ['{target}']"


def example_rng(seed: int, index: int) -> random.Random:
    """A generator private to one example, so that its sampled distractors or exemplars do not
    depend on which other examples were loaded (``limit``) or in which order."""
    return random.Random(f"{seed}:{index}")
