"""Cross-encoder rerankers that return raw logits for (query, document) pairs.

The paper reranks the top-N with ``bge-reranker-v2-m3`` through FlagEmbedding's
``FlagReranker`` and turns each logit into a relevance with a sigmoid. Rerankers here return
the raw logit; ``normalize_reranker`` applies the (overflow-safe) sigmoid, so the squashing
lives in one place. Two backends:

* ``SequenceClassifierReranker``: ``AutoModelForSequenceClassification`` on a local directory,
  tokenised as FlagReranker 1.4.2 does (query truncated to 3/4 of ``max_length`` tokens, then
  the pair truncated on the passage side to ``max_length``). Used for bge-reranker-v2-m3.
* ``CrossEncoderReranker``: any local sentence-transformers ``CrossEncoder``, with its
  activation replaced by identity so it, too, yields logits.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from pced.retrieval._local_models import local_model_dir
from pced.retrieval.storage import library_versions, model_fingerprint


class Reranker(Protocol):
    """Scores (query, text) pairs; higher is more relevant; raw logits, not probabilities."""

    name: str

    def score(self, query: str, texts: Sequence[str]) -> np.ndarray: ...

    def describe(self) -> dict[str, Any]: ...


class SequenceClassifierReranker:
    """A local single-logit sequence classifier (e.g. bge-reranker-v2-m3), FlagReranker-style."""

    def __init__(self, model_path: str | os.PathLike, name: str | None = None, device: str = "cpu",
                 dtype: Any = None, batch_size: int = 16, max_length: int = 512,
                 query_max_length: int | None = None) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.model_dir = local_model_dir(model_path)
        self.name = name or self.model_dir.name
        self.device = torch.device(device)
        if dtype is None:
            dtype = torch.float16 if self.device.type == "cuda" else torch.float32
        self.batch_size, self.max_length = batch_size, max_length
        self.query_max_length = query_max_length or max_length * 3 // 4
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            str(self.model_dir), local_files_only=True, dtype=dtype).to(self.device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"{self.model_dir}: a reranker needs one output logit, "
                             f"this model has {self.model.config.num_labels}")
        # Leave the passage at least one token, or pair truncation has nothing left to cut.
        room = max_length - self.tokenizer.num_special_tokens_to_add(pair=True) - 1
        if room < 1:
            raise ValueError(f"max_length={max_length} leaves no room for query and passage")
        self.query_max_length = min(self.query_max_length, room)

    def _truncate_query(self, query: str) -> str:
        ids = self.tokenizer(query, add_special_tokens=False)["input_ids"]
        if len(ids) <= self.query_max_length:
            return query
        return self.tokenizer.decode(ids[: self.query_max_length])

    def score(self, query: str, texts: Sequence[str]) -> np.ndarray:
        """Raw logits ``[len(texts)]`` for ``query`` paired with each text."""
        import torch

        texts = list(texts)
        query = self._truncate_query(query)
        logits = np.empty(len(texts), dtype=np.float32)
        order = np.argsort([-len(t) for t in texts], kind="stable")
        for start in range(0, len(texts), self.batch_size):
            batch = order[start : start + self.batch_size]
            inputs = self.tokenizer([query] * len(batch), [texts[i] for i in batch], padding=True,
                                    truncation="only_second", max_length=self.max_length,
                                    return_tensors="pt").to(self.device)
            with torch.inference_mode():
                logits[batch] = self.model(**inputs).logits.view(-1).float().cpu().numpy()
        return logits

    def describe(self) -> dict[str, Any]:
        return {"type": "sequence-classifier", "name": self.name, "model": str(self.model_dir),
                "fingerprint": model_fingerprint(self.model_dir), "max_length": self.max_length,
                "query_max_length": self.query_max_length,
                "versions": library_versions("transformers", "torch")}


class CrossEncoderReranker:
    """Any local sentence-transformers ``CrossEncoder`` directory, returning raw logits."""

    def __init__(self, model_path: str | os.PathLike, name: str | None = None, device: str = "cpu",
                 batch_size: int = 32, max_length: int | None = None) -> None:
        from sentence_transformers import CrossEncoder

        self.model_dir = local_model_dir(model_path)
        self.name = name or self.model_dir.name
        self.batch_size = batch_size
        self.model = CrossEncoder(str(self.model_dir), device=device, local_files_only=True,
                                  max_length=max_length)
        if self.model.num_labels != 1:
            raise ValueError(f"{self.model_dir}: a reranker needs one output logit, "
                             f"this model has {self.model.num_labels}")

    def score(self, query: str, texts: Sequence[str]) -> np.ndarray:
        """Raw logits ``[len(texts)]`` (the model's own sigmoid is bypassed)."""
        import torch

        texts = list(texts)
        if not texts:
            return np.empty(0, dtype=np.float32)
        logits = self.model.predict([(query, t) for t in texts], batch_size=self.batch_size,
                                    activation_fn=torch.nn.Identity(), convert_to_numpy=True,
                                    show_progress_bar=False)
        return np.asarray(logits, dtype=np.float32).reshape(-1)

    def describe(self) -> dict[str, Any]:
        return {"type": "cross-encoder", "name": self.name, "model": str(self.model_dir),
                "fingerprint": model_fingerprint(self.model_dir),
                "versions": library_versions("sentence-transformers", "transformers", "torch")}


def load_reranker(model_path: str | os.PathLike, backend: str = "auto", **kwargs: Any) -> Reranker:
    """Open a local reranker. ``backend``: ``"auto"`` (sentence-transformers if the directory was
    saved by it, else the FlagReranker-style classifier), ``"cross-encoder"`` or ``"flag"``."""
    model_dir = local_model_dir(model_path)
    if backend == "auto":
        saved_by_st = (Path(model_dir) / "config_sentence_transformers.json").is_file()
        backend = "cross-encoder" if saved_by_st else "flag"
    if backend == "cross-encoder":
        return CrossEncoderReranker(model_dir, **kwargs)
    if backend == "flag":
        return SequenceClassifierReranker(model_dir, **kwargs)
    raise ValueError(f"unknown reranker backend {backend!r}")
