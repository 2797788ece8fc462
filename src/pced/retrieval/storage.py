"""On-disk helpers shared by every retriever: atomic writes (``pced.fs``), memory-mapped loads, fingerprints.

Each file is written to a temporary name in the same directory and then ``os.replace``-d into
place, so a crash never leaves a half-written index behind, and a process that has the old
file memory-mapped keeps reading the old inode. A retriever writes its manifest
(``retriever.json``) last: its presence means the rest of the directory is complete.
Arrays are plain ``.npy`` without pickle; nothing here ever unpickles.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DataError
from pced.fingerprint import files_fingerprint
from pced.fs import atomic_path, atomic_write_json

MANIFEST = "retriever.json"
FORMAT_VERSION = 1


def save_array(path: str | os.PathLike, array: np.ndarray) -> None:
    """Write one ``.npy`` file atomically (no pickle)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, np.ascontiguousarray(array), allow_pickle=False)


def load_array(path: str | os.PathLike, mmap: bool = True) -> np.ndarray:
    """Read a ``.npy`` file, memory-mapped by default so large indexes open instantly; a missing,
    truncated or malformed file is a one-line ``DataError`` that names it."""
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise DataError(f"{path}: missing or damaged index file ({exc}); re-run pced index") from None


def check_rows(path: Path, array: np.ndarray, rows: int, dim: int | None = None) -> None:
    """An embedding matrix holds one row per document (of the recorded width)."""
    if array.ndim != 2 or array.shape[0] != rows or (dim is not None and array.shape[1] != dim):
        raise DataError(f"{path}: {array.shape} embeddings for {rows} documents"
                        f"{f' of dimension {dim}' if dim else ''}; re-run pced index")


def verify_index_files(root: str | os.PathLike) -> list[str]:
    """Open every array and JSON file of the indexes under ``root`` as their readers do (arrays
    memory-mapped: a truncated one fails here); one line per damaged file."""
    damaged = []
    for path in sorted(Path(root).rglob("*")):
        if any(part.startswith(".") for part in path.relative_to(root).parts) or not path.is_file():
            continue  # a staging leftover, not part of the index
        if path.suffix == ".npy":
            try:
                load_array(path)
            except DataError as exc:
                damaged.append(str(exc))
        elif path.suffix == ".json":
            try:
                load_json(path)
            except (ValueError, OSError) as exc:
                damaged.append(f"{path}: not readable JSON ({exc}); re-run pced index")
    return damaged


def save_json(path: str | os.PathLike, obj: Any) -> None:
    """Write one JSON file atomically."""
    atomic_write_json(path, obj, sort_keys=False, ensure_ascii=False, newline=True)


def load_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def move_files_into(src_dir: Path, dst_dir: Path) -> None:
    """Move every file of a scratch directory into ``dst_dir`` one ``os.replace`` at a time.

    Used for libraries (bm25s) that write several files themselves: they write into a scratch
    directory inside ``dst_dir`` (same file system), then each file lands atomically.
    """
    dst_dir.mkdir(parents=True, exist_ok=True)
    for item in sorted(src_dir.iterdir()):
        os.replace(item, dst_dir / item.name)


def write_manifest(directory: str | os.PathLike, retriever_type: str, **fields: Any) -> None:
    """Write ``retriever.json`` last: it marks the directory as a complete index."""
    manifest = {"type": retriever_type, "format_version": FORMAT_VERSION, **fields}
    save_json(Path(directory) / MANIFEST, manifest)


def read_manifest(directory: str | os.PathLike, expected_type: str | None = None) -> dict[str, Any]:
    """Read ``retriever.json`` and check it describes the index type the caller can load."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"no retrieval index at {directory} ({MANIFEST} missing)")
    manifest = load_json(path)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path}: unsupported format_version {manifest.get('format_version')!r}")
    if expected_type is not None and manifest.get("type") != expected_type:
        raise DataError(f"{path}: index type {manifest.get('type')!r}, expected {expected_type!r}")
    return manifest


def library_versions(*names: str) -> dict[str, str]:
    """Installed versions of the libraries an index depends on, for the store manifest."""
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def model_fingerprint(model_dir: str | os.PathLike) -> str:
    """A cheap identity of a model directory: names, sizes, and first/last MiB of every file.

    Hashing multi-GB weights in full on every ``describe()`` would dominate start-up; the head,
    tail and size of each file change whenever the weights do in practice, which is what an
    index manifest needs to notice ("these embeddings came from a different model").
    """
    root = Path(model_dir)
    files = sorted(p for p in root.rglob("*") if p.is_file() and not _is_hidden(p.relative_to(root)))
    return "sha256:" + files_fingerprint(root, files)


def _is_hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)
