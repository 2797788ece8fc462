"""Checking a directory of llama.cpp sequence states without loading a model (``pced verify``).

Each file must be what ``states.StateStore`` wrote: a safetensors file with one uint8 ``state``
tensor, the directory's identity (``states.json``) in its metadata, the content hash it is named
after and a CRC-32 of its bytes. The bytes themselves are llama.cpp's serialization: only
llama.cpp can read further into them, which ``StateStore`` does on every restore.
"""

from __future__ import annotations

from pathlib import Path

from ...kv.file_check import check_cache_bytes, read_identity
from ...kv.format import CacheError, mmap_safetensors, verify_files

MANIFEST = "states.json"
FIX = "remove it and re-index (pced index --backend llamacpp), or pced verify --remove"


def check_state_bytes(root: Path, path: Path, digest: str) -> dict:
    """The file's bytes checked as ``pced store show`` checks a cache (header, sizes, identity,
    content hash, checksum), against the directory's states.json."""
    return check_cache_bytes(path, read_identity(root, MANIFEST), digest, "state file", FIX)


def check_state_file(path: Path, identity: dict, digest: str) -> dict:
    """The file's metadata if it is a whole state of ``digest`` built for ``identity``; else a CacheError."""
    meta = check_cache_bytes(path, identity, digest, "state file", FIX)
    try:
        state = mmap_safetensors(path)[1]["state"]
    except Exception as exc:  # a file replaced since its bytes were checked
        raise CacheError(f"state file {path} is damaged or not a pced llama.cpp state: {exc}; {FIX}") from exc
    if state.dim() != 1:
        raise CacheError(f"state file {path} does not hold the document it is named after; {FIX}")
    return meta


def verify_state_dir(root: Path, remove: bool = False, referenced: set[str] | None = None) -> dict:
    """Counts and one line per damaged file; ``remove`` deletes damaged files so that the next index
    run (or an on-demand store's next answer) encodes them again; ``referenced``: see ``verify_files``."""
    identity = read_identity(root, MANIFEST)
    return verify_files(root, "seq", lambda path, digest: check_state_file(path, identity, digest), remove, referenced)
