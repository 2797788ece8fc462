"""Evaluation: the paper's datasets in one record shape, and the official answer metrics."""

from pced.evaluation.datasets import (
    DATASET_NAMES,
    Dataset,
    DatasetError,
    Example,
    load_dataset,
    make_secret_code,
    resolve_data_dir,
    score_example,
)
from pced.evaluation.metrics import (
    METRICS,
    extract_icl_answer,
    extract_loft_prediction,
    icl_em,
    icl_em_pced,
    icl_lenient,
    multi_answer_scores,
    normalize_answer,
    score,
    subspan_em,
)

__all__ = [
    "DATASET_NAMES",
    "METRICS",
    "Dataset",
    "DatasetError",
    "Example",
    "extract_icl_answer",
    "extract_loft_prediction",
    "icl_em",
    "icl_em_pced",
    "icl_lenient",
    "load_dataset",
    "make_secret_code",
    "multi_answer_scores",
    "normalize_answer",
    "resolve_data_dir",
    "score",
    "score_example",
    "subspan_em",
]
