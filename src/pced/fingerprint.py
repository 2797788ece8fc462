"""A cheap identity of a model directory's files, for the store and index manifests.

Hashing multi-GB weights in full on every load would dominate start-up; the size, the header and
samples of every file change whenever the weights do in practice (a re-export, a fine-tune),
which is what a manifest needs to notice ("this store was built with another model").
``content_fingerprint`` depends on the bytes only (not on file names or the folder), so a moved or
copied model keeps its identity; ``files_fingerprint`` also hashes relative names.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

EDGE = 1 << 20


def files_fingerprint(root: Path, files: Iterable[Path], seed: bytes = b"") -> str:
    """sha256 hex of ``seed``, then each file's path under ``root``, size and edge bytes (the whole
    file when it is at most two edges long)."""
    digest = hashlib.sha256(seed)
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.relative_to(root).as_posix()}:{size}".encode())
        with open(path, "rb") as handle:
            if size <= 2 * EDGE:
                digest.update(handle.read())
            else:
                digest.update(handle.read(EDGE))
                handle.seek(-EDGE, os.SEEK_END)
                digest.update(handle.read(EDGE))
    return digest.hexdigest()


SAMPLES = 8  # blocks read from the inside of a large file, at fixed fractions of its size
SAMPLE = 1 << 16


def file_content_digest(path: Path) -> str:
    """sha256 hex of a file's size, its first and last MiB (a safetensors header is in the first)
    and ``SAMPLES`` blocks in between: the whole file when it is at most two edges long."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as handle:
        if size <= 2 * EDGE:
            digest.update(handle.read())
            return digest.hexdigest()
        digest.update(handle.read(EDGE))
        for k in range(1, SAMPLES + 1):
            handle.seek(size * k // (SAMPLES + 1))
            digest.update(handle.read(SAMPLE))
        handle.seek(-EDGE, os.SEEK_END)
        digest.update(handle.read(EDGE))
    return digest.hexdigest()


def content_fingerprint(files: Iterable[Path], seed: bytes = b"") -> str:
    """sha256 hex of ``seed`` and the files' content digests, in sorted order: independent of
    names, folders and listing order."""
    digest = hashlib.sha256(seed)
    for part in sorted(file_content_digest(path) for path in files):
        digest.update(part.encode())
    return digest.hexdigest()
