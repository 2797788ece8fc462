"""BGE-M3 encoder (dense, lexical and multi-vector outputs) on plain transformers + torch.

Why not FlagEmbedding: ``FlagEmbedding`` 1.4.2 does install next to transformers 5.23 / torch
2.13 and its ``BGEM3FlagModel`` works, but (1) ``import FlagEmbedding`` eagerly imports its
fine-tuning stack, dragging in datasets, peft, pandas, pyarrow, ir_datasets, sentencepiece and
more for three formulas; (2) when ``colbert_linear.pt`` / ``sparse_linear.pt`` are missing it
silently initialises the heads at random and returns meaningless scores; (3) a path that does
not exist is sent to ``snapshot_download`` (network); (4) it reads only ``.pt`` heads. So this
module re-implements BGE-M3 inference exactly as ``FlagEmbedding`` 1.4.2 does
(``finetune/embedder/encoder_only/m3/modeling.py`` and ``inference/.../m3.py``):

* dense: L2-normalised hidden state of the first token (CLS pooling);
* sparse: ``relu(sparse_linear(h))`` per token, max-pooled per token id, dropping the
  cls/eos/pad/unk ids and zero weights; score = sum over shared ids of ``w_q * w_d``;
* colbert: ``normalize(colbert_linear(h[:, 1:]))`` for the real tokens after CLS; score = mean
  over query vectors of the max dot product with any document vector.

``tests/test_retrieval_m3.py`` checks these outputs against FlagEmbedding when it is importable.
Heads load from ``*.safetensors`` if present, else ``*.pt`` with ``torch.load(weights_only=True)``
(no arbitrary unpickling); a mode whose head is missing raises instead of guessing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pced.retrieval._local_models import local_model_dir
from pced.retrieval.storage import library_versions, model_fingerprint

COLBERT_HEAD = "colbert_linear"
SPARSE_HEAD = "sparse_linear"
MODES = ("dense", "sparse", "colbert")


@dataclass
class M3Embeddings:
    """Outputs for a list of texts; a field is ``None`` when that mode was not requested."""

    dense: np.ndarray | None  # [n, hidden] float32, unit norm
    lexical: list[dict[int, float]] | None  # token id -> weight, one dict per text
    colbert: list[np.ndarray] | None  # [tokens_i, dim] float32 per text, unit-norm rows


def load_linear_head(model_dir: Path, stem: str) -> Any:
    """Load ``stem.safetensors`` or ``stem.pt`` (a Linear state dict) as a ``torch.nn.Linear``;
    ``None`` if neither exists."""
    import torch

    st_path, pt_path = model_dir / f"{stem}.safetensors", model_dir / f"{stem}.pt"
    if st_path.is_file():
        from safetensors.torch import load_file

        state = load_file(str(st_path))
    elif pt_path.is_file():
        state = torch.load(pt_path, map_location="cpu", weights_only=True)
    else:
        return None
    out_features, in_features = state["weight"].shape
    head = torch.nn.Linear(in_features, out_features, bias="bias" in state)
    head.load_state_dict(state)
    return head.eval()


def lexical_score(query: dict[int, float], doc: dict[int, float]) -> float:
    """BGE-M3 lexical matching score: sum over shared token ids of the weight products."""
    return float(sum(w * doc[t] for t, w in query.items() if t in doc))


def colbert_score(query: np.ndarray, doc: np.ndarray) -> float:
    """BGE-M3 multi-vector score: mean over query vectors of their best match in the document."""
    return float((np.asarray(query, np.float32) @ np.asarray(doc, np.float32).T).max(axis=1).mean())


class BGEM3Encoder:
    """A local BGE-M3 checkpoint (XLM-RoBERTa + colbert/sparse heads) that encodes texts.

    Defaults follow FlagEmbedding's ``BGEM3FlagModel``: 512-token truncation for queries and
    passages, CLS pooling, normalised embeddings. ``dtype`` defaults to float32 on CPU and
    float16 on CUDA (FlagEmbedding's ``use_fp16=True``).
    """

    def __init__(self, model_path: str | os.PathLike, device: str = "cpu", dtype: Any = None,
                 batch_size: int = 16, max_length: int = 512, query_max_length: int = 512) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.model_dir = local_model_dir(model_path)
        self.device = torch.device(device)
        if dtype is None:
            dtype = torch.float16 if self.device.type == "cuda" else torch.float32
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.batch_size, self.max_length, self.query_max_length = batch_size, max_length, query_max_length
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True)
        self.tokenizer.padding_side = "right"  # colbert keeps the first (length - 1) positions
        self.model = AutoModel.from_pretrained(str(self.model_dir), local_files_only=True,
                                               dtype=self.dtype).to(self.device).eval()
        self.heads = {stem: load_linear_head(self.model_dir, stem) for stem in (COLBERT_HEAD, SPARSE_HEAD)}
        for head in self.heads.values():
            if head is not None:
                head.to(self.device, self.dtype)
        # The same ids FlagEmbedding drops from lexical weights: they carry no lexical meaning.
        self.unused_ids = {i for i in (self.tokenizer.cls_token_id, self.tokenizer.eos_token_id,
                                       self.tokenizer.pad_token_id, self.tokenizer.unk_token_id)
                           if i is not None}

    def _head(self, stem: str) -> Any:
        head = self.heads[stem]
        if head is None:
            raise FileNotFoundError(f"{self.model_dir} has no {stem}.safetensors or {stem}.pt; "
                                    "this BGE-M3 mode needs it")
        return head

    def encode(self, texts: Sequence[str], modes: Sequence[str] = ("dense",),
               max_length: int | None = None) -> M3Embeddings:
        """Encode ``texts`` for the requested ``modes`` (any of dense, sparse, colbert)."""
        import torch
        import torch.nn.functional as F

        unknown = set(modes) - set(MODES)
        if unknown:
            raise ValueError(f"unknown BGE-M3 modes {sorted(unknown)}; choose from {MODES}")
        texts = list(texts)
        max_length = max_length or self.max_length
        dense: list[np.ndarray | None] = [None] * len(texts)
        lexical: list[dict[int, float]] = [{} for _ in texts]
        colbert: list[np.ndarray | None] = [None] * len(texts)
        # Longest first, like FlagEmbedding: batches of similar length waste little padding.
        order = np.argsort([-len(t) for t in texts], kind="stable")
        for start in range(0, len(texts), self.batch_size):
            batch_ids = order[start : start + self.batch_size]
            inputs = self.tokenizer([texts[i] for i in batch_ids], padding=True, truncation=True,
                                    max_length=max_length, return_tensors="pt").to(self.device)
            with torch.inference_mode():
                hidden = self.model(input_ids=inputs["input_ids"],
                                    attention_mask=inputs["attention_mask"]).last_hidden_state
                mask = inputs["attention_mask"]
                if "dense" in modes:
                    vecs = F.normalize(hidden[:, 0], dim=-1).float().cpu().numpy()
                if "sparse" in modes:
                    weights = torch.relu(self._head(SPARSE_HEAD)(hidden)).squeeze(-1).float().cpu().numpy()
                if "colbert" in modes:
                    multi = self._head(COLBERT_HEAD)(hidden[:, 1:]) * mask[:, 1:, None].to(hidden.dtype)
                    multi = F.normalize(multi, dim=-1).float().cpu().numpy()
            ids, lengths = inputs["input_ids"].cpu().numpy(), mask.sum(dim=1).cpu().numpy()
            for row, i in enumerate(batch_ids):
                if "dense" in modes:
                    dense[i] = vecs[row]
                if "sparse" in modes:
                    lexical[i] = self._token_weights(ids[row, : lengths[row]],
                                                     weights[row, : lengths[row]])
                if "colbert" in modes:
                    colbert[i] = multi[row, : lengths[row] - 1]  # every real token except CLS
        return M3Embeddings(
            dense=np.stack(dense).astype(np.float32) if "dense" in modes else None,
            lexical=lexical if "sparse" in modes else None,
            colbert=[np.ascontiguousarray(c) for c in colbert] if "colbert" in modes else None,
        )

    def encode_queries(self, queries: Sequence[str], modes: Sequence[str] = ("dense",)) -> M3Embeddings:
        return self.encode(queries, modes, max_length=self.query_max_length)

    def _token_weights(self, ids: np.ndarray, weights: np.ndarray) -> dict[int, float]:
        result: dict[int, float] = {}
        for token, w in zip(ids.tolist(), weights.tolist(), strict=True):
            if token not in self.unused_ids and w > 0 and w > result.get(token, 0.0):
                result[token] = w
        return result

    def describe(self) -> dict[str, Any]:
        return {"model": str(self.model_dir), "fingerprint": model_fingerprint(self.model_dir),
                "max_length": self.max_length, "query_max_length": self.query_max_length,
                "dtype": str(self.dtype).replace("torch.", ""),
                "heads": {stem: head is not None for stem, head in self.heads.items()},
                "versions": library_versions("transformers", "torch", "tokenizers")}
