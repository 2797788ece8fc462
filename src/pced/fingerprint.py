"""A cheap identity of a model directory's files, for the store and index manifests.

Hashing multi-GB weights in full on every load would dominate start-up; the name, size and first
and last MiB of every file change whenever the weights do in practice (a re-export, a fine-tune),
which is what a manifest needs to notice ("this store was built with another model").
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
