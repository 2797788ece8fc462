"""The expert-trace picture: answer tokens on x, documents on y, the winning expert marked.

Like the paper's HotpotQA trace figure: each column is one generated token; the cell colour is
that expert's calibrated score for the chosen token (softmax over experts, per column), and a
dot marks the expert that won it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from ..text.answers import Answer


def save_trace_png(answer: Answer, candidates: Sequence, path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    steps = answer.trace
    ids = [c.document.id for c in candidates]
    labels = [f"{(c.document.title or c.document.id)[:28]} (r={c.relevance:.2f})" for c in candidates]
    n_tokens, n_docs = max(1, len(steps)), max(1, len(ids))
    support = np.full((n_docs, n_tokens), np.nan)
    for j, step in enumerate(steps):
        if step.support and len(step.support) == len(ids):
            column = np.asarray(step.support, dtype=float)
            column = np.exp(column - column.max())
            support[:, j] = column / column.sum()
    width = min(40.0, 2.5 + 0.32 * n_tokens)
    fig, ax = plt.subplots(figsize=(width, 1.2 + 0.38 * n_docs))
    if ids:
        ax.imshow(np.nan_to_num(support, nan=0.0), aspect="auto", cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    for j, step in enumerate(steps):
        if step.doc_id in ids:
            ax.plot(j, ids.index(step.doc_id), "o", color="#2ca02c", markersize=7, markeredgecolor="black")
    ax.set_yticks(range(len(ids)), labels, fontsize=8)
    ax.set_xticks(range(len(steps)), [repr(s.text)[1:-1] for s in steps], rotation=70, fontsize=8, ha="right")
    ax.set_xlabel("generated token")
    ax.set_title(title or f"expert trace: {answer.text[:80]}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
