"""Gold-paragraph recall of the embedded default retriever on HotpotQA (corpus-wide).

Measured with ``experiments/retrieval_recall.py`` (994 passages, 100 questions, CPU):

| retriever            | recall@8 | all gold@8 | recall@90 | all gold@90 |
|----------------------|----------|------------|-----------|-------------|
| sparse (bm25)        | 0.815    | 0.640      | 0.965     | 0.930       |
| dense (minilm)       | 0.840    | 0.690      | 0.980     | 0.960       |
| hybrid (bm25+minilm) | 0.870    | 0.750      | 0.975     | 0.950       |

The hybrid is the default (best top-8, which is what PCED decodes with); the floors below sit a
few points under its measurement so a regression in tokenisation, rendering, normalisation or
fusion fails loudly while float noise does not.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

from pced.retrieval import HybridRetriever, default_retriever  # noqa: E402

pytestmark = pytest.mark.slow  # MiniLM over 994 HotpotQA passages

REPO_ROOT = Path(__file__).resolve().parents[1]
FLOORS = {8: {"recall": 0.83, "all_gold": 0.70}, 90: {"recall": 0.95, "all_gold": 0.92}}


def _data_dir() -> Path:
    return Path(os.environ.get("PCED_DATA_DIR") or REPO_ROOT.parent / "shared" / "data")


def _recall_script():
    path = REPO_ROOT / "experiments" / "retrieval_recall.py"
    spec = importlib.util.spec_from_file_location("retrieval_recall", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_default_retriever_recall_on_hotpotqa():
    data_dir = _data_dir()
    if not (data_dir / "hotpotqa" / "hotpotqa_train_corpus.json").is_file():
        pytest.skip(f"HotpotQA data not found under {data_dir} (set PCED_DATA_DIR)")
    script = _recall_script()
    documents, questions = script.load_hotpotqa(data_dir)
    assert len(documents) == 994 and len(questions) == 100
    retriever = default_retriever()
    assert isinstance(retriever, HybridRetriever)
    retriever.index(documents)
    result = script.evaluate(retriever, questions, [8, 90])
    for k, floors in FLOORS.items():
        measured = result["k"][str(k)]
        for metric, floor in floors.items():
            assert measured[metric] >= floor, f"{metric}@{k} = {measured[metric]:.3f} < {floor}"
