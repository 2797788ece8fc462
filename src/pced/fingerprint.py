"""A model's identity, for the store and index manifests: a cheap fingerprint of a directory's
files, and a model's (its architecture, weights and tokenizer) built from it.

Hashing multi-GB weights in full on every load would dominate start-up; the size, the header and
samples of every file change whenever the weights do in practice (a re-export, a fine-tune),
which is what a manifest needs to notice ("this store was built with another model").
``content_fingerprint`` depends on the bytes only (not on file names or the folder), so a moved or
copied model keeps its identity; ``files_fingerprint`` also hashes relative names.
"""

from __future__ import annotations

import hashlib
import json
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


def weight_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin"))


def architecture(config: object) -> dict:
    """The config without what depends on where or with what it was saved (``_name_or_path``, the
    transformers version): what pins the architecture."""
    return json.loads(json.dumps({k: v for k, v in config.to_dict().items()
                                  if not k.startswith("_") and k != "transformers_version"}, sort_keys=True, default=str))


def model_identity(path: Path, config: object) -> tuple[str, str, dict]:
    """(fingerprint, weights hash, architecture) of a model folder: its architecture and the content
    of its weight files (size, safetensors header and sampled bytes), never its path or file names,
    so a moved or copied model keeps its identity and different weights do not."""
    arch = architecture(config)
    weights = content_fingerprint(weight_files(path))[:16]
    fingerprint = hashlib.sha256((json.dumps(arch, sort_keys=True) + weights).encode()).hexdigest()[:16]
    return fingerprint, weights, arch


def legacy_model_fingerprint(path: Path, config: object, recorded_path: str) -> str:
    """The fingerprint stores recorded before identities were path-free: the whole config (whose
    ``_name_or_path`` was the folder the model was loaded from) plus names, sizes and edges of the
    weight files. Recomputed with the folder a store recorded, so such stores keep opening."""
    settings = dict(config.to_dict(), _name_or_path=recorded_path)
    return files_fingerprint(path, weight_files(path), json.dumps(settings, sort_keys=True, default=str).encode())[:16]


def tokenizer_hash(tokenizer: object) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    digest = hashlib.sha256(vocab.encode())
    digest.update(str(getattr(tokenizer, "chat_template", "")).encode())
    return digest.hexdigest()[:16]
